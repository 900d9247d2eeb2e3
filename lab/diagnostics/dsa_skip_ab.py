"""GLM 5.2's decode step at concurrency 1 with and without the DSA skip (issue 24), on the H200, in
one call (~2-3 min). Run from the repo root:

    python3 -m lab.diagnostics.dsa_skip_ab [--input-len 1920] [--output-len 128] [--rounds 3]
        [--formats int4-all] [--out $OUT/dsa_skip_ab.json]

A step whose sequences all fit `index_topk` (2,048) now caches the indexer keys but scores and
selects nothing, and runs dense MLA (`backend/models/glm_moe_dsa.py`), from a narrow decode graph.
`select` is the path before that change, forced in the same build: every step's `table_tokens` as
wide as no sequence (the indexer always runs) and no narrow graphs. Each arm is
`benchmarks.engine.decode_c1.measure_format` (its A/B/B/A rounds against the copy probe), the arms
in the order select, skip, skip, select when there is time, at a context that stays within the
top-k: input 1,920 + 128 outputs end at 2,048 tokens. (The recorded `decode-c1` row runs at
2,049-2,176 tokens, past the top-k: there the indexer selects either way, and this change does
nothing.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from backend.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from backend.models.layers import step as step_module
from benchmarks.engine.decode_c1 import COPY_BYTES, CopyProbe, Options, measure_format


@contextlib.contextmanager
def always_selecting() -> Iterator[None]:
    """The indexer on every step, one graph width: the path before the skip."""
    build = step_module.Step.build.__func__  # type: ignore[attr-defined]

    def selecting(cls: type, *args: Any, **kwargs: Any) -> step_module.Step:
        s = build(cls, *args, **kwargs)
        s.table_tokens = 1 << 30
        return s

    saved = GlmMoeDsaForCausalLM.__dict__["dense_context"]
    step_module.Step.build = classmethod(selecting)  # type: ignore[method-assign, assignment]
    GlmMoeDsaForCausalLM.dense_context = None  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        step_module.Step.build = classmethod(build)  # type: ignore[method-assign, assignment]
        GlmMoeDsaForCausalLM.dense_context = saved  # type: ignore[misc]


def step_ms(entry: dict[str, Any]) -> list[float]:
    return [run["step_ms"] for r in entry["rounds"] for run in r["runs"] if run["side"] == "A"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=1920)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="int4-all")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="small geometry on the CPU (a smoke run)")
    args = ap.parse_args()
    start = time.monotonic()
    opts = Options(
        device="cpu" if args.tiny else "cuda", formats=tuple(args.formats.split(",")),
        layers=2 if args.tiny else 10, bf16_layers=2, input_len=args.input_len, output_len=args.output_len,
        num_rounds=args.rounds, page_size=16, chunk=2048, deadline=start + args.budget_s, tiny=args.tiny,
        copy_bytes=8 * 2**20 if args.tiny else COPY_BYTES,
    )  # fmt: skip
    probe = CopyProbe(opts.device, opts.copy_bytes)
    arms = ("select", "skip", "skip", "select")
    results: dict[str, dict[str, list[float]]] = {}
    for fmt in opts.formats:
        for i, arm in enumerate(arms):
            left = opts.time_left() / (len(arms) - i) / len(opts.formats)
            if i >= 2 and left < 30:
                break
            with always_selecting() if arm == "select" else contextlib.nullcontext():
                entry = measure_format(fmt, opts, probe, time.monotonic() + left)
            results.setdefault(fmt, {}).setdefault(arm, []).extend(step_ms(entry))
            print(f"{fmt} {arm}: step ms {[round(x, 3) for x in step_ms(entry)]}", flush=True)
        sel, skip = statistics.median(results[fmt]["select"]), statistics.median(results[fmt]["skip"])
        print(f"== {fmt} input {args.input_len}: select {sel:.3f} ms, skip {skip:.3f} ms, saved {sel - skip:.3f} ms "
              f"({sel / skip:.3f}x)", flush=True)  # fmt: skip
    out = args.out or (os.path.join(os.environ["OUT"], "dsa_skip_ab.json") if "OUT" in os.environ else None)
    if out:
        with open(out, "w") as f:
            json.dump({"options": vars(args), "step_ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
