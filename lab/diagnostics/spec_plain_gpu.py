"""Where a speculative engine's plain decode step loses its 26-34 µs to speculation off, on a GPU
(issue 28; the mtp bench's `step_ms_by_kind`, H100 2026-12-07: GLM nano 0.623 vs 0.597 ms at c = 64,
0.465 vs 0.431 at c = 1):

    python3 -m lab.diagnostics.spec_plain_gpu [--models glm,kimi] [--seqs 1,64] [--steps 60]
        [--rounds 3] [--out FILE.json]

Engines as the mtp bench builds them (`benchmarks.engine.mtp_gpu.nano_engines`: bf16, the GPU
backend's warm-up, calibrated), A = `mtp:3` adaptive, B = off. A's policy is then priced to lose at
every load (`spec_plain_host.priced_to_lose`), so every step of A is a plain one taking the whole
decision path. Variants, alternated per round (A, Z, B, B, Z, A, ...):
- A: as served;
- Z: the same engine with the decoder's per-step work cut out (`drafting` returns no drafts at once,
  no work while the step runs, no measurement): what is left of A - B is not the decoder's.
Per variant and load, each round's median wall µs of `Engine.step` over decode-only steps; and in A,
the µs of each of the decoder's hooks a step (`drafting` before the launch, `while_plain_step`
between the launch and the read back, `measured` after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

MODELS = {"glm": Path("models/glm-5.2-nano"), "kimi": Path("models/kimi-k2.6-nano")}


class Hooks:
    """Times (or cuts out) the decoder's three per-step hooks on one engine."""

    def __init__(self, engine: Any) -> None:
        spec = engine.spec
        self.spec = spec
        self.orig = {name: getattr(spec, name) for name in ("drafting", "while_plain_step", "measured")}
        self.s = dict.fromkeys(self.orig, 0.0)
        self.mode = "A"

        def wrap(name: str) -> Any:
            fn = self.orig[name]

            def timed(*args: Any) -> Any:
                if self.mode == "Z":
                    if name == "drafting":
                        spec.k, spec.fills_draft_kv = 0, False
                        return [False] * len(args[0].scheduled)
                    return None
                start = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    self.s[name] += time.perf_counter() - start

            return timed

        for name in self.orig:
            setattr(spec, name, wrap(name))

    def reset(self) -> None:
        self.s = dict.fromkeys(self.orig, 0.0)


def run(engine: Any, num_seqs: int, steps: int) -> list[float]:
    """`num_seqs` greedy requests of `steps` decode steps: each decode-only step's wall seconds."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    vocab = engine.runner.vocab_size
    tag = time.monotonic_ns()
    for i in range(num_seqs):
        prompt = [(i * 7919 + j * 31) % (vocab - 1) + 1 for j in range(64)]
        engine.add_request(
            EngineRequest(
                request_id=f"r{tag}-{i}", prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling
            )
        )
    wall = []
    while engine.has_unfinished:
        computed0 = engine.stats.computed_tokens
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.stats.computed_tokens - computed0 == num_seqs:
            wall.append(elapsed)
    return wall


def engines(checkpoint: Path, device: str, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """A (mtp:3, adaptive) and B (off) as `benchmarks.engine.mtp_gpu.nano_engines` builds its A and B:
    one loaded copy, the backend's warm-up (calibrated), the heap frozen."""
    import torch

    from backend.engine import heap
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
    from backend.server.warmup import warm_up

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(checkpoint, dtype=dtype, device=device, num_mtp_layers=num_mtp_layers_in(checkpoint))
    out = {}
    for side, k in (("A", 3), ("B", 0)):
        config = EngineConfig.build(
            num_pages=max(64, concurrency * (-(-(2048 + max_tokens) // 16))), page_size=16,
            max_num_batched_tokens=4096, max_num_seqs=concurrency, enable_prefix_cache=False,
            num_speculative_tokens=k, speculative_max_seqs=concurrency,
        )  # fmt: skip
        out[side] = Engine.from_prepared(prepare_model(loaded, config, model_dtype=dtype), config)
        warm_up(out[side], is_full=device.startswith("cuda"), calibrate=True)
    heap.freeze()
    return out


def measure(name: str, seqs: list[int], steps: int, rounds: int, device: str) -> dict[str, Any]:
    from lab.diagnostics.spec_plain_host import priced_to_lose

    out: dict[str, Any] = {}
    for num_seqs in seqs:
        built = engines(MODELS[name], device, num_seqs, steps + 1)
        a, b = built["A"], built["B"]
        priced_to_lose(a)
        hooks = Hooks(a)
        variants = {"A": a, "Z": a, "B": b}
        for engine in (a, b):
            run(engine, num_seqs, 16)  # warm (the shapes are the warm-up's already)
        by: dict[str, list[float]] = {v: [] for v in variants}
        hook_us: dict[str, list[float]] = {h: [] for h in hooks.s}
        drafted = 0
        order = ["A", "Z", "B", "B", "Z", "A"]
        for _ in range(rounds):
            for v in order:
                hooks.mode = v
                hooks.reset()
                k0 = a.stats.spec_verifies
                wall = run(variants[v], num_seqs, steps)
                drafted += a.stats.spec_verifies - k0
                by[v].append(1e6 * statistics.median(wall))
                if v == "A":
                    for h, s in hooks.s.items():
                        hook_us[h].append(1e6 * s / max(len(wall), 1))
        hooks.mode = "A"
        row = {
            v: {"median": statistics.median(x), "min": min(x), "max": max(x), "runs": x}
            for v, x in by.items()
        }
        row["hooks_us_A"] = {h: statistics.median(x) for h, x in hook_us.items()}
        row["verifies_in_A"] = drafted
        out[str(num_seqs)] = row
        print(
            f"== {name} c={num_seqs}: wall µs a decode step, median [min, max] of {2 * rounds} runs"
            f" (A verified {drafted} times)"
        )
        for v in variants:
            r = row[v]
            print(f"   {v}  {r['median']:8.1f} [{r['min']:.1f}, {r['max']:.1f}]")
        print(
            f"   A-B {row['A']['median'] - row['B']['median']:+.1f}   Z-B {row['Z']['median'] - row['B']['median']:+.1f}"
        )
        print("   A's hooks µs a step: " + ", ".join(f"{h} {us:.1f}" for h, us in row["hooks_us_A"].items()))
        del built, a, b, variants
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm,kimi")
    ap.add_argument("--seqs", default="1,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    seqs = [int(n) for n in args.seqs.split(",")]
    report = {m: measure(m, seqs, args.steps, args.rounds, args.device) for m in args.models.split(",")}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
