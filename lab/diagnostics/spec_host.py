"""Host work of a plain decode step and of a greedy speculative step (k = 3), one sequence, on the CPU:

    python3 -m lab.diagnostics.spec_host [--models glm,kimi] [--steps 60] [--out FILE.json]

Two engines per nano model over one loaded copy (fp32, CPU): plain (no speculation) and fixed
k = 3 drafts (always on). Both capture their graphs through a counting `eager_capture`, so every
step takes the path it takes on the GPU (decode graphs' staging and replay; the greedy step's
(k, bucket) graph), a replay running the captured function eagerly. A replay stands for one
`cudaGraphLaunch`: its time is subtracted from the step's wall time (so is any eager model forward
outside a replay), and what is left is the host's: scheduling, pages, planning, staging, reading
back, bookkeeping.

Passes over the same kind of steps. Timing: wall ms per step less replays and forwards (median,
p10, p90), and this thread's CPU ms likewise (what a loaded machine's preemptions do not move). Counting (slower, not timed), outside replays and forwards only, per step:

- `host_tensors`: tensors made from host data (`torch.tensor`, `torch.as_tensor`, `torch.from_numpy`);
- `h2d`: host-to-device copies as a CUDA device would do them: a staging buffer's `send`, each
  `to_device` / `array_to_device`, each `torch.tensor(..., device=)` outside those;
- `to_device_calls`: `Tensor.to(...)` with a device argument;
- `reads`: `.tolist()`, `.item()`, `.cpu()`, `.numpy()` (each one a device-to-host sync on CUDA);
- `replays`, `eager_forwards`: graph replays, model forwards outside them;
- `aten_ops`: aten ops dispatched outside replays and forwards (each one a launch on the device),
  and the commonest of them; `replay_aten_ops`: those inside replays and forwards (a loose proxy for
  a graph's node count, the CPU running the kernels' torch references);
- `py_calls` (a third pass, nothing else wrapped): Python and C function calls outside replays and
  forwards, as `sys.setprofile` sees them: the host work in a unit that machine load does not move.

Steps are classified: `plain` (plain engine, one decode row) and `greedy` (the spec engine's steps
that ran `_run_greedy`); others (prefill, the first proposing step) are left out.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODELS = {"glm": Path("models/glm-5.2-nano"), "kimi": Path("models/kimi-k2.6-nano")}


class Meter:
    """Replay and forward time, and (while `counting`) the host's transfers outside them."""

    def __init__(self) -> None:
        self.device_s = 0.0  # replays and eager forwards: wall seconds
        self.device_cpu_s = 0.0  # and this thread's CPU seconds in them
        self.depth = 0  # > 0 inside a replay or forward: nothing counted there
        self.helper = 0  # > 0 inside a to_device helper: its own torch.tensor is not counted again
        self.counting = False
        self.counts: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()

    def count(self, label: str) -> None:
        if self.counting and self.depth == 0:
            self.counts[label] += 1

    def capture(self, step: Callable[[], Any]) -> Callable[[], Any]:
        """`eager_capture`, timed and counted: a replay is one graph launch."""

        def replay() -> Any:
            self.count("replays")
            with self.device():
                return step()

        return replay

    @contextmanager
    def device(self) -> Iterator[None]:
        outer = self.depth == 0
        self.depth += 1
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.depth -= 1
            if outer:
                self.device_s += time.perf_counter() - start
                self.device_cpu_s += time.thread_time() - start_cpu


