"""What runs inside the mtp bench's slow adaptive runs (issue 28; session 16 on the H100: GLM nano's
A runs of 0.3 s took 0.6-1.3 s now and then, with 3-13 young collections where others had 0-1, no full
one; Kimi's never). Builds the bench's A engine (speculation on, adaptive) for one nano model, runs
its chat and tool-call prompts at c = 1 as the bench does, `--runs` times, and per step records
its draft length, scheduled tokens and seconds, the Triton kernels compiled (or loaded from the disk
cache: `JITFunction._do_compile`, an in-process cache miss) and the CUDA graphs captured during
it, and the collections. Prints every step over `--ratio` times the run's median step, or with a
compile or a capture in it, and per run its wall and counts.

    python3 -m lab.diagnostics.spec_outliers --model models/glm-5.2-nano --runs 6
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
from benchmarks.engine.mtp_acceptance import held_out_prompts, stop_ids
from schemas.backend import EngineRequest, SamplingParams

EVENTS: list[tuple[str, str, float]] = []  # (kind, name, seconds)


def _hook() -> None:
    from triton.runtime.jit import JITFunction

    compile_ = JITFunction._do_compile

    def timed(self: Any, key: Any, signature: Any, device: Any, constexprs: Any, *rest: Any) -> Any:
        start = time.perf_counter()
        out = compile_(self, key, signature, device, constexprs, *rest)
        name = getattr(getattr(self, "fn", None), "__name__", "?")
        EVENTS.append(("triton", f"{name} {str(constexprs)[:160]}", time.perf_counter() - start))
        return out

    JITFunction._do_compile = timed  # type: ignore[method-assign]
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        EVENTS.append(("capture", "CUDAGraph", 0.0))
        return begin(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = capture  # type: ignore[method-assign]
    gc.callbacks.append(
        lambda phase, info: EVENTS.append(("gc", str(info["generation"]), 0.0)) if phase == "stop" else None
    )


def engine_for(checkpoint: Path, max_tokens: int, device: str) -> Engine:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = load_model(checkpoint, dtype=dtype, device=device, num_mtp_layers=num_mtp_layers_in(checkpoint))
    config = EngineConfig.build(
        num_pages=max(64, -(-(2048 + max_tokens) // 16)), page_size=16, max_num_batched_tokens=4096,
        max_num_seqs=1, enable_prefix_cache=False, num_speculative_tokens=3, speculative_max_seqs=1,
        speculative_adaptive=True,
    )  # fmt: skip
    return Engine.from_prepared(prepare_model(loaded, config, model_dtype=dtype), config)


def run(engine: Engine, prompts: list[list[int]], stops: list[int], max_tokens: int) -> list[dict[str, Any]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    steps = []
    for i, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
        )
        while engine.has_unfinished:
            at = len(EVENTS)
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            assert engine.spec is not None
            seq = engine.scheduler.running[0] if engine.scheduler.running else None
            steps.append(
                {
                    "prompt": i, "k": engine.spec.k, "seconds": seconds, "events": EVENTS[at:],
                    "num_tokens": seq.num_tokens if seq is not None else -1,
                    "catch_up": engine.spec.num_gap_rows,
                }
            )  # fmt: skip
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=Path("models/glm-5.2-nano"))
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True, help="the backend's")
    args = ap.parse_args()
    engine = engine_for(args.model, args.max_tokens, args.device)
    stops = stop_ids(args.model)
    _hook()
    if args.warm_up:  # as a backend starts: the start-up warm-up, then the runs
        from backend.server.warmup import warm_up

        warm = warm_up(engine, is_full=args.device == "cuda")
        kinds = [e[0] for e in EVENTS]
        print(
            f"== warm-up: {warm.seconds:.1f} s, {warm.num_steps} steps, draft lengths {warm.spec_steps}; "
            f"compiles {kinds.count('triton')}, captures {kinds.count('capture')}"
        )
    for r in range(args.runs):
        for task in ("chat", "tool-call"):
            steps = run(engine, held_out_prompts(args.model, task, args.prompts), stops, args.max_tokens)
            median = statistics.median(s["seconds"] for s in steps)
            wall = sum(s["seconds"] for s in steps)
            kinds = [e[0] for s in steps for e in s["events"]]
            print(
                f"== run {r} {task}: {wall:.3f} s over {len(steps)} steps (median {median * 1e3:.3f} ms); "
                f"compiles {kinds.count('triton')}, captures {kinds.count('capture')}, "
                f"gc {sorted(e[1] for s in steps for e in s['events'] if e[0] == 'gc')}"
            )
            for n, s in enumerate(steps):
                named = [e for e in s["events"] if e[0] != "gc"]
                if s["seconds"] > args.ratio * median or named:
                    print(
                        f"  step {n} prompt {s['prompt']} k {s['k']} tokens {s['num_tokens']} "
                        f"catch-up {s['catch_up']}: {s['seconds'] * 1e3:.1f} ms, "
                        f"gc {[e[1] for e in s['events'] if e[0] == 'gc']}"
                    )
                    for kind, name, sec in named[:6]:
                        print(f"    {kind} {sec * 1e3:.0f} ms {name}")


if __name__ == "__main__":
    main()
