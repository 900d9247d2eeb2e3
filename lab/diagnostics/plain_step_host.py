"""Host time of a c = 1 plain decode step, speculation off against on-but-not-drafting (issue 28), CPU:

    OMP_NUM_THREADS=1 python3 -m lab.diagnostics.plain_step_host [--models glm,kimi] [--steps 120]
        [--rounds 5] [--profile] [--out FILE.json]

On the H100 the nano models decode at ~0.435 ms a token with speculation off and the `mtp:3` engine's
plain steps (the adaptive policy choosing k = 0) cost ~29 us more: that alone made speedup_c1 0.93x
whenever the policy did not draft. The GPU work of both is one decode-graph replay, so the difference is
the host's, measured here.

Two engines per nano model over one loaded copy (fp32), built as `benchmarks.engine.mtp_gpu.nano_engines`
builds them: A = `mtp:3`, adaptive policy (as served), B = off. Both capture their decode graphs
through a timed `eager_capture` (`spec_host.Meter`): each step takes the GPU's path (staging, replay),
and the replay (the model on the CPU) is subtracted from the step's wall time, leaving the host's work.
A's policy is put in the state the GPU bench's A runs were in (`steps_by_draft_length {"0": N}`): the
load measured, plain steps winning, no probe affordable, so `choose` walks its whole path and returns 0
(`gate_off`); a run where A drafted on any step is refused.

Each round runs one greedy request of `--steps` decode steps on each side, A and B alternating
(A, B, B, A, ...); a round's figure is the median host µs of its decode steps; the report gives each
side's median over rounds and their difference, of all host time and of the critical path's: less
the work the engine does between the step's launch and its read back (`SpecDecoder.while_plain_step`,
timed by `Overlap`), which on a GPU runs beside the device's ~0.4 ms of work. `--profile`: one more cProfile'd run per side, the
functions by own time outside the model (what A does that B does not).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lab.diagnostics.spec_host import MODELS, Meter
from lab.diagnostics.spec_host import engines as spec_engines


def engines(checkpoint: Path, meter: Meter) -> dict[str, Any]:
    """A: speculation on (mtp:3, the adaptive policy), B: off."""
    return spec_engines(checkpoint, meter, sides=(("A", 3), ("B", 0)), adaptive=True)


class Overlap:
    """Times the host work a plain step does between its launch and its read back
    (`SpecDecoder.while_plain_step`, where the engine has it): on a GPU it runs beside the device's
    work, off the step's critical path, so the critical host time is the host time less this."""

    def __init__(self, engine: Any) -> None:
        self.s = 0.0
        spec = engine.spec
        fn = getattr(spec, "while_plain_step", None) if spec is not None else None
        if fn is not None:

            def timed() -> None:
                start = time.perf_counter()
                try:
                    fn()
                finally:
                    self.s += time.perf_counter() - start

            spec.while_plain_step = timed


def gate_off(engine: Any) -> None:
    """The policy's state in the GPU bench's non-drafting runs: at one sequence, plain steps measured
    faster than drafting ones, a probe already spent and none affordable again (a drafting step
    priced far above the plain time since)."""
    from backend.engine.speculative.load_rates import MIN_RATE_SAMPLES, LoadRates

    policy = engine.spec.policy
    policy._rates[1] = LoadRates(
        plain=1000.0, spec=1.0, num_plain=MIN_RATE_SAMPLES, num_spec=MIN_RATE_SAMPLES,
        plain_step_s=1e-3, draft_step_s=1e9, num_probes=1,
    )  # fmt: skip


