"""Per-step wall time of one user's chat prompts, speculation on (as served) against off, by the step's
place in its request (issue 28): on the H100 in session 18 the `mtp:3` engine's decode ran 8-11%
slower than speculation off in runs where it drafted in no step (Kimi nano chat, 0.83-0.90 ms a
step against 0.65-0.70), where session 16 measured ~4%. Which steps are slower: the prefill (fill
step, `fills_draft_kv`), the first decode step after it, or every plain step?

    python3 -m lab.diagnostics.plain_step_gpu [--model models/kimi-k2.6-nano] [--task chat]
        [--rounds 3] [--prompts 8] [--max-tokens 36] [--force-plain]

Engines as `benchmarks.engine.mtp_gpu.nano_engines` builds them (warm-up included); A's policy forced
to k = 0 with `--force-plain` (then only the machinery differs). Prints per side the median ms of
the prefill step, the first, second and later decode steps, over A B B A rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any


def per_step(
    engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int
) -> dict[str, list[float]]:
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    out: dict[str, list[float]] = {"prefill": [], "decode1": [], "decode2": [], "later": [], "drafting": []}
    for i, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(
                request_id=f"p{i}", prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling
            )
        )
        n = 0
        while engine.has_unfinished:
            t = time.perf_counter()
            engine.step()
            dt = (time.perf_counter() - t) * 1e3
            k = engine.spec.k if engine.spec is not None else 0
            key = (
                "prefill"
                if n == 0
                else "drafting"
                if k
                else "decode1"
                if n == 1
                else "decode2"
                if n == 2
                else "later"
            )
            out[key].append(dt)
            n += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/kimi-k2.6-nano")
    ap.add_argument("--task", default="chat")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=36)
    ap.add_argument("--force-plain", action="store_true")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    import torch

    from benchmarks.engine.mtp_acceptance import held_out_prompts, stop_ids
    from benchmarks.engine.mtp_gpu import Options, nano_engines

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = Path(args.model)
    opts = Options(
        device=device, models=(ckpt,), tasks=(args.task,), num_prompts=args.prompts, max_tokens=args.max_tokens,
        k=3, num_rounds=args.rounds, c64=0, c64_rounds=0, rank_of=0, depths=(8, 16), projection_tokens=0,
        acceptance_record=Path("/dev/null"), deadline=time.monotonic() + 600, tiny=False,
    )  # fmt: skip
    engines = nano_engines(ckpt, opts, 1)
    if args.force_plain:
        engines["A"].spec.policy.forced_k = 0
    prompts, stops = held_out_prompts(ckpt, args.task, args.prompts), stop_ids(ckpt)
    for side in ("A", "B"):
        per_step(engines[side], prompts, stops, args.max_tokens)  # warm
    got: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for _ in range(args.rounds):
        for side in ("A", "B", "B", "A"):
            for key, values in per_step(engines[side], prompts, stops, args.max_tokens).items():
                got[side].setdefault(key, []).extend(values)
    for side in ("A", "B"):
        parts = [f"{key} {statistics.median(v):.3f} ms (n {len(v)})" for key, v in got[side].items() if v]
        print(f"{side}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
