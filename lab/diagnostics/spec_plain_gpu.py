"""Where a speculative engine's plain decode step loses its 26-34 µs to speculation off, on a GPU
(issue 28; the mtp bench's `step_ms_by_kind`, H100 2026-12-07: GLM nano 0.623 vs 0.597 ms at c = 64,
0.465 vs 0.431 at c = 1):

    python3 -m lab.diagnostics.spec_plain_gpu [--models glm,kimi] [--seqs 1,64] [--steps 60]
        [--rounds 3] [--out FILE.json]

Engines as the mtp bench builds them (`benchmarks.engine.mtp_gpu.nano_engines`: bf16, the GPU
backend's warm-up, calibrated), A = `mtp:3` adaptive, B = off. A's policy is then priced to lose at
every load (`spec_plain_host.priced_to_lose`), so every step of A is a plain one taking the whole
decision path. The variants (`LABELS`), run in `ORDER` and back (A O T Z Y B B Y Z T O A ...), all but
B on A's engine: O asks the policy every step as before the plain stream's hold; T times each hook
(`drafting` before the launch, `while_plain_step` between the launch and the read back, `measured`
after); Z cuts them out; Y unplugs speculation from the engine (what is left of Y - B is the runner's,
the graphs' or the model's); C is a second engine with speculation off, built after B. Per variant and load, each run's median wall µs of `Engine.step` over
decode-only steps, the median over runs and the range, and the device µs of a decode graph's
replay (CUDA events around it); the cost of the clock the hooks are timed by.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

MODELS = {"glm": Path("models/glm-5.2-nano"), "kimi": Path("models/kimi-k2.6-nano")}
ORDER = ("A", "O", "T", "Z", "Y", "B", "C")  # a round; the next runs it backwards
LABELS = {
    "A": "mtp:3 as served (priced to lose: k = 0)",
    "O": "A asking the policy every step (PLAIN_REASK = 1: before 2026-12-07)",
    "T": "A with each hook timed",
    "Z": "A without the decoder's hooks",
    "Y": "A's engine with speculation unplugged (its runner, graphs and model as A's)",
    "B": "off",
    "C": "off, a second engine (B - C: what two engines alike differ by)",
}


class Variants:
    """Switches one speculative engine between the variants (module docstring)."""

    def __init__(self, engine: Any) -> None:
        import backend.engine.speculative.decoder as decoder

        self.engine, self.spec, self.decoder = engine, engine.spec, decoder
        self.reask = decoder.PLAIN_REASK
        self.draft_rows = engine.scheduler.draft_rows
        spec = self.spec
        self.orig = {name: getattr(spec, name) for name in ("drafting", "while_plain_step", "measured")}
        self.s = dict.fromkeys(self.orig, 0.0)

    def set(self, variant: str) -> None:
        spec, engine = self.spec, self.engine
        for name, fn in self.orig.items():
            setattr(spec, name, fn)
        engine.spec, engine.scheduler.draft_rows = spec, self.draft_rows
        self.decoder.PLAIN_REASK = 1 if variant == "O" else self.reask
        if variant == "Z":

            def drafting(out: Any, num_requests: int) -> list[bool]:
                spec.k, spec.fills_draft_kv = 0, False
                return [False] * len(out.scheduled)

            spec.drafting = drafting
            spec.while_plain_step = spec.measured = lambda *args: None
        elif variant == "Y":
            engine.spec = engine.scheduler.draft_rows = None
        elif variant == "T":  # A, each hook timed
            self.s = dict.fromkeys(self.orig, 0.0)
            for name, fn in self.orig.items():
                setattr(spec, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.s[name] += time.perf_counter() - start

        return timed


class DeviceClock:
    """CUDA events around each decode graph replay of an engine: the device ms of its replays."""

    def __init__(self, engine: Any) -> None:
        import torch

        self.pairs: list[tuple[Any, Any]] = []
        graphs = engine.runner.graphs
        if graphs is None or not torch.cuda.is_available():
            return
        replay = graphs.replay

        def timed(*args: Any, **kw: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return replay(*args, **kw)
            finally:
                end.record()
                self.pairs.append((start, end))

        graphs.replay = timed

    def take_us(self) -> float | None:
        """The median µs of the replays since the last take (None: none timed)."""
        import torch

        if not self.pairs:
            return None
        torch.cuda.synchronize()
        us = [1e3 * a.elapsed_time(b) for a, b in self.pairs]
        self.pairs.clear()
        return statistics.median(us)


def run(engine: Any, num_seqs: int, steps: int) -> list[float]:
    """`num_seqs` greedy requests of `steps` decode steps: each decode-only step's wall seconds."""
    from lab.diagnostics.spec_plain_host import add_requests

    add_requests(engine, num_seqs, steps + 1, prompt_len=64)
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
    """A (mtp:3, adaptive), B and C (off) as `benchmarks.engine.mtp_gpu.nano_engines` builds its A and B:
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
    for side, k in (("A", 3), ("B", 0), ("C", 0)):
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
        switch = Variants(a)
        engines_by = {v: (b if v == "B" else built["C"] if v == "C" else a) for v in ORDER}
        clocks = {id(e): DeviceClock(e) for e in built.values()}
        for engine in built.values():
            run(engine, num_seqs, 16)  # warm (the shapes are the warm-up's already)
            clocks[id(engine)].take_us()
        by: dict[str, list[float]] = {v: [] for v in ORDER}
        replay_us: dict[str, list[float]] = {v: [] for v in ORDER}
        hook_us: dict[str, list[float]] = {h: [] for h in switch.s}
        drafted = 0
        for r in range(rounds):
            for v in ORDER if r % 2 == 0 else ORDER[::-1]:
                switch.set(v)
                k0 = a.stats.spec_verifies
                wall = run(engines_by[v], num_seqs, steps)
                drafted += a.stats.spec_verifies - k0
                by[v].append(1e6 * statistics.median(wall))
                us = clocks[id(engines_by[v])].take_us()
                if us is not None:
                    replay_us[v].append(us)
                if v == "T":
                    for h, s in switch.s.items():
                        hook_us[h].append(1e6 * s / max(len(wall), 1))
        switch.set("A")
        row: dict[str, Any] = {
            v: {"median": statistics.median(x), "min": min(x), "max": max(x), "runs": x}
            for v, x in by.items()
        }
        row["replay_us"] = {v: statistics.median(x) for v, x in replay_us.items() if x}
        row["hooks_us_T"] = {h: statistics.median(x) for h, x in hook_us.items()}
        row["verifies_in_A"] = drafted
        out[str(num_seqs)] = row
        print(
            f"== {name} c={num_seqs}: wall µs a decode step, median [min, max] of {rounds} runs"
            f" (A verified {drafted} times)"
        )
        base = row["B"]["median"]
        for v in ORDER:
            r = row[v]
            dev = f"replay {statistics.median(replay_us[v]):6.1f}" if replay_us[v] else ""
            print(
                f"   {v}  {r['median']:8.1f} [{r['min']:.1f}, {r['max']:.1f}]  {r['median'] - base:+6.1f}  {dev}"
                f"  {LABELS[v]}"
            )
        print("   T's hooks µs a step: " + ", ".join(f"{h} {us:.1f}" for h, us in row["hooks_us_T"].items()))
        del built, a, b, engines_by, switch
    return out


def clock_cost() -> float:
    """µs of one `time.perf_counter` call here (a VM's clock source can make it dear)."""
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        time.perf_counter()
    return 1e6 * (time.perf_counter() - start) / n


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
    print(f"== time.perf_counter: {clock_cost():.3f} µs a call")
    report = {m: measure(m, seqs, args.steps, args.rounds, args.device) for m in args.models.split(",")}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
