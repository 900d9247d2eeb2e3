"""`--rank-of N`: the per-GPU work of an N-rank deployment, measured on one device.

Rank 0's slice of the full-depth model (every layer at 1/N of the heads, 1/N of the experts, 1/N of
the vocabulary; its KV pool as `kumo plan` gives one GPU at tp = N) runs alone: the process joins a
process group of N ranks whose backend is `LocalCollectives`, in which each collective is a local op
over the same bytes, so the step runs the memory traffic of the real collective's buffers but moves
nothing between GPUs:

    collective            local op (same sizes)                       what rank 0 then holds
    all-reduce [n]        x ← x · 1 (reads and writes n)               its own partial sum
    all-gather [n] → [Nn] N copies of its input                        its shard N times
    reduce-scatter [Nn]   the sum of the N slices (reads Nn, writes n)

The values are not the deployment's (rank 0's partials stand in for the sums), but every shape,
kernel and byte of rank 0's step is; the router's expert choice is random either way. Each stand-in is
one op on the current stream into the caller's buffer (no host sync, no allocation), so pure-decode
steps are captured into CUDA graphs as on one device (backend/engine/decode_graphs.py): a replay runs
the stand-ins without calling them, and `calls` grows only on eager steps (and at capture). What the real
collectives would cost is modelled, not measured: `collective_probe` counts, for a pure-decode step
at c = 1 and at the scenario's concurrency, the calls and bytes of each collective (one step's
forward through the engine, 1-token prompts: the same shapes as a decode step), and the time a ring
over NVLink would take, `sent / bandwidth + calls × latency`, with a ring all-reduce of n bytes
sending 2(N−1)/N·n per rank and an all-gather or reduce-scatter (N−1)/N of the gathered size. The
record states the bandwidth and latency it assumed and labels the figures "modelled".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from schemas.backend import EngineRequest, SamplingParams

BACKEND = "kumo-local"
NVLINK_GBPS = 450.0  # H200 NVLink 4: 900 GB/s per GPU both ways, 450 GB/s each way
LATENCY_US = 10.0  # per collective call: NCCL's small-message latency over 8 NVLink GPUs, about


class _Done(dist._Work):
    """A collective already complete (the local op ran on the current stream)."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: Future[list[torch.Tensor]] = Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> Future[list[torch.Tensor]]:
        return self._future


class LocalCollectives(dist.ProcessGroup):
    """Rank `rank` of `size` ranks, alone: each collective a local op of the same size, counted in
    `calls` as (op, payload bytes): all-reduce n, all-gather and reduce-scatter the gathered size."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.calls: list[tuple[str, int]] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        for t in tensors:
            torch.mul(t, 1, out=t)
            self.calls.append(("all_reduce", t.nbytes))
        return _Done(tensors)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Done:
        out.view(self.size(), -1).copy_(inp.reshape(1, -1).expand(self.size(), -1))
        self.calls.append(("all_gather", out.nbytes))
        return _Done([out])

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Done:
        torch.sum(inp.view(self.size(), -1), 0, out=out.view(-1))
        self.calls.append(("reduce_scatter", inp.nbytes))
        return _Done([out])

    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND


def join_alone(world_size: int) -> LocalCollectives:
    """Make this process rank 0 of `world_size` over `LocalCollectives` (the default group)."""
    made: list[LocalCollectives] = []

    def create(common: Any, _options: Any = None) -> LocalCollectives:
        made.append(LocalCollectives(common.group_rank, common.group_size))
        return made[-1]

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, rank=0, world_size=world_size, store=dist.HashStore())
    return made[0]


def ring_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for one collective in a ring."""
    share = (world_size - 1) / world_size
    return (2 * share if op == "all_reduce" else share) * nbytes


def summarize(
    calls: list[tuple[str, int]],
    world_size: int,
    *,
    gbps: float = NVLINK_GBPS,
    latency_us: float = LATENCY_US,
) -> dict[str, Any]:
    """Per collective: calls, payload bytes, bytes sent per rank and the modelled seconds; and the total."""
    by_op: dict[str, dict[str, float]] = defaultdict(
        lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0}
    )
    for op, nbytes in calls:
        entry = by_op[op]
        entry["calls"] += 1
        entry["payload_bytes"] += nbytes
        entry["sent_bytes"] += ring_sent(op, nbytes, world_size)
    for entry in by_op.values():
        entry["modelled_s"] = entry["sent_bytes"] / (gbps * 1e9) + entry["calls"] * latency_us * 1e-6
    total = {
        k: sum(e[k] for e in by_op.values()) for k in ("calls", "payload_bytes", "sent_bytes", "modelled_s")
    }
    return {"by_collective": dict(by_op), "total": total}


def collective_probe(
    model: torch.nn.Module,
    pg: LocalCollectives,
    *,
    vocab: int,
    context_window: int,
    concurrency: int,
    device: Any,
) -> dict[str, Any]:
    """The collectives of one pure-decode-shaped step at c = 1 and c = `concurrency` (modelled)."""
    steps = {}
    for c in sorted({1, concurrency}):
        config = EngineConfig.build(
            num_pages=c + 1,
            page_size=16,
            max_num_seqs=c,
            max_num_batched_tokens=max(c, 16),
            cuda_graphs=False,
        )
        engine = Engine(
            model,  # type: ignore[arg-type]
            config,
            vocab_size=vocab,
            context_window=context_window,
            model_dtype=torch.bfloat16,
            device=device,
        )
        for i in range(c):  # 1-token prompts: the prefill step has a decode step's shapes
            engine.add_request(
                EngineRequest(
                    request_id=f"probe-{i}",
                    prompt_token_ids=[i % vocab],
                    tenant_salt="0" * 32,
                    sampling=SamplingParams(max_tokens=1, temperature=0.0),
                )
            )
        pg.calls.clear()
        engine.step()
        steps[f"c{c}"] = summarize(pg.calls, pg.size())
        while engine.has_unfinished:
            engine.step()
        pg.calls.clear()
    return {
        "label": "modelled: bytes counted from rank 0's step, time = ring bytes / bandwidth + calls × latency",
        "world_size": pg.size(),
        "nvlink_gbps_each_way": NVLINK_GBPS,
        "latency_us_per_call": LATENCY_US,
        "per_decode_step": steps,
    }
