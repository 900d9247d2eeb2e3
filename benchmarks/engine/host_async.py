"""The serving loop's host time per decode step: `Engine` behind `AsyncEngine`, its streams read on an
event loop through the serving layer's `OutputProcessor` (detokenizer, stop matching), the way a
backend process runs it. The engine thread and the event loop share the interpreter, so the loop's
work per output lands between steps too.

Per decode step: the interval from one step's start to the next one's (step, load report, handing
outputs to the loop, and whatever the loop took of the interpreter meanwhile), minus the forward.
Where the loop's work lands depends on when the two threads hand the interpreter lock over, so the
intervals are lumpy: the mean is the throughput figure, the median says little alone.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend.engine.async_engine import AsyncEngine
from backend.text.output_processor import OutputProcessor
from backend.text.tokenizer import load_tokenizer
from backend.text.tokenizer_files import write_tokenizer_files
from schemas.backend import EngineRequest, SamplingParams


def measure_async(
    args: argparse.Namespace,
    batch_size: int,
    mode: str,
    sampling: dict[str, Any],
    build: Callable[[argparse.Namespace, int], tuple[Any, Any, int]],
    random_prompts: Callable[..., list[list[int]]],
) -> dict[str, Any]:
    """`build` and `random_prompts` are host_overhead's: the same engine and prompts as the plain
    measurement (passed in, so neither module imports the other)."""
    engine, model, vocab = build(args, batch_size)
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer_files("kimi", Path(folder), vocab_size=max(vocab, 256))
        tokenizer = load_tokenizer(Path(folder))
    marks: list[tuple[float, float, bool]] = []  # this round's (start, forward s so far, all decoding)
    step = engine.step

    def marked_step() -> Any:
        running, waiting = engine.scheduler.running, engine.scheduler.waiting
        is_decode = bool(running) and not waiting and all(s.num_output_tokens > 0 for s in running)
        marks.append((time.perf_counter(), model.clock.forward_s, is_decode))
        return step()

    engine.step = marked_step  # type: ignore[method-assign]
    front = AsyncEngine(engine)
    front.start()
    host: list[float] = []
    try:
        for rep in range(args.repeats + 1):  # the first round warms up
            marks.clear()
            asyncio.run(_round(front, tokenizer, args, batch_size, rep, sampling, random_prompts))
            if rep > 0:  # from each decode step's start to the next one's
                host += [
                    (b[0] - a[0]) - (b[1] - a[1])
                    for a, b in zip(marks, marks[1:], strict=False)
                    if a[2] and b[2]
                ]
    finally:
        front.stop()
    return {
        "batch_size": batch_size,
        "sampling": mode,
        "timed_steps": len(host),
        "async_host_ms_median": round(statistics.median(host) * 1e3, 4) if host else None,
        # the throughput figure: the loop's share lands on some steps and not others (GIL hand-offs)
        "async_host_ms_mean": round(statistics.fmean(host) * 1e3, 4) if host else None,
        "async_host_us_per_seq_median": round(statistics.median(host) * 1e6 / batch_size, 2)
        if host
        else None,
    }


async def _round(
    front: AsyncEngine,
    tokenizer: Any,
    args: argparse.Namespace,
    batch_size: int,
    rep: int,
    sampling: dict[str, Any],
    random_prompts: Callable[..., list[list[int]]],
) -> None:
    prompts = random_prompts(args, batch_size, args.vocab, seed=5000 + 1000 * rep + batch_size)

    async def consume(i: int, prompt: list[int]) -> int:
        params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, seed=i, **sampling)
        request = EngineRequest(
            request_id=f"a{rep}-{i}", prompt_token_ids=prompt, tenant_salt="0" * 16, sampling=params
        )
        processor = OutputProcessor(tokenizer, reasoning=None, tools=None, stops=[], skip_ids=frozenset())
        num_events = 0
        async for out in front.generate(request):
            num_events += len(processor.process(out))
        return num_events

    await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
