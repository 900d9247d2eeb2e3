"""Where a speculative step's time goes (issue 28), on the GPU, one nano model at concurrency 1:

    python3 -m lab.diagnostics.spec_profile [--model models/glm-5.2-nano] [--prompts 6] [--max-tokens 96]

Engines over one loaded copy (`benchmarks.engine.mtp_gpu.nano_engines`): plain (B), speculation on
with its policy held at k = 0 (A0: what a spec engine's plain step costs beyond B's), always K
drafts (F: whole greedy steps on the device, backend/engine/speculative/greedy.py), and F again on
the host path (F-host: acceptance and draft planning on the host between forwards). Each is warmed
on the prompts, then run again with every phase of a step wrapped in a wall-clock timer (scheduling,
the verify's planning / forward / acceptance, the draft depths, trim, postprocess), the host's reads
of device values (`.tolist()`, `.item()`) and its host-to-device copies counted, and, separately,
under torch.profiler: the CPU ops that wait for the device (cudaStreamSynchronize, cudaMemcpy…), and
the device's busy time and events (kernels, copies: a replayed graph's nodes) per step. Printed: ms per step per phase, device-busy ms per step, and the
profiler's top CPU and CUDA tables (also in --out). `--device cpu` gives the host-work proxy.

Steps are also timed by kind (a whole greedy step, a step with a prompt's prefill, any other), and the
profiler leaves each prompt's first step out: the prefill is eager (the torch MoE's per-expert loop,
its `nonzero` syncs, the MTP layer over the prompt besides the target), and in the per-step averages
of 2026-12-05 its ops read as the speculative step's (lab/results/2026-12-05-r13-spechost/).
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


def step_kinds(engine: Any, totals: dict[str, float]) -> dict[str, list[Any]]:
    """Wrap `engine.step` (already timed) to time each step by kind: a whole greedy step on the
    device, a prompt's first step (its prefill), or any other (a plain step, or the host path)."""
    kinds: dict[str, list[Any]] = collections.defaultdict(lambda: [0, 0.0])
    fn = engine.step

    def wrapper() -> Any:
        spec = engine.spec
        greedy = spec.num_greedy_steps if spec is not None else 0
        sched = engine.scheduler
        is_prefill = bool(sched.waiting) or any(s.num_uncomputed_tokens > 1 for s in sched.running)
        t = time.perf_counter()
        out = fn()
        if spec is not None and spec.num_greedy_steps > greedy:
            kind = "step kind: whole greedy"
        else:
            kind = "step kind: with a prefill" if is_prefill else "step kind: other"
        kinds[kind][0] += 1
        kinds[kind][1] += time.perf_counter() - t
        return out

    engine.step = wrapper
    return kinds


def decode_steps(
    engine: Any, prompt: list[int], stops: list[int], max_tokens: int, rid: str, prof: Any
) -> int:
    """One greedy request's steps after its first, under `prof` (paused over the first): their count."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    engine.add_request(
        EngineRequest(request_id=rid, prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
    )
    prof.toggle_collection_dynamic(False, prof.activities)
    engine.step()  # the prompt's step
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # its kernels done before collection resumes
    prof.toggle_collection_dynamic(True, prof.activities)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    return steps


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
    for side in ("B", "A0", "F", "F-host"):
        engine = engines[side[0]]
        if engine.spec is not None:
            engine.spec.is_greedy_enabled = side == "F"
            # A0: speculation on, its policy held at k = 0: a spec engine's plain steps against B's
            engine.spec.policy.forced_k = 0 if side == "A0" else None
        run(engine, prompts, stops, args.max_tokens)  # warm
        totals: dict[str, float] = collections.defaultdict(float)
        counts = count_transfers()
        timed(engine, "step", totals)
        kinds = step_kinds(engine, totals)
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
        for kind, (n, s) in sorted(kinds.items()):
            lines.append(f"   {kind:32} {1e3 * s / max(n, 1):8.3f} ms each, {n} steps")
        for name, n in sorted(counts.items()):
            lines.append(f"   {name:32} {n / steps:8.2f} per step")
        if engine.spec is not None:
            lines.append(f"   greedy steps                     {engine.spec.num_greedy_steps}")
        restore_transfers()
        acts = [torch.profiler.ProfilerActivity.CPU]
        acts += [torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else []
        # the decode steps of two prompts, each prompt's first step (its eager prefill: the target's
        # and, speculating, the MTP layer's over the prompt, with the torch MoE's per-expert loop and
        # its syncs) left out: until 2026-12-05 it was in, and its eager ops read as the step's
        steps = 0
        with torch.profiler.profile(activities=acts) as prof:
            for i, prompt in enumerate(prompts[:2]):
                steps += decode_steps(engine, prompt, stops, args.max_tokens, f"p{i}", prof)
        ka = prof.key_averages()
        cuda_us = sum(e.self_device_time_total for e in ka)
        lines.append(
            f"   device busy (sum of kernel self time) {cuda_us / 1e3 / steps:8.3f} ms/step over {steps} "
            "decode steps (prefills left out)"
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
