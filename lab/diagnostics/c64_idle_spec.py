"""Per-step host work of an idle speculative engine against a speculation-off one, at c = 64, on the CPU
(issue 28: "no loss at c=64"; lab/results/2026-12-05-r10: the adaptive side drafted on no step, yet
its steps took 15-40 % longer than with speculation off on the H100).

    OMP_NUM_THREADS=1 python -m lab.diagnostics.c64_idle_spec [--model models/kimi-k2.6-nano] [--c 64]
        [--max-tokens 16] [--graphs] [--rounds 3]

Two engines over one loaded copy, built as `benchmarks.engine.mtp_gpu.nano_engines` builds them (A:
`mtp:3` with the adaptive policy, B: off; `speculative_max_seqs` = c), float32 on the CPU, the same
`c` held-out prompts (cycled), greedy. `--graphs`: the decode steps through the graphs' static buffers
(`eager_capture`: the GPU's path, no graph). Each side is warmed once, then run with counters, then
`--rounds` times A, B, B, A for wall time. Per step (decode-only steps, and all steps):

- torch ops dispatched (a TorchDispatchMode), inside the model's forwards and outside them, and the
  ops outside by name where the sides differ: each is a kernel launch (or more) on the GPU;
- host-to-device copies (the staging buffer's send, the `to_device` helpers, `torch.tensor(...,
  device=)`) and reads of device values (`.tolist()`, `.item()`);
- host seconds outside the model's forwards (cProfile's engine.step total minus its forwards), and
  the functions that differ;
- wall ms per step (the A/B/B/A rounds).

`--device cuda` runs the same on a GPU (bf16, CUDA graphs): the ops counted are then the launches
outside the decode graph, and the host ms (wall minus the replays' launch calls) is not the host's
share of an asynchronous step: read the wall.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import inspect
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import backend.engine.host_staging as host_staging
from backend.engine import decode_graphs, model_runner
from backend.engine.speculative import accept, decoder, forwards, verify_graphs

COPIERS = (decode_graphs, model_runner, decoder, accept, forwards, verify_graphs)
MODEL_FORWARDS = ("forward", "forward_spec", "forward_mtp")


class Counters(TorchDispatchMode):
    """Torch ops dispatched, inside the model's forwards and outside them (by name), and the host's
    copies to the device and reads of device values, while installed (`install`/`uninstall`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.outside: collections.Counter[str] = collections.Counter()
        self.inside = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.inside:
            self.counts["ops: model"] += 1
        else:
            self.counts["ops: outside model"] += 1
            self.outside[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def _wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        fn = getattr(obj, name)
        self._saved.append((obj, name, fn))
        setattr(obj, name, make(fn))

    def install(self, model: Any) -> None:
        def counted(label: str) -> Callable[[Any], Any]:
            def make(fn: Any) -> Any:
                def wrapper(*args: Any, **kw: Any) -> Any:
                    if not self.inside:
                        self.counts[label] += 1
                    return fn(*args, **kw)

                return wrapper

            return make

        def device_tensor(fn: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                if not self.inside and kw.get("device") is not None:
                    self.counts["h2d"] += 1
                return fn(*args, **kw)

            return wrapper

        def forward(fn: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                self.inside += 1
                self.counts["model forwards"] += 1
                self.counts[f"forwards: {fn.__name__}"] += 1  # forward_mtp: the MTP layer ran
                try:
                    return fn(*args, **kw)
                finally:
                    self.inside -= 1

            return wrapper

        self._wrap(host_staging.StagingBuffer, "send", counted("h2d"))
        for module in COPIERS:
            for name in ("to_device", "array_to_device"):
                if hasattr(module, name):
                    self._wrap(module, name, counted("h2d"))
        self._wrap(torch, "tensor", device_tensor)
        for name in ("tolist", "item"):
            self._wrap(torch.Tensor, name, counted("reads"))
        for name in MODEL_FORWARDS:
            self._wrap(model, name, forward)

    def uninstall(self) -> None:
        while self._saved:
            obj, name, fn = self._saved.pop()
            setattr(obj, name, fn)


def build(
    checkpoint: Path, concurrency: int, max_tokens: int, graphs: bool, device: str = "cpu"
) -> dict[str, Any]:
    """{"A": mtp:3 adaptive, "B": off} over one loaded copy, as `nano_engines` builds them (on CUDA:
    bf16 and CUDA graphs, as served; `graphs` only matters on the CPU)."""
    from backend.engine.decode_graphs import eager_capture
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(checkpoint, dtype=dtype, device=device, num_mtp_layers=num_mtp_layers_in(checkpoint))
    engines = {}
    for side, k in (("A", 3), ("B", 0)):
        config = EngineConfig.build(
            num_pages=max(64, concurrency * (-(-(2048 + max_tokens) // 16))), page_size=16,
            max_num_batched_tokens=4096, max_num_seqs=concurrency, enable_prefix_cache=False,
            num_speculative_tokens=k, speculative_max_seqs=concurrency,
        )  # fmt: skip
        engines[side] = Engine.from_prepared(
            prepare_model(loaded, config, model_dtype=dtype),
            config,
            graph_capture=eager_capture if graphs and device == "cpu" else None,
        )
    return engines


def run(engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int, on_step: Any = None) -> Any:
    """All prompts at once, greedy, to the end: (tokens per request, steps, drafting steps, wall s)."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    for i, p in enumerate(prompts):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=p, tenant_salt="a" * 32, sampling=sampling)
        )
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    steps = drafting = 0
    start = time.perf_counter()
    while engine.has_unfinished:
        before = engine.stats.computed_tokens, len(engine.scheduler.running)
        outputs = engine.step()
        steps += 1
        drafting += bool(engine.spec is not None and engine.spec.k)
        if on_step is not None:
            on_step(engine, before)
        for out in outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
    return dict(tokens), steps, drafting, time.perf_counter() - start


def counted_run(engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int) -> dict[str, Any]:
    """One run under the counters: totals per decode-only step and per step."""
    counters = Counters()
    counters.install(engine.runner.model)
    per_step: list[tuple[bool, collections.Counter[str]]] = []
    outside_decode: collections.Counter[str] = collections.Counter()

    def on_step(e: Any, before: tuple[int, int]) -> None:
        computed, running = before
        is_decode = running > 0 and e.stats.computed_tokens - computed == running
        per_step.append((is_decode, collections.Counter(counters.counts)))
        if is_decode:
            outside_decode.update(counters.outside)
        counters.counts.clear()
        counters.outside.clear()

    try:
        with counters:
            tokens, steps, drafting, _ = run(engine, prompts, stops, max_tokens, on_step)
    finally:
        counters.uninstall()
    decode = [c for d, c in per_step if d]
    keys = sorted({k for _, c in per_step for k in c})
    return {
        "tokens": tokens,
        "steps": steps,
        "decode_steps": len(decode),
        "drafting_steps": drafting,
        "per_decode_step": {k: sum(c[k] for c in decode) / max(len(decode), 1) for k in keys},
        "per_step": {k: sum(c[k] for _, c in per_step) / max(steps, 1) for k in keys},
        "outside_ops_per_decode_step": {k: v / max(len(decode), 1) for k, v in outside_decode.most_common()},
    }


def profiled_run(engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int) -> dict[str, Any]:
    """cProfile over one run: host seconds per step in engine.step, in the model's forwards, and the
    rest (outside them), with the functions outside the forwards by own time."""
    profile = cProfile.Profile()
    profile.enable()
    _, steps, _, _ = run(engine, prompts, stops, max_tokens)
    profile.disable()
    stats = pstats.Stats(profile)
    raw: Any = stats.stats  # type: ignore[attr-defined]
    step_s = sum(v[3] for (f, _, name), v in raw.items() if name == "step" and f.endswith("engine.py"))
    model = type(engine.runner.model)
    entries = {_code_key(getattr(model, name)) for name in MODEL_FORWARDS}
    model_s = sum(v[3] for key, v in raw.items() if key in entries)
    outside = pstats.Stats(profile)  # own time of every function not under a model forward
    return {"steps": steps, "step_ms": step_s / steps * 1e3, "model_ms": model_s / steps * 1e3,
            "outside_model_ms": (step_s - model_s) / steps * 1e3, "stats": outside}  # fmt: skip


def _code_key(fn: Any) -> tuple[str, int, str]:
    code = inspect.unwrap(fn).__code__
    return code.co_filename, code.co_firstlineno, code.co_name


class ModelClock:
    """Seconds spent in the model's compute (eager forwards, or the decode graphs' replays), while
    installed: a step's wall minus these is its host work, what a GPU step launches from."""

    def __init__(self, engine: Any) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[Any, Any, Any]] = []
        model, graphs = engine.runner.model, engine.runner.graphs
        for name in MODEL_FORWARDS:
            self._saved.append((model, name, getattr(model, name)))
            setattr(model, name, self._timed(getattr(model, name)))
        if graphs is not None:
            for key, replay in list(graphs._replays.items()):
                self._saved.append((graphs._replays, key, replay))
                graphs._replays[key] = self._timed(replay)

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        return wrapper

    def uninstall(self) -> None:
        while self._saved:
            obj, key, fn = self._saved.pop()
            if isinstance(obj, dict):
                obj[key] = fn
            else:
                setattr(obj, key, fn)


def host_ms_per_step(
    engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int
) -> tuple[float, float]:
    """One run: (wall ms per step, host ms per step: the wall outside the model's compute)."""
    clock = ModelClock(engine)
    try:
        _, steps, _, wall = run(engine, prompts, stops, max_tokens)
    finally:
        clock.uninstall()
    return wall / steps * 1e3, (wall - clock.seconds) / steps * 1e3


def resume_run(
    checkpoint: Path, prompts: list[list[int]], stops: list[int], max_tokens: int, num_idle: int, device: str
) -> dict[str, Any]:
    """mtp:3, drafting every step (not adaptive) once the policy is let: off for the first
    `num_idle` steps (plain steps, no MTP layer), then on. Per step: wall ms, whether it drafted, and
    the MTP KV gap (positions computed by plain steps, not yet given MTP KV) before and after it;
    the catch-up is the first drafting step's share of closing it."""
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(checkpoint, dtype=dtype, device=device, num_mtp_layers=num_mtp_layers_in(checkpoint))
    c = len(prompts)
    config = EngineConfig.build(
        num_pages=max(64, c * (-(-(2048 + max_tokens) // 16))), page_size=16, max_num_batched_tokens=4096,
        max_num_seqs=c, enable_prefix_cache=False, num_speculative_tokens=3, speculative_max_seqs=c,
        speculative_adaptive=False,
    )  # fmt: skip
    engine = Engine.from_prepared(prepare_model(loaded, config, model_dtype=dtype), config)
    assert engine.spec is not None
    choose, calls = engine.spec.policy.choose, [0]

    def idle_first(load: Any) -> int:
        calls[0] += 1
        return 0 if calls[0] <= num_idle else choose(load)

    engine.spec.policy.choose = idle_first

    def gap() -> int:
        return sum(s.num_computed_tokens - s.num_draft_kv_tokens for s in engine.scheduler.running)

    steps: list[dict[str, Any]] = []

    def on_step(e: Any, before: tuple[int, int]) -> None:
        now = time.perf_counter()
        steps.append({"ms": (now - last[0]) * 1e3, "drafting": bool(e.spec.k), "gap_after": gap()})
        last[0] = now

    last = [time.perf_counter()]
    tokens, _, _, _ = run(engine, prompts, stops, max_tokens, on_step)
    s = engine.stats
    return {
        "tokens": tokens,
        "steps": steps,
        "accepted_per_verify": s.spec_accepted_tokens / max(s.spec_verifies, 1),
    }


def report_resume(args: Any, prompts: list[list[int]], stops: list[int]) -> None:
    r = resume_run(args.model, prompts, stops, args.max_tokens, args.resume, args.device)
    steps = r["steps"]
    first = next((i for i, st in enumerate(steps) if st["drafting"]), None)
    idle = [st["ms"] for st in steps[: args.resume] if not st["drafting"]]
    print(f"\n[resume] {args.resume} plain steps, then mtp:3 every step: {len(steps)} steps, "
          f"accepted per verify {r['accepted_per_verify']:.3f}")  # fmt: skip
    if first is None:
        print("  drafting never resumed (every request finished during the plain steps)")
        return
    before = steps[first - 1]["gap_after"] if first else 0
    later = [st["ms"] for st in steps[first + 1 :] if st["drafting"]]
    print(f"  MTP KV gap when drafting resumed: {before} positions; after the first drafting step "
          f"{steps[first]['gap_after']}; all caught up by step {next((i for i, st in enumerate(steps) if i >= first and not st['gap_after']), None)}")  # fmt: skip
    print(f"  wall ms: plain steps median {statistics.median(idle or [0.0]):.3f}; the first drafting step "
          f"(catch-up) {steps[first]['ms']:.3f}; later drafting steps median {statistics.median(later or [0.0]):.3f}")  # fmt: skip


def main() -> None:
    from benchmarks.engine.mtp_acceptance import held_out_prompts, stop_ids

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/kimi-k2.6-nano"))
    ap.add_argument("--c", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--graphs", action="store_true", help="decode through the graphs' buffers (eager_capture)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cuda: the ops counted are those outside the graphs")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument(
        "--resume", type=int, default=0, help="also: N plain steps, then drafting (the catch-up's cost)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    pool = [p for task in ("chat", "tool-call") for p in held_out_prompts(args.model, task, 8)]
    prompts = [pool[i % len(pool)] for i in range(args.c)]
    stops = stop_ids(args.model)
    engines = build(args.model, args.c, args.max_tokens, args.graphs, args.device)
    for e in engines.values():
        run(e, prompts, stops, args.max_tokens)  # warm
    counted = {side: counted_run(e, prompts, stops, args.max_tokens) for side, e in engines.items()}
    print(f"{args.model.name}, c={args.c}, max_tokens={args.max_tokens}, graphs={args.graphs}")
    print(f"greedy outputs identical: {counted['A']['tokens'] == counted['B']['tokens']}")
    for side, c in counted.items():
        print(
            f"\n[{side}] steps {c['steps']} (decode-only {c['decode_steps']}), drafting steps {c['drafting_steps']}"
        )
        print("  per decode step:", {k: round(v, 2) for k, v in c["per_decode_step"].items()})
        print("  per step (all): ", {k: round(v, 2) for k, v in c["per_step"].items()})
    a, b = counted["A"]["outside_ops_per_decode_step"], counted["B"]["outside_ops_per_decode_step"]
    diff = {k: round(a.get(k, 0) - b.get(k, 0), 2) for k in sorted({*a, *b})}
    print("\nops outside the model per decode step, A - B:", {k: v for k, v in diff.items() if v})
    profiles = {side: profiled_run(e, prompts, stops, args.max_tokens) for side, e in engines.items()}
    for side, p in profiles.items():
        print(f"\n[{side}] cProfile: engine.step {p['step_ms']:.3f} ms/step, model forwards "
              f"{p['model_ms']:.3f}, outside them {p['outside_model_ms']:.3f}")  # fmt: skip
        p["stats"].sort_stats("tottime").print_stats("backend/engine", args.top)
    walls: dict[str, list[float]] = {"A": [], "B": []}
    hosts: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for side in ("A", "B", "B", "A"):
            wall, host = host_ms_per_step(engines[side], prompts, stops, args.max_tokens)
            walls[side].append(wall)
            hosts[side].append(host)
    for side in ("A", "B"):
        w, h = walls[side], hosts[side]
        print(f"[{side}] wall ms/step: median {statistics.median(w):.3f}  runs {[round(x, 3) for x in w]}")
        print(f"[{side}] host ms/step (outside the model's compute): median {statistics.median(h):.3f}  "
              f"runs {[round(x, 3) for x in h]}")  # fmt: skip
    for name, v in (("wall", walls), ("host", hosts)):
        print(f"A / B {name} per step (medians): {statistics.median(v['A']) / statistics.median(v['B']):.3f}")
    if args.resume:
        report_resume(args, prompts, stops)


if __name__ == "__main__":
    main()