def run(
    engine: Any,
    meter: Meter,
    prompt: list[int],
    steps: int,
    prof: cProfile.Profile | None = None,
    overlap: Overlap | None = None,
) -> dict:
    """One greedy request of `steps` decode steps: per decode step its host seconds (all, and
    those on the critical path: less `overlap`'s); its tokens."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(
        EngineRequest(request_id=rid, prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
    )
    host: list[float] = []
    cpu: list[float] = []
    critical: list[float] = []
    tokens: list[int] = []
    drafted = 0
    while engine.has_unfinished:
        computed0 = engine.stats.computed_tokens
        meter.device_s = meter.device_cpu_s = 0.0
        if overlap is not None:
            overlap.s = 0.0
        if prof is not None:
            prof.enable()
        start, start_cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        wall, thread = time.perf_counter() - start, time.thread_time() - start_cpu
        if prof is not None:
            prof.disable()
        for o in outputs:
            tokens += o.token_ids
        drafted += engine.spec is not None and engine.spec.k > 0
        if engine.stats.computed_tokens - computed0 == 1:  # a decode step (the prompt's left out)
            host.append(wall - meter.device_s)
            cpu.append(thread - meter.device_cpu_s)
            critical.append(host[-1] - (overlap.s if overlap is not None else 0.0))
    return {"host_s": host, "cpu_s": cpu, "critical_s": critical, "tokens": tokens, "drafted": drafted}


def profile_table(prof: cProfile.Profile, num_steps: int) -> dict[str, tuple[float, float]]:
    """Per function: (own µs per step, calls per step)."""
    stats = pstats.Stats(prof)
    rows = {}
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({name})" if line else name
        rows[where] = (1e6 * tt / num_steps, nc / num_steps)
    return rows


def profile_diff(
    a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]], top: int = 40
) -> list[tuple[str, float, float, float]]:
    """Functions A calls more often than B (or only A): (name, A's own µs, A's calls, B's calls) a step."""
    rows = []
    for where, (us, calls) in a.items():
        b_calls = b.get(where, (0.0, 0.0))[1]
        if calls - b_calls > 0.01:
            rows.append((where, us, calls, b_calls))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm,kimi")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name in args.models.split(","):
        meter = Meter()
        built = engines(MODELS[name], meter)
        gate_off(built["A"])
        overlaps = {side: Overlap(e) for side, e in built.items()}
        vocab = built["B"].runner.vocab_size
        prompt = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(0)).tolist()
        warm = {side: run(e, meter, prompt, 16) for side, e in built.items()}
        assert warm["A"]["tokens"] == warm["B"]["tokens"], "greedy outputs differ"
        medians: dict[str, list[float]] = {"A": [], "B": []}
        cpu_medians: dict[str, list[float]] = {"A": [], "B": []}
        critical: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                got = run(built[side], meter, prompt, args.steps, overlap=overlaps[side])
                if got["drafted"]:
                    raise SystemExit(
                        f"side A drafted on {got['drafted']} steps: not a plain-step measurement"
                    )
                medians[side].append(1e6 * statistics.median(got["host_s"]))
                cpu_medians[side].append(1e6 * statistics.median(got["cpu_s"]))
                critical[side].append(1e6 * statistics.median(got["critical_s"]))
        a, b = statistics.median(medians["A"]), statistics.median(medians["B"])
        ca, cb = statistics.median(cpu_medians["A"]), statistics.median(cpu_medians["B"])
        xa, xb = statistics.median(critical["A"]), statistics.median(critical["B"])
        entry: dict[str, Any] = {
            "host_us_A": a, "host_us_B": b, "extra_us": a - b,
            "cpu_us_A": ca, "cpu_us_B": cb, "extra_cpu_us": ca - cb,
            "critical_us_A": xa, "critical_us_B": xb, "extra_critical_us": xa - xb,
            "rounds_A": medians["A"], "rounds_B": medians["B"],
            "critical_rounds_A": critical["A"], "critical_rounds_B": critical["B"],
        }  # fmt: skip
        print(
            f"== {name}: host us per plain step A (mtp:3, k = 0) {a:.1f}, B (off) {b:.1f}: "
            f"+{a - b:.1f} us; thread CPU {ca:.1f} vs {cb:.1f}: +{ca - cb:.1f}"
        )
        print(
            f"   critical path (less the work beside the device): A {xa:.1f}, B {xb:.1f}: +{xa - xb:.1f} us"
        )
        print("   rounds A " + " ".join(f"{x:.1f}" for x in medians["A"]))
        print("   rounds B " + " ".join(f"{x:.1f}" for x in medians["B"]))
        print("   critical A " + " ".join(f"{x:.1f}" for x in critical["A"]))
        if args.profile:
            tables = {}
            for side in ("A", "B"):
                prof = cProfile.Profile()
                got = run(built[side], meter, prompt, args.steps, prof)
                tables[side] = profile_table(prof, len(got["host_s"]) + 1)
            rows = profile_diff(tables["A"], tables["B"])
            entry["profile_A_more"] = rows
            print("   -- calls A makes more than B: own us a step in A (profiled), calls a step A / B")
            for where, us, calls, b_calls in rows:
                print(f"      {us:7.2f} {calls:6.2f} {b_calls:6.2f}  {where}")
        report[name] = entry
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
