"""A warm-up shorter than the workload that still runs every step shape the timed runs will (issue 25).

A long workload (64 requests of 16,384 / 4,096) cannot be run once untimed per side before its
timed rounds inside one 10-minute device call. Its step shapes are known in advance, though:

    plan      with greedy sampling, `ignore_eos` and fixed lengths the scheduler's choices depend on
              the pool, the token budget, `max_num_seqs` and the lengths, never on the model; the
              real scheduler driven by a null model on the host (`planned_shapes`, seconds for the
              long workload) gives the timed run's step shapes exactly
    warm-up   the workload at shorter lengths (the same admission, queueing and chunking, fewer
              decode steps), then one probe (`probe`) for each planned shape that pass did not run
    check     the record still compares the warm-up's shapes with the timed runs' own (not with the
              plan), and says whether the plan matched what the timed runs did

A probe for (p prefill tokens, d decode rows): d one-token prompts run one step (their prefill), then
a p-token prompt is admitted beside their d decode rows, then everything is aborted.
"""

from __future__ import annotations

from backend.engine.engine import Engine
from benchmarks.engine.method import Shape
from benchmarks.engine.null_model import NullModel
from benchmarks.engine.offline import SALT, engine_config, run_offline
from schemas.backend import EngineRequest, SamplingParams

PLAN_VOCAB = 64  # the null model's: token ids do not steer the scheduler


def planned_shapes(
    *, num_pages: int, page_size: int, concurrency: int, chunk: int, input_len: int, output_len: int
) -> list[Shape]:
    """The step shapes of `run_offline` at these sizes, from the scheduler alone (a null model, CPU)."""
    config = engine_config(num_pages, page_size, "bf16", concurrency, chunk, cuda_graphs=False)
    engine = Engine(NullModel(PLAN_VOCAB), config, vocab_size=PLAN_VOCAB, context_window=1 << 30)  # type: ignore[arg-type]
    r = run_offline(
        engine, variant="plan", concurrency=concurrency, input_len=input_len, output_len=output_len,
        vocab_size=PLAN_VOCAB,
    )  # fmt: skip
    return [(p, d) for p, d in r.extra["step_shapes"]]


def probe(engine: Engine, shape: Shape, *, variant: str) -> list[Shape]:
    """Run one step of `shape` = (prefill tokens, decode rows) on an idle `engine`; the shapes of every
    step the probe took, counted as `run_offline` counts them."""
    assert not engine.has_unfinished
    num_prefill, num_decode = shape
    budget = engine.config.max_num_batched_tokens
    assert num_prefill + num_decode <= budget and num_decode + (num_prefill > 0) <= engine.config.max_num_seqs
    ids = [f"{variant}-{num_prefill}-{num_decode}-{i}" for i in range(num_decode + 1)]
    decode = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for rid in ids[:num_decode]:  # one prompt token each: their prefill is one step of `num_decode` tokens
        engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[1], tenant_salt=SALT, sampling=decode)
        )
    shapes = [_step(engine)] if num_decode else []
    if num_prefill:  # admitted after the decode rows, in the budget they leave
        prompt = [1] * num_prefill
        once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(
            EngineRequest(request_id=ids[-1], prompt_token_ids=prompt, tenant_salt=SALT, sampling=once)
        )
    shapes.append(_step(engine))
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    return shapes


def _step(engine: Engine) -> Shape:
    """One `engine.step()` and its shape: the loop of `run_offline` counts it the same way."""
    num_decode = sum(1 for s in engine.scheduler.running if s.num_uncomputed_tokens == 1)
    tokens0 = engine.stats.computed_tokens
    for out in engine.step():
        if out.error is not None and out.error.code != "aborted":
            raise RuntimeError(f"probe request {out.request_id} failed: {out.error}")
    return (max(engine.stats.computed_tokens - tokens0 - num_decode, 0), num_decode)
