"""Host time of a plain decode step at 16-64 sequences, speculation on but priced to lose against off
(issue 28), CPU:

    OMP_NUM_THREADS=1 python3 -m lab.diagnostics.spec_plain_host [--model glm] [--seqs 16,32,64]
        [--steps 40] [--rounds 7] [--profile] [--out FILE.json]

On the H100 the `mtp:3` engine's plain steps (the adaptive policy choosing k = 0, at loads where
drafting is priced to lose) ran 3-5% slower than speculation off (~0.79 vs 0.75 ms a step at
c = 64, GLM nano): those steps are host-bound, and the speculative decoder did host work on every
step whatever it decided. `plain_step_host.py` measures one sequence; this measures a batch.

Two engines per load over one fp32 copy of the nano model, configured as
`benchmarks.engine.mtp_gpu.nano_engines` configures them (`max_num_seqs` = `speculative_max_seqs`
= the load): A = `mtp:3`, adaptive; B = off. Both capture their decode graphs through a timed
`eager_capture` (`spec_host.Meter`), so each step takes the GPU's path and the replay (the model on
the CPU) comes off the step's time, leaving the host's. A's policy is priced to lose at every load
(`priced_to_lose`: plain steps measured, every draft length measured far dearer, no probe
affordable), so it walks its whole path and returns 0 (a round where A drafted is refused); past
`max_drafting_seqs` (51 for GLM nano) it is not asked at all, and what is left is the decoder's
bookkeeping around it.

A round runs `--seqs` greedy requests of `--steps` decode steps on each side, A and B alternating
(A, B, B, A, ...). Per decode step (every sequence decoding): `wall`, its µs less the replays;
`cpu`, this thread's CPU µs less the replays'; `critical`, the wall µs less the policy's work
between a plain step's launch and its read back (`SpecDecoder.while_plain_step`, timed by
`plain_step_host.Overlap`), which on a GPU runs beside the device; and `calls`, the Python and C
calls made outside the replays (a separate pass: `sys.setprofile` slows the step), the figure other
processes on the machine do not move. A round's figure is its steps' median; the report gives each
side's median over rounds with their range, and A - B paired by round. `--profile`: one more
cProfile'd round a side, the functions A calls more often than B, by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lab.diagnostics.plain_step_host import Overlap, profile_diff, profile_table
from lab.diagnostics.spec_host import MODELS, Meter


def engines(checkpoint: Path, meter: Meter, num_seqs: int) -> dict[str, Any]:
    """A: speculation on (mtp:3, the adaptive policy), B: off; `num_seqs` of them at most."""
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    loaded = load_model(
        checkpoint, dtype=torch.float32, device="cpu", num_mtp_layers=num_mtp_layers_in(checkpoint)
    )
    out = {}
    for side, k in (("A", 3), ("B", 0)):
        config = EngineConfig.build(
            num_pages=num_seqs * 16 + 64, page_size=16, max_num_batched_tokens=4096,
            max_num_seqs=num_seqs, enable_prefix_cache=False, num_speculative_tokens=k,
            speculative_max_seqs=num_seqs,
        )  # fmt: skip
        prepared = prepare_model(loaded, config, model_dtype=torch.float32)
        out[side] = Engine.from_prepared(prepared, config, graph_capture=meter.capture)
    return out


def priced_to_lose(engine: Any) -> None:
    """Every load as a warm-up's calibration leaves one where drafting loses: plain steps measured,
    each draft length's step (and the overhead) measured, far dearer (`_costs` prices them), a
    probe spent and none affordable again (a drafting step priced far above the plain time since)."""
    from backend.engine.speculative.load_rates import MIN_RATE_SAMPLES, LoadRates

    policy = engine.spec.policy
    for n in range(engine.config.max_num_seqs.bit_length() + 1):
        policy._rates[1 << n] = LoadRates(
            plain=1.0, num_plain=MIN_RATE_SAMPLES, plain_step_s=1e-3, draft_step_s=1e9, num_probes=1,
            num_overhead=1, step_s_by_k={k: (1e9, 0) for k in range(1, policy.max_drafts + 1)},
        )  # fmt: skip


def add_requests(engine: Any, num_seqs: int, max_tokens: int, prompt_len: int = 16) -> None:
    """`num_seqs` greedy requests of `prompt_len`-token prompts (distinct per sequence), `max_tokens`
    each."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.runner.vocab_size
    tag = time.monotonic_ns()
    for i in range(num_seqs):
        prompt = [(i * 7919 + j * 31) % (vocab - 1) + 1 for j in range(prompt_len)]
        engine.add_request(
            EngineRequest(
                request_id=f"r{tag}-{i}", prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling
            )
        )


