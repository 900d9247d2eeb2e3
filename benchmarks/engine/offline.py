"""Offline runs through `backend.engine.engine.Engine`: all requests queued at once, steps until done.

Every figure comes from wall-clock times taken around `Engine.step()` (each step ends in a host
read of the sampled tokens, so the device has finished it):

    TTFT       first output token time − start, per request (queueing behind other prefills included)
    TPOT       (last − first output token time) / (output tokens − 1), per request
    output tok/s total     all output tokens / wall time of the run
    output tok/s per user  1 / TPOT, averaged over requests
    prefill tok/s          one request of `prefill_len` tokens, max_tokens 1: prompt tokens / TTFT
    decode step            p50 of the steps taken once every request has its first token (no prefill
                           left in the batch), and the batch then: decode alone, which TPOT under an
                           all-at-once offline load is not (it includes the other requests' prefill)

Prompts are seeded random token ids (distinct per request, so the prefix cache would find nothing;
it is off), greedy sampling with EOS ignored, so every request produces exactly `output_len` tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from schemas.backend import EngineRequest, SamplingParams

SALT = "0" * 16


@dataclass(slots=True)
class RunResult:
    variant: str
    concurrency: int
    input_len: int
    output_len: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    output_tok_s_per_user: float
    ttft_ms_p50: float | None  # None: no request produced a token (a run cut at its deadline)
    ttft_ms_max: float | None
    tpot_ms_p50: float | None  # None: no request produced two tokens
    tpot_ms_mean: float | None
    steps: int
    preemptions: int
    finished: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def engine_config(
    num_pages: int,
    page_size: int,
    kv_dtype: str,
    concurrency: int,
    chunk: int,
    *,
    check_page_tags: bool = True,
    cuda_graphs: bool = True,
    num_speculative_tokens: int = 0,
) -> EngineConfig:
    return EngineConfig.build(
        page_size=page_size,
        num_pages=num_pages,
        kv_dtype="float8_e4m3fn" if kv_dtype == "fp8" else "auto",
        max_num_seqs=max(concurrency, 1),
        max_num_batched_tokens=max(chunk, concurrency),
        enable_prefix_cache=False,
        check_page_tags=check_page_tags,
        cuda_graphs=cuda_graphs,
        num_speculative_tokens=num_speculative_tokens,
    )


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_offline(
    engine: Engine,
    *,
    variant: str,
    concurrency: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 1,
    time_limit_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    around_step: Callable[[int, int], AbstractContextManager[Any]] | None = None,
) -> RunResult:
    """`concurrency` requests of `input_len` random tokens, `output_len` tokens each.

    `around_step(step index, decode rows)`, when given, wraps each `engine.step()` (a profiler)."""
    prompts = random_prompts(concurrency, input_len, vocab_size, seed)
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    preempt0, steps0 = engine.scheduler.num_preemptions, engine.stats.steps
    spec0 = _spec_counts(engine)
    _sync(engine.runner.device)
    start = clock()
    request_ids = [f"{variant}-{seed}-{i}" for i in range(concurrency)]
    for rid, ids in zip(request_ids, prompts, strict=True):
        engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=ids, tenant_salt=SALT, sampling=sampling)
        )
    finished = 0
    decode_steps: list[tuple[float, int]] = []  # (ms, sequences) of the steps with no prefill left
    prefill_steps: list[tuple[float, int, int]] = []  # (ms, tokens, decode rows) of the steps with prefill
    shapes: list[tuple[int, int, float]] = []  # (prefill tokens, decode rows, ms) of every step
    step_start = start
    while engine.has_unfinished:
        decoding = len(first) == concurrency  # every prompt done before this step began
        running = concurrency - finished
        decode_rows = len(first) - finished  # requests past their prompt: one token each this step
        # the running sequences with one token left to compute (a preempted one recomputes as prefill)
        num_decode = sum(1 for s in engine.scheduler.running if s.num_uncomputed_tokens == 1)
        tokens0 = engine.stats.computed_tokens
        if around_step is None:
            outputs = engine.step()
        else:
            with around_step(engine.stats.steps - steps0, decode_rows):
                outputs = engine.step()
        now = clock()
        num_prefill = max(engine.stats.computed_tokens - tokens0 - num_decode, 0)
        shapes.append((num_prefill, num_decode, (now - step_start) * 1e3))
        if decoding:
            decode_steps.append(((now - step_start) * 1e3, running))
        else:
            prefill_steps.append(
                ((now - step_start) * 1e3, engine.stats.computed_tokens - tokens0, decode_rows)
            )
        step_start = now
        for out in outputs:
            if out.error is not None and out.error.code != "aborted":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.token_ids)
            finished += out.finish_reason is not None
        if time_limit_s is not None and now - start > time_limit_s:
            for rid in request_ids:  # over its time: abort the rest, reported as unfinished
                engine.abort(rid)
            while engine.has_unfinished:
                engine.step()
            break
    wall = clock() - start
    ttft = [(first[r] - start) * 1e3 for r in first]
    tpot = [(last[r] - first[r]) * 1e3 / (counts[r] - 1) for r in first if counts[r] > 1]
    total = sum(counts.values())
    return RunResult(
        variant=variant,
        concurrency=concurrency,
        input_len=input_len,
        output_len=output_len,
        wall_s=wall,
        output_tokens=total,
        output_tok_s=total / wall,
        output_tok_s_per_user=statistics.fmean(1e3 / t for t in tpot) if tpot else 0.0,
        ttft_ms_p50=statistics.median(ttft) if ttft else None,
        ttft_ms_max=max(ttft) if ttft else None,
        tpot_ms_p50=statistics.median(tpot) if tpot else None,
        tpot_ms_mean=statistics.fmean(tpot) if tpot else None,
        steps=engine.stats.steps - steps0,
        preemptions=engine.scheduler.num_preemptions - preempt0,
        finished=finished,
        extra=_decode_summary(decode_steps)
        | _prefill_summary(prefill_steps)
        | _shape_summary(shapes)
        | _spec_summary(spec0, _spec_counts(engine))
        | {
            "ttft_ms_per_request": [round(t, 2) for t in ttft],
            "tpot_ms_per_request": [round(t, 3) for t in tpot],
        },
    )


def _spec_counts(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats
    return s.spec_verifies, s.spec_drafted_tokens, s.spec_accepted_tokens


def _spec_summary(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, Any]:
    """Speculative decoding over the run: drafts verified and accepted, and `acceptance_length`,
    the tokens a verify emits on average (the target's own token included: 1 … K + 1)."""
    verifies, drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
    if not verifies:
        return {}
    return {
        "spec_verifies": verifies,
        "spec_drafted_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "acceptance_length": round(1 + accepted / verifies, 4),
    }


def _shape_summary(steps: list[tuple[int, int, float]]) -> dict[str, Any]:
    """The distinct step shapes `[prefill tokens, decode rows]` (what a warm-up must have run), and the
    steady decode rate: over the steps with no prompt tokens, the widest batch's rows / median step."""
    out: dict[str, Any] = {"step_shapes": sorted([list(s) for s in {(p, d) for p, d, _ in steps}])}
    decode = [(d, ms) for p, d, ms in steps if p == 0 and d > 0]
    if decode:
        rows = max(d for d, _ in decode)
        ms = statistics.median(ms for d, ms in decode if d == rows)
        out |= {
            "steady_decode_rows": rows,
            "steady_decode_step_ms_p50": ms,
            "steady_decode_tok_s": rows * 1e3 / ms,
        }
    return out


def _decode_summary(steps: list[tuple[float, int]]) -> dict[str, Any]:
    if not steps:
        return {"decode_steps": 0}
    full = max(n for _, n in steps)  # the steps at the full batch, before the first request finishes
    at_full = [ms for ms, n in steps if n == full]
    return {
        "decode_steps": len(steps),
        "decode_batch": full,
        "decode_step_ms_p50": statistics.median(at_full),
        "decode_tok_s": full * 1e3 / statistics.median(at_full),
    }


def _prefill_summary(steps: list[tuple[float, int, int]]) -> dict[str, Any]:
    """The steps that carried prompt tokens: their time, and how it grows with the decode rows riding in them.

    `prefill_ms_per_decode_row` is the least-squares slope of step ms on decode rows over the steps that
    carried a full chunk (at least 90% of the largest token count), `prefill_ms_at_no_decode_rows` its
    intercept: a mixed step should cost about a prefill chunk plus a decode step, so a slope far above
    (decode step ms / batch) says the mixed path has a per-sequence cost of its own."""
    if not steps:
        return {"prefill_steps": 0}
    out: dict[str, Any] = {
        "prefill_steps": len(steps),
        "prefill_step_ms_p50": statistics.median(ms for ms, _, _ in steps),
        "prefill_step_tokens_p50": statistics.median(n for _, n, _ in steps),
    }
    biggest = max(n for _, n, _ in steps)
    full = [(ms, rows) for ms, n, rows in steps if n >= 0.9 * biggest]
    if len({rows for _, rows in full}) > 1:
        fit = statistics.linear_regression([float(r) for _, r in full], [ms for ms, _ in full])
        out |= {"prefill_ms_per_decode_row": fit.slope, "prefill_ms_at_no_decode_rows": fit.intercept}
    return out


def run_prefill(
    engine: Engine, *, variant: str, prefill_len: int, vocab_size: int, seed: int = 7
) -> dict[str, Any]:
    """One prompt of `prefill_len` tokens, one output token: prompt tokens / time to that token."""
    r = run_offline(
        engine,
        variant=variant,
        concurrency=1,
        input_len=prefill_len,
        output_len=1,
        vocab_size=vocab_size,
        seed=seed,
    )
    assert r.ttft_ms_p50 is not None, "a run without a time limit produces its token"
    return {
        "variant": variant,
        "prefill_len": prefill_len,
        "ttft_ms": r.ttft_ms_p50,
        "prefill_tok_s": prefill_len / (r.ttft_ms_p50 / 1e3),
    }


def warm_up(engine: Engine, *, vocab_size: int, prompt_len: int) -> None:
    """Compile and allocate outside the timed runs: one full prefill chunk, then decodes at two
    batch sizes (the Triton kernels compile on first use of each configuration)."""
    for n, length in ((1, prompt_len), (2, min(prompt_len, 64))):
        run_offline(
            engine,
            variant="warmup",
            concurrency=n,
            input_len=length,
            output_len=4,
            vocab_size=vocab_size,
            seed=99 + n,
        )
