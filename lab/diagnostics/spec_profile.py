"""Where a speculative step's time goes (issue 28), on the GPU, one nano model at concurrency 1:

    python3 -m lab.diagnostics.spec_profile [--model models/glm-5.2-nano] [--prompts 6] [--max-tokens 96]

Three engines over one loaded copy (`benchmarks.engine.mtp_gpu.nano_engines`): plain (B), always K
drafts (F: whole greedy steps on the device, backend/engine/speculative/greedy.py), and F again on
the host path (F-host: acceptance and draft planning on the host between forwards). Each is warmed
on the prompts, then run again with every phase of a step wrapped in a wall-clock timer (scheduling,
the verify's planning / forward / acceptance, the draft depths, trim, postprocess), the host's reads
of device values (`.tolist()`, `.item()`) and its host-to-device copies counted, and, separately,
under torch.profiler: the CPU ops that wait for the device (cudaStreamSynchronize, cudaMemcpy…), and
the device's busy time and events (kernels, copies: a replayed graph's nodes) per step. Printed: ms per step per phase, device-busy ms per step, and the
profiler's top CPU and CUDA tables (also in --out). `--device cpu` gives the host-work proxy.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path
from typing import Any

import torch

from backend.engine.speculative import decoder


def timed(obj: Any, name: str, totals: dict[str, float], label: str | None = None) -> None:
    fn = getattr(obj, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            totals[label or name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


_ORIGINALS: list[tuple[Any, str, Any]] = []


def count_transfers() -> dict[str, int]:
    """Count the host's reads of device values and its host-to-device copies (wrapped until
    `restore_transfers`)."""
    import backend.engine.host_staging as staging
    from backend.engine import model_runner
    from backend.engine.speculative import decoder, forwards, verify_graphs

    counts: dict[str, int] = collections.Counter()

    def counting(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        _ORIGINALS.append((obj, name, fn))

        def wrapper(*args: Any, **kw: Any) -> Any:
            counts[label] += 1
            return fn(*args, **kw)

        setattr(obj, name, wrapper)

    counting(torch.Tensor, "tolist", "reads: .tolist()")
    counting(torch.Tensor, "item", "reads: .item()")
    counting(staging.StagingBuffer, "send", "copies: staged send")
    for module in (model_runner, decoder, forwards, verify_graphs):
        for name in ("to_device", "array_to_device"):
            if hasattr(module, name):
                counting(module, name, f"copies: {name}")
    return counts


def restore_transfers() -> None:
    while _ORIGINALS:
        obj, name, fn = _ORIGINALS.pop()
        setattr(obj, name, fn)


def run(engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int) -> int:
    from benchmarks.engine.mtp_gpu import run_prompts

    r = run_prompts(engine, prompts, stops, max_tokens, 1)
    return int(r["steps"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/glm-5.2-nano"))
    ap.add_argument("--task", default="chat")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from benchmarks.engine.mtp_acceptance import held_out_prompts, stop_ids
    from benchmarks.engine.mtp_gpu import Options, nano_engines

    opts = Options(
        device=args.device, models=(args.model,), tasks=(args.task,), num_prompts=args.prompts,
        max_tokens=args.max_tokens, k=3, num_rounds=1, c64=64, c64_rounds=1, rank_of=8, depths=(4, 8),
        projection_tokens=32, acceptance_record=Path("/dev/null"), deadline=time.monotonic() + 600, tiny=False,
    )  # fmt: skip
    engines = nano_engines(args.model, opts, 1)
    prompts = held_out_prompts(args.model, args.task, args.prompts)
    stops = stop_ids(args.model)
    lines = []
    for side in ("B", "F", "F-host"):
        engine = engines[side[0]]
        if engine.spec is not None:
            engine.spec.is_greedy_enabled = side == "F"
        run(engine, prompts, stops, args.max_tokens)  # warm
        totals: dict[str, float] = collections.defaultdict(float)
        counts = count_transfers()
        timed(engine, "step", totals)
        timed(engine.scheduler, "schedule", totals)
        timed(engine, "_postprocess", totals)
        timed(engine.runner, "run", totals, "runner.run (plain step)")
        if engine.spec is not None:
            spec = engine.spec
            for name in ("drafting", "run", "_run_greedy"):
                timed(spec, name, totals, f"spec.{name}")
            # the host path's stages: module functions, looked up in speculative/decoder.py's namespace
            for name in ("plan_target", "choose_tokens", "token_scores", "propose"):
                timed(decoder, name, totals, f"speculative.{name}")
            forwards = engine.runner.spec_forwards
            timed(forwards, "run", totals, "forwards.run (all)")
            timed(forwards, "_depth0", totals, "forwards._depth0")
            timed(forwards, "_chained", totals, "forwards._chained")
            timed(forwards, "_greedy", totals, "forwards._greedy")
            if forwards.graphs is not None:
                timed(forwards.graphs, "run", totals, "verify graphs.run")
                timed(forwards.graphs, "replay_greedy", totals, "verify graphs.replay_greedy")
        counts.clear()
        steps = run(engine, prompts, stops, args.max_tokens)
        lines.append(f"== side {side}: {steps} steps, ms per step:")
        for name, s in sorted(totals.items(), key=lambda kv: -kv[1]):
            lines.append(f"   {name:32} {1e3 * s / steps:8.3f}")
        for name, n in sorted(counts.items()):
            lines.append(f"   {name:32} {n / steps:8.2f} per step")
        if engine.spec is not None:
            lines.append(f"   greedy steps                     {engine.spec.num_greedy_steps}")
        restore_transfers()
        acts = [torch.profiler.ProfilerActivity.CPU]
        acts += [torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else []
        with torch.profiler.profile(activities=acts) as prof:
            steps = run(engine, prompts[:2], stops, args.max_tokens)
        ka = prof.key_averages()
        cuda_us = sum(e.self_device_time_total for e in ka)
        lines.append(
            f"   device busy (sum of kernel self time) {cuda_us / 1e3 / steps:8.3f} ms/step over {steps} steps"
        )
        # kernels and copies the device ran: in a replayed step, about the graph's nodes (launch cost)
        device_events = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        lines.append(f"   device events (kernels, copies)      {device_events / steps:8.1f} per step")
        lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        lines.append(ka.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