def run(
    engine: Any,
    meter: Meter,
    num_seqs: int,
    steps: int,
    *,
    prof: cProfile.Profile | None = None,
    count_calls: bool = False,
    overlap: Overlap | None = None,
) -> dict[str, Any]:
    """`num_seqs` greedy requests of `steps` decode steps: per step where all of them decode, its
    host seconds (wall, this thread's CPU, and the wall less `overlap`'s) or, `count_calls`, its
    calls outside the replays."""
    add_requests(engine, num_seqs, steps + 1)
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if meter.depth == 0 and event in ("call", "c_call"):
            calls[0] += 1

    wall: list[float] = []
    cpu: list[float] = []
    critical: list[float] = []
    counted: list[int] = []
    drafted = 0
    while engine.has_unfinished:
        computed0 = engine.stats.computed_tokens
        meter.device_s = meter.device_cpu_s = 0.0
        calls[0] = 0
        if overlap is not None:
            overlap.s = 0.0
        if prof is not None:
            prof.enable()
        if count_calls:
            sys.setprofile(profile)
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        sys.setprofile(None)
        if prof is not None:
            prof.disable()
        drafted += engine.spec is not None and engine.spec.k > 0
        if engine.stats.computed_tokens - computed0 == num_seqs:  # every sequence decoded one token
            wall.append(elapsed - meter.device_s)
            cpu.append(elapsed_cpu - meter.device_cpu_s)
            critical.append(wall[-1] - (overlap.s if overlap is not None else 0.0))
            counted.append(calls[0])
    return {"wall_s": wall, "cpu_s": cpu, "critical_s": critical, "calls": counted, "drafted": drafted}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} [{min(values):.1f} .. {max(values):.1f}]"


def measure(name: str, num_seqs: int, steps: int, rounds: int, profile: bool) -> dict[str, Any]:
    meter = Meter()
    built = engines(MODELS[name], meter, num_seqs)
    priced_to_lose(built["A"])
    overlaps = {side: Overlap(engine) for side, engine in built.items()}
    for engine in built.values():
        run(engine, meter, num_seqs, 8)  # warm
    figures: dict[str, dict[str, list[float]]] = {
        label: {"A": [], "B": []} for label in ("wall", "cpu", "critical")
    }
    for r in range(rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            got = run(built[side], meter, num_seqs, steps, overlap=overlaps[side])
            if got["drafted"]:
                raise SystemExit(f"A drafted on {got['drafted']} steps: not a plain-step measurement")
            for label, by_side in figures.items():
                by_side[side].append(1e6 * statistics.median(got[f"{label}_s"]))
    calls = {
        side: statistics.median(run(engine, meter, num_seqs, steps, count_calls=True)["calls"])
        for side, engine in built.items()
    }
    print(
        f"== {name} c={num_seqs} (max_drafting_seqs {built['A'].spec.max_drafting_seqs}): host µs a "
        f"plain step, median [range] of {rounds} rounds"
    )
    for label, by_side in figures.items():
        extra = [a - b for a, b in zip(by_side["A"], by_side["B"], strict=True)]
        share = 100 * statistics.median(extra) / statistics.median(by_side["B"])
        print(
            f"   {label:8} A (mtp:3, k = 0) {spread(by_side['A'])}   B (off) {spread(by_side['B'])}   "
            f"A-B {spread(extra)} ({share:+.1f}%)"
        )
    print(f"   calls    A {calls['A']:.0f}   B {calls['B']:.0f}   A-B {calls['A'] - calls['B']:+.0f} a step")
    entry: dict[str, Any] = {f"{label}_us": by_side for label, by_side in figures.items()}
    entry["calls"] = calls
    if profile:
        tables = {}
        for side, engine in built.items():
            prof = cProfile.Profile()
            got = run(engine, meter, num_seqs, steps, prof=prof)
            tables[side] = profile_table(prof, len(got["wall_s"]) + 1)
        rows = profile_diff(tables["A"], tables["B"], top=25)
        entry["profile_A_more"] = rows
        print("   -- calls A makes more than B: own µs a step in A (profiled), calls a step A / B")
        for where, us, n_a, n_b in rows:
            print(f"      {us:7.2f} {n_a:7.2f} {n_b:7.2f}  {where}")
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm", choices=sorted(MODELS))
    ap.add_argument("--seqs", default="16,32,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = {
        str(n): measure(args.model, int(n), args.steps, args.rounds, args.profile)
        for n in args.seqs.split(",")
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