class AtenCounter(TorchDispatchMode):
    def __init__(self, meter: Meter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        m = self.meter
        if m.counting and m.depth == 0:
            m.counts["aten_ops"] += 1
            m.ops[str(func.overloadpacket.__name__)] += 1
        elif m.counting:
            m.counts["replay_aten_ops"] += 1
        return func(*args, **(kwargs or {}))


def instrument(meter: Meter, models: list[Any]) -> Callable[[], None]:
    """Wrap what is counted; returns the undo."""
    import backend.engine.host_staging as staging
    from backend.engine import decode_graphs, model_runner
    from backend.engine.speculative import decoder, forwards, verify_graphs

    undo: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        fn = getattr(obj, name)
        undo.append((obj, name, fn))
        setattr(obj, name, make(fn))

    def counted(label: str, *, helper: bool = False, device_kw: str | None = None) -> Callable[[Any], Any]:
        def make(fn: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                if label != "h2d" or meter.helper == 0:
                    meter.count(label)
                if meter.helper == 0 and device_kw is not None and kw.get(device_kw) is not None:
                    meter.count("h2d")
                if not helper:
                    return fn(*args, **kw)
                meter.helper += 1
                try:
                    return fn(*args, **kw)
                finally:
                    meter.helper -= 1

            return wrapper

        return make

    def to_with_device(fn: Any) -> Any:
        def wrapper(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if meter.helper == 0 and (
                kw.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args)
            ):
                meter.count("to_device_calls")
            return fn(self, *args, **kw)

        return wrapper

    for name in ("tensor", "as_tensor"):
        wrap(torch, name, counted("host_tensors", device_kw="device"))
    wrap(torch, "from_numpy", counted("host_tensors"))
    wrap(staging.StagingBuffer, "send", counted("h2d"))
    for module in (staging, decode_graphs, model_runner, decoder, forwards, verify_graphs):
        for name in ("to_device", "array_to_device"):
            if hasattr(module, name):
                wrap(module, name, counted("h2d", helper=True))
    for name in ("tolist", "item", "cpu", "numpy"):
        wrap(torch.Tensor, name, counted("reads"))
    wrap(torch.Tensor, "to", to_with_device)

    def forward(fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            meter.count("eager_forwards")
            with meter.device():
                return fn(*args, **kw)

        return wrapper

    for model in models:
        for name in ("forward", "forward_spec", "forward_mtp"):
            if hasattr(model, name):
                wrap(model, name, forward)

    def restore() -> None:
        while undo:
            obj, name, fn = undo.pop()
            if obj in models:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)

    return restore


def engines(
    checkpoint: Path,
    meter: Meter,
    sides: tuple[tuple[str, int], ...] = (("plain", 0), ("greedy", 3)),
    adaptive: bool = False,
) -> dict[str, Any]:
    """An engine per (side, drafts) over one fp32 CPU load of the checkpoint (`adaptive`: the draft
    policy on)."""
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    loaded = load_model(
        checkpoint, dtype=torch.float32, device="cpu", num_mtp_layers=num_mtp_layers_in(checkpoint)
    )
    out = {}
    for side, k in sides:
        config = EngineConfig.build(
            num_pages=256, page_size=16, max_num_batched_tokens=4096, max_num_seqs=1,
            enable_prefix_cache=False, num_speculative_tokens=k, speculative_max_seqs=1,
            speculative_adaptive=adaptive,
        )  # fmt: skip
        prepared = prepare_model(loaded, config, model_dtype=torch.float32)
        out[side] = Engine.from_prepared(prepared, config, graph_capture=meter.capture)
    return out


def measure(
    engine: Any,
    meter: Meter,
    side: str,
    prompt: list[int],
    steps: int,
    counting: bool,
    profile: Any = None,
    calls: list[int] | None = None,
) -> list[dict]:
    """One request, greedy, `steps` decode steps: per kept step its host seconds and counts (and,
    with `profile`, a `sys.setprofile` hook counting into `calls[0]`, its calls)."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=4 * steps + 8, ignore_eos=True)
    rid = f"{side}-{time.monotonic_ns()}"
    engine.add_request(
        EngineRequest(request_id=rid, prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
    )
    kept = []
    while engine.has_unfinished and len(kept) < steps:
        greedy0 = engine.spec.num_greedy_steps if engine.spec is not None else 0
        computed0 = engine.stats.computed_tokens
        meter.device_s, meter.device_cpu_s, meter.counting = 0.0, 0.0, counting
        meter.counts.clear()
        meter.ops.clear()
        if calls is not None:
            calls[0] = 0
        sys.setprofile(profile)
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        sys.setprofile(None)
        meter.counting = False
        if side == "greedy":
            keep = engine.spec.num_greedy_steps > greedy0
        else:
            keep = engine.stats.computed_tokens - computed0 == 1 and engine.stats.steps > 1
        if keep:
            kept.append(
                {
                    "host_s": wall - meter.device_s,
                    "host_cpu_s": cpu - meter.device_cpu_s,
                    "counts": dict(meter.counts),
                    "ops": dict(meter.ops),
                    "calls": calls[0] if calls is not None else 0,
                }
            )
    engine.abort(rid) if engine.has_unfinished else None
    while engine.has_unfinished:
        engine.step()
    return kept


def python_calls(engine: Any, meter: Meter, side: str, prompt: list[int], steps: int) -> list[int]:
    """Per kept step, the function calls the host made outside replays and forwards."""
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if meter.depth == 0 and event in ("call", "c_call"):
            calls[0] += 1

    kept = measure(engine, meter, side, prompt, steps, False, profile=profile, calls=calls)
    return [s["calls"] for s in kept]


def summarize(timed: list[dict], counted: list[dict]) -> dict[str, Any]:
    ms = sorted(1e3 * s["host_s"] for s in timed)
    cpu_ms = sorted(1e3 * s["host_cpu_s"] for s in timed)
    n = len(counted)
    labels = sorted({k for s in counted for k in s["counts"]})
    ops: collections.Counter[str] = collections.Counter()
    for s in counted:
        ops.update(s["ops"])
    return {
        "steps": len(timed),
        "host_ms_median": statistics.median(ms),
        "host_ms_p10": ms[len(ms) // 10],
        "host_ms_p90": ms[(9 * len(ms)) // 10],
        "host_cpu_ms_median": statistics.median(cpu_ms),
        "host_cpu_ms_p10": cpu_ms[len(cpu_ms) // 10],
        "per_step": {k: sum(s["counts"].get(k, 0) for s in counted) / n for k in labels},
        "per_step_max": {k: max(s["counts"].get(k, 0) for s in counted) for k in labels},
        "top_aten_ops": {k: v / n for k, v in ops.most_common(12)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm,kimi")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name in args.models.split(","):
        meter = Meter()
        built = engines(MODELS[name], meter)
        vocab = built["plain"].runner.vocab_size
        prompt = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(0)).tolist()
        for side, engine in built.items():
            measure(engine, meter, side, prompt, 8, False)  # warm
            timed = measure(engine, meter, side, prompt, args.steps, False)
            restore = instrument(meter, [engine.runner.model])
            try:
                with AtenCounter(meter):
                    counted = measure(engine, meter, side, prompt, min(args.steps, 20), True)
            finally:
                restore()
            for step, calls in zip(
                counted, python_calls(engine, meter, side, prompt, len(counted)), strict=False
            ):
                step["counts"]["py_calls"] = calls
            report[f"{name}/{side}"] = summary = summarize(timed, counted)
            print(f"== {name} {side}: {summary['steps']} steps, host ms {summary['host_ms_median']:.3f} "
                  f"(p10 {summary['host_ms_p10']:.3f}, p90 {summary['host_ms_p90']:.3f}), "
                  f"host CPU ms {summary['host_cpu_ms_median']:.3f}")  # fmt: skip
            for k, v in summary["per_step"].items():
                print(f"   {k:18} {v:7.2f} per step (max {summary['per_step_max'][k]})")
            print("   aten ops: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["top_aten_ops"].items()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
