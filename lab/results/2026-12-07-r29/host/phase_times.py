"""Wall µs a step in each host phase of the spec engine (or the plain one), the CPU "replay" (the model's
references run eagerly) timed apart: `OMP_NUM_THREADS=1 PYTHONPATH=. python <this file> glm greedy 150`.
One run; read beside `gather_alone.py` (the replay evicts the host's data, so these read high)."""

from __future__ import annotations

import collections
import importlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from lab.diagnostics.spec_host import MODELS, Meter, engines, measure

TARGETS = [
    ("backend.engine.speculative.decoder", "plan_greedy"),
    ("backend.engine.scheduler", "Scheduler.schedule"),
    ("backend.engine.speculative.decoder", "SpecDecoder.drafting"),
    ("backend.engine.speculative.decoder", "SpecDecoder._run_greedy"),
    ("backend.engine.speculative.forwards", "SpecForwards._greedy"),
    ("backend.engine.speculative.verify_graphs", "VerifyGraphs.stage"),
    ("backend.engine.speculative.verify_graphs", "VerifyGraphs._fill"),
    ("backend.engine.engine", "Engine._postprocess"),
    ("backend.engine.engine", "Engine.step"),
    ("backend.engine.speculative.plan", "guard_rows"),
    ("backend.engine.host_staging", "StagingBuffer.send"),
    ("backend.engine.speculative.policy", "DraftPolicy.observe_step"),
]
acc: collections.Counter[str] = collections.Counter()
cnt: collections.Counter[str] = collections.Counter()


class TimedReplays(Meter):
    def capture(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def replay() -> Any:
            start = time.perf_counter()
            try:
                return step()
            finally:
                acc["~replay"] += time.perf_counter() - start
                cnt["~replay"] += 1

        return replay


def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            acc[key] += time.perf_counter() - start
            cnt[key] += 1

    return wrapper


def main() -> None:
    name, side, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    meter = TimedReplays()
    engine = engines(MODELS[name], meter, sides=((side, 3 if side == "greedy" else 0),))[side]
    for module, qual in TARGETS:
        *path, attr = qual.split(".")
        owner: Any = importlib.import_module(module)
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, timed(getattr(owner, attr), f"{module.rsplit('.', 1)[-1]}.{qual}"))
    prompt = torch.randint(
        0, engine.runner.vocab_size, (48,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    measure(engine, meter, side, prompt, 8, False)  # warm
    acc.clear()
    cnt.clear()
    measure(engine, meter, side, prompt, steps, False)
    n = cnt["engine.Engine.step"]
    for key, seconds in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"{key:45s} {1e6 * seconds / n:9.1f} us/step  calls/step {cnt[key] / n:.2f}")


if __name__ == "__main__":
    main()
