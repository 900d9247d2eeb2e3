"""Where one engine step's time goes: `torch.profiler` over three chosen steps of an offline run.

The Kimi c=64 run of 2026-12-02 spent ~11 s on 65 steps that each carried ~2k prompt tokens, three
times the time of the same 2k chunk with no other request in the batch (35k prompt tok/s alone), while
the host side of such a step is ~1 ms (a `NullModel` run): the cost is on the device and grows with
the decode rows riding in the step. The profile names it. Steps picked, by the decode rows in them:

    prefill   the first step (a prompt chunk, nothing else)
    mixed     the first with at least three quarters of the run's requests decoding beside a chunk
    decode    the first with every request decoding (a pure-decode step: a CUDA-graph replay on the GPU)

Each gets its own profile; the record keeps the step's wall time and its top ops by own device time
(own CPU time where there is no device).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

COLLECTIVE_WORDS = ("nccl", "c10d::", "gloo", "all_reduce", "allreduce", "all_gather", "allgather",
                    "reduce_scatter", "broadcast")  # fmt: skip


class StepProfiler:
    """`around_step` for `run_offline`: profiles the three steps above, once each."""

    def __init__(self, concurrency: int, *, device: str, top: int = 20) -> None:
        self.concurrency = concurrency
        self.is_cuda = torch.device(device).type == "cuda"
        self.top = top
        self.steps: dict[str, dict[str, Any]] = {}

    def pick(self, step: int, decode_rows: int) -> str | None:
        c = self.concurrency
        if step == 0:
            name = "prefill"
        elif decode_rows == c:
            name = "decode"
        elif decode_rows >= max(1, (3 * c) // 4):
            name = "mixed"
        else:
            return None
        return None if name in self.steps else name

    @contextlib.contextmanager
    def __call__(self, step: int, decode_rows: int) -> Iterator[None]:
        name = self.pick(step, decode_rows)
        if name is None:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.is_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            if self.is_cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3
        self.steps[name] = {"step": step, "decode_rows": decode_rows, "wall_ms": wall_ms} | self._table(prof)

    def _table(self, prof: torch.profiler.profile) -> dict[str, Any]:
        def device_us(e: Any) -> float:
            return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))

        events = list(prof.key_averages())
        key = device_us if self.is_cuda else (lambda e: float(e.self_cpu_time_total))
        events.sort(key=key, reverse=True)
        collective = [e for e in events if any(w in e.key.lower() for w in COLLECTIVE_WORDS)]
        return {
            "ranked_by": "own device time" if self.is_cuda else "own CPU time",
            "device_ms_total": sum(device_us(e) for e in events) / 1e3,
            # the collectives' own time (NCCL kernels on CUDA; on the CPU, gloo's ops' CPU time)
            "collective_ms": sum(key(e) for e in collective) / 1e3,
            "ops": [
                {
                    "name": e.key[:120],
                    "count": e.count,
                    "device_ms": device_us(e) / 1e3,
                    "cpu_ms": e.self_cpu_time_total / 1e3,
                }
                for e in events[: self.top]
            ],
        }
