"""A speculative engine's plain decode steps after it has drafted, against speculation off (issue 28),
on the CPU:

    OMP_NUM_THREADS=1 python3 -m lab.diagnostics.spec_after_draft_host [--model kimi] [--seqs 1,64]
        [--draft-steps 12] [--steps 40]

On the H100 (2026-12-07, the mtp bench's step times by kind) a `mtp:3` engine's plain decode steps in
a run that had drafted cost 0.56-0.59 ms at c = 1 (speculation off: 0.43) and 0.77-0.99 ms at c = 64
(off: 0.49), while in runs that never drafted they matched off's. This runs A = `mtp:3` whose
policy's `choose` answers k = 3 for `--draft-steps` decode steps and k = 0 after (the decoder's own
path otherwise: the plain stream's hold included), B = off, over the same
requests, both capturing their decode graphs through `spec_host.Meter` (a replay's model time comes
off the step's), and prints per plain decode step after the switch: the host µs (wall less the
replays and eager forwards), the replays, the eager forward µs, and the Python calls (`sys.setprofile`,
a second pass), against B's steps at the same index.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from lab.diagnostics.spec_host import MODELS, Meter
from lab.diagnostics.spec_plain_host import add_requests, engines


def run(
    engine: Any, meter: Meter, num_seqs: int, steps: int, draft_steps: int, count_calls: bool
) -> list[dict]:
    """`num_seqs` greedy requests; A drafts (k = 3) for its first `draft_steps` decode steps, then
    k = 0. Per decode step (every sequence one token, no drafts): host µs, replays, forward µs, calls."""
    add_requests(engine, num_seqs, 4 * draft_steps + steps + 8)
    spec = engine.spec
    decode_steps = 0
    if spec is not None:  # the policy's own path (holds included), its choice scripted: k = 3, then 0
        spec.policy.choose = lambda *a, **kw: 3 if decode_steps < draft_steps else 0
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if meter.depth == 0 and event in ("call", "c_call"):
            calls[0] += 1

    out: list[dict] = []
    while engine.has_unfinished and len(out) < steps:
        computed0 = engine.stats.computed_tokens
        has_prompt = bool(engine.scheduler.waiting)  # this step prefills (counted before it runs)
        meter.device_s = 0.0
        meter.counts.clear()
        meter.counting = True
        calls[0] = 0
        if count_calls:
            sys.setprofile(profile)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        sys.setprofile(None)
        meter.counting = False
        is_decode = not has_prompt
        drafted = spec is not None and spec.did_draft
        if is_decode:
            decode_steps += 1
        if is_decode and decode_steps > draft_steps and not drafted:
            out.append(
                {
                    "host_us": 1e6 * (elapsed - meter.device_s),
                    "device_us": 1e6 * meter.device_s,
                    "replays": meter.counts["replays"],
                    "calls": calls[0],
                    "tokens": engine.stats.computed_tokens - computed0,
                }
            )
    for seq in list(engine._seqs):
        engine.abort(seq)
    while engine.has_unfinished:
        engine.step()
    if spec is not None:
        del spec.policy.choose
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi")
    ap.add_argument("--seqs", default="1,64")
    ap.add_argument("--draft-steps", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--show", type=int, default=8)
    args = ap.parse_args(argv)
    for num_seqs in (int(x) for x in args.seqs.split(",")):
        meter = Meter()
        built = engines(MODELS[args.model], meter, num_seqs)
        for engine in built.values():
            run(engine, meter, num_seqs, 4, 4, False)  # warm: both kinds of step
        got = {
            side: run(engine, meter, num_seqs, args.steps, args.draft_steps if side == "A" else 0, False)
            for side, engine in built.items()
        }
        calls = {
            side: run(engine, meter, num_seqs, args.steps, args.draft_steps if side == "A" else 0, True)
            for side, engine in built.items()
        }
        print(
            f"== {args.model} c={num_seqs}: plain decode steps after {args.draft_steps} drafting ones (A) vs off (B)"
        )
        for i in range(min(args.show, len(got["A"]), len(got["B"]))):
            a, b = got["A"][i], got["B"][i]
            print(
                f"   step {i:2}: A host {a['host_us']:8.1f} µs, {a['replays']} replays, forward {a['device_us']:8.1f}"
                f", calls {calls['A'][i]['calls']:5}, tokens {a['tokens']}   B host {b['host_us']:8.1f}, {b['replays']} replays, "
                f"forward {b['device_us']:8.1f}, calls {calls['B'][i]['calls']:5}"
            )
        for side in ("A", "B"):
            rows = got[side]
            print(
                f"   {side}: median host {statistics.median(r['host_us'] for r in rows):8.1f} µs, "
                f"replays {statistics.median(r['replays'] for r in rows)}, calls "
                f"{statistics.median(r['calls'] for r in calls[side]):.0f} over {len(rows)} steps"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
