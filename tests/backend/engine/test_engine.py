"""Engine API: batch invariance, stops, log-probs, constraints, images, the async front."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from backend.engine.async_engine import AsyncEngine
from backend.engine.engine_config import EngineConfig
from backend.engine.ranks import StepChannel
from backend.errors import Aborted, Busy, EngineError, InvalidRequest, RanksDown
from schemas.backend import EngineOutput, ImageSpan
from tests.backend.engine_helpers import (
    MODELS,
    TENANT_A,
    TENANT_B,
    ModelShelf,
    make_engine,
    prompt_of,
    request,
    run_all,
    vocab_of,
)

NEEDLE = prompt_of(99, 23)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelShelf:
    return ModelShelf(Path(tmp_path_factory.mktemp("engine_models")))


def mixed_batch(vocab: int = 97) -> list:
    """Seven neighbours: two tenants, lengths across page boundaries, sampled and greedy."""
    lengths = [1, 15, 16, 17, 33, 40, 7]
    return [
        request(
            f"n{i}",
            prompt_of(i, n, vocab),
            tenant=(TENANT_A, TENANT_B)[i % 2],
            max_tokens=12,
            temperature=(0.0, 0.8)[i % 2],
            seed=i,
        )
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("model_name", MODELS)
def test_greedy_output_is_the_same_alone_and_inside_a_batch_of_eight(
    model_name: str, models: ModelShelf
) -> None:
    model = models[model_name]
    needle = prompt_of(99, 23, vocab_of(model))
    alone = run_all(make_engine(model), [request("needle", needle, max_tokens=16)])["needle"].token_ids
    for position in (0, 3, 7):
        batch = mixed_batch(vocab_of(model))
        batch.insert(position, request("needle", needle, max_tokens=16))
        results = run_all(make_engine(model, max_num_batched_tokens=48), batch)
        assert results["needle"].token_ids == alone
        assert len(results) == 8 and all(r.finish_reason == "length" for r in results.values())


def test_seeded_sampling_is_the_same_alone_and_in_a_batch() -> None:
    req = request("s", NEEDLE, temperature=1.0, top_p=0.9, seed=42, max_tokens=16)
    alone = run_all(make_engine(), [req])["s"].token_ids
    crowded = run_all(
        make_engine(),
        [*mixed_batch(), request("s", NEEDLE, temperature=1.0, top_p=0.9, seed=42, max_tokens=16)],
    )
    assert crowded["s"].token_ids == alone


def test_stop_token_ids_eos_and_ignore_eos() -> None:
    base = run_all(make_engine(), [request("a", NEEDLE, max_tokens=10)])["a"].token_ids
    stop_at = base[3]
    first = base.index(stop_at)
    by_id = run_all(make_engine(), [request("b", NEEDLE, max_tokens=10, stop_token_ids=[stop_at])])["b"]
    assert by_id.token_ids == base[: first + 1] and by_id.finish_reason == "stop"
    eos = request("c", NEEDLE, max_tokens=10)
    eos.eos_token_ids = [stop_at]
    assert run_all(make_engine(), [eos])["c"].token_ids == base[: first + 1]
    eos_ignored = request("d", NEEDLE, max_tokens=10, ignore_eos=True)
    eos_ignored.eos_token_ids = [stop_at]
    result = run_all(make_engine(), [eos_ignored])["d"]
    assert result.token_ids == base and result.finish_reason == "length"


def test_stop_strings_are_matched_on_detokenized_text_when_a_detokenizer_is_given() -> None:
    base = run_all(make_engine(), [request("a", NEEDLE, max_tokens=10)])["a"].token_ids
    engine = make_engine()
    engine.detokenize = lambda ids: "".join(f"<{i}>" for i in ids)
    stop = f"{base[4]}><{base[5]}"
    result = run_all(engine, [request("s", NEEDLE, max_tokens=10, stop=[stop])])["s"]
    assert result.finish_reason == "stop" and result.token_ids == base[:6]


def test_logprobs_agree_between_generation_and_prompt_scoring() -> None:
    gen = run_all(make_engine(), [request("g", NEEDLE, max_tokens=6, logprobs=True, top_logprobs=3)])["g"]
    assert [lp.token_id for lp in gen.logprobs] == gen.token_ids
    assert all(lp.top[0].token_id == lp.token_id for lp in gen.logprobs)  # greedy picks the top one
    scored = run_all(
        make_engine(max_num_batched_tokens=16),  # chunked, so scores cross chunk edges
        [request("p", NEEDLE + gen.token_ids, max_tokens=1, prompt_logprobs=True, top_logprobs=2)],
    )["p"]
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    assert len(scored.prompt_logprobs) == len(NEEDLE) + 6
    tail = scored.prompt_logprobs[len(NEEDLE) :]
    for got, want in zip(tail, gen.logprobs, strict=True):
        assert got is not None and got.token_id == want.token_id
        assert abs(got.logprob - want.logprob) < 1e-4 and len(got.top) == 2


class EvenTokensOnly:
    """A constraint allowing only even token ids, finishing after four tokens."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[::2] = True
        return mask

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_finished(self) -> bool:
        return len(self.accepted) == 4

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]


def test_constraint_masks_tokens_inside_a_shared_batch() -> None:
    engine = make_engine()
    constraint = EvenTokensOnly()
    engine.add_request(request("c", NEEDLE, max_tokens=10, temperature=1.0, seed=3), constraint=constraint)
    results = run_all(engine, [request("free", NEEDLE, max_tokens=10)])
    assert results["c"].finish_reason == "stop" and len(results["c"].token_ids) == 4
    assert all(t % 2 == 0 for t in results["c"].token_ids) and constraint.accepted == results["c"].token_ids
    assert (
        results["free"].token_ids
        == run_all(make_engine(), [request("free", NEEDLE, max_tokens=10)])["free"].token_ids
    )


def test_image_embeddings_replace_their_placeholder_rows() -> None:
    prompt = prompt_of(5, 30)
    spans = [
        ImageSpan(offset=2, length=6, image_hash="cd" * 32),
        ImageSpan(offset=12, length=8, image_hash="ef" * 32),
    ]
    req = request("img", prompt, max_tokens=6)
    req.image_spans = spans
    embeds = torch.randn(14, 32, generator=torch.Generator().manual_seed(0))
    chunked, whole = make_engine(max_num_batched_tokens=16), make_engine()
    chunked.add_request(req, image_embeds=embeds)
    whole.add_request(req, image_embeds=embeds)
    with_image = run_all(chunked, [])["img"].token_ids
    assert run_all(whole, [])["img"].token_ids == with_image  # span 2 straddles the chunk edge at 16
    assert run_all(make_engine(), [request("txt", prompt, max_tokens=6)])["txt"].token_ids != with_image
    with pytest.raises(InvalidRequest):
        make_engine().add_request(req, image_embeds=embeds[:5])


def test_bfloat16_kv_cache_runs_and_stats_count_work() -> None:
    engine = make_engine(kv_dtype="bfloat16")
    assert engine.runner.kv_cache.layers[0]["k"].dtype == torch.bfloat16
    results = run_all(engine, [request("a", NEEDLE, max_tokens=5)])
    assert results["a"].finish_reason == "length"
    stats = engine.stats
    assert stats.generated_tokens == 5 and stats.computed_tokens == len(NEEDLE) + 4
    assert stats.steps == 5 and stats.total_step_s > 0 and stats.tag_check_aborts == 0


async def test_async_engine_streams_and_aborts_when_the_caller_leaves() -> None:
    engine = make_engine(num_pages=16)
    front = AsyncEngine(engine)
    front.start()
    try:

        async def consume(rid: str, n: int) -> list[int]:
            tokens: list[int] = []
            async for out in front.generate(request(rid, prompt_of(len(rid), 12), max_tokens=n)):
                tokens += out.token_ids
            return tokens

        a, b = await asyncio.gather(consume("a", 5), consume("bb", 7))
        assert (len(a), len(b)) == (5, 7)
        stream = front.generate(request("leaver", NEEDLE, max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()  # client gone: the engine aborts it within a step
        for _ in range(200):
            if engine.stats.aborts == 1 and front.load().free_pages == 16 and front.load().running == 0:
                break
            await asyncio.sleep(0.01)
        assert front.load().free_pages == 16 and engine.stats.aborts == 1
        with pytest.raises(InvalidRequest):
            async for _ in front.generate(request("empty", [])):
                pass
    finally:
        front.stop()


async def test_an_idle_engine_with_other_ranks_keeps_them_from_timing_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `--tp N` the other ranks wait for rank 0's next step in a collective that fails after
    `--rank-timeout-s`: an idle engine thread sends them a keep-alive when `keep_alive_in` is up (without
    it an idle group went down once a timeout, 2026-12-06), and one that fails (a rank is gone:
    handled by the group's failure callback) does not kill the thread."""
    engine = make_engine(num_pages=16)
    assert engine.keep_alive_in is None  # one rank: it waits as long as it likes
    channel = StepChannel(0, 2, torch.device("cpu"), timeout_s=4.0)  # counted from its last broadcast
    assert 0.9 < channel.keep_alive_in() <= 1.0
    channel._last_broadcast -= 0.7
    assert 0.2 < channel.keep_alive_in() <= 0.3
    channel._last_broadcast -= 5  # overdue (the server's start after the warm-up's last step): at once
    assert channel.keep_alive_in() == 0.0
    sent: list[float] = []

    def keep_alive() -> None:
        sent.append(time.monotonic())
        if len(sent) == 3:
            raise RanksDown("a rank of this backend failed")

    monkeypatch.setattr(type(engine), "keep_alive_in", property(lambda self: 0.05))
    monkeypatch.setattr(engine, "keep_alive", keep_alive)
    front = AsyncEngine(engine)
    front.start()
    try:
        await asyncio.sleep(0.6)
        assert 6 <= len(sent) <= 14 and front.is_alive  # ~one per 0.05 s of idleness
        tokens = [
            t
            async for out in front.generate(request("after", prompt_of(1, 12), max_tokens=5))
            for t in out.token_ids
        ]
        assert len(tokens) == 5
    finally:
        front.stop()


async def test_async_engine_reports_busy_at_once() -> None:
    engine = make_engine(num_pages=4)
    front = AsyncEngine(engine)
    front.start()
    try:
        hog = front.generate(request("hog", prompt_of(1, 40), max_tokens=20))
        await hog.__anext__()
        busy = request("busy", prompt_of(2, 20), max_tokens=2)
        busy.reject_if_busy = True
        with pytest.raises(Busy):
            async for _ in front.generate(busy):
                pass
        with pytest.raises(InvalidRequest):  # a second stream under a live id never steals its outputs
            async for _ in front.generate(request("hog", prompt_of(3, 5), max_tokens=2)):
                pass
        assert len((await hog.__anext__()).token_ids) == 1
        await hog.aclose()
    finally:
        front.stop()


@pytest.mark.parametrize("model_name", ["deepseek_v3", "glm4_moe"])
def test_fp8_kv_cache_gets_calibrated_scales_and_stays_close(model_name: str, models: ModelShelf) -> None:
    model = models[model_name]
    prompt = prompt_of(5, 40, vocab_of(model))
    logprobs = {}
    for kv_dtype in ("auto", "float8_e4m3fn"):
        engine = make_engine(model, kv_dtype=kv_dtype, max_num_batched_tokens=16)
        result = run_all(engine, [request("x", prompt, max_tokens=4, prompt_logprobs=True)])["x"]
        assert result.error is None and engine.stats.tag_check_aborts == 0
        assert result.prompt_logprobs is not None
        logprobs[kv_dtype] = torch.tensor([lp.logprob for lp in result.prompt_logprobs[1:] if lp is not None])
    cache = engine.runner.kv_cache
    assert all(t.dtype == torch.float8_e4m3fn for t in cache.layers[0].values())
    assert all(0.0 < s != 1.0 for layer in cache.scales for s in layer.values())  # never a silent 1.0
    assert (logprobs["float8_e4m3fn"] - logprobs["auto"]).abs().max() < 1.0


@pytest.mark.gpu
def test_engine_on_cuda_gives_the_cpu_greedy_tokens_and_reproducible_seeds() -> None:
    batch = [*mixed_batch(), request("needle", NEEDLE, max_tokens=16)]
    on_cpu = run_all(make_engine(), batch)
    on_gpu = run_all(make_engine(device="cuda"), batch)
    again = run_all(make_engine(device="cuda"), batch)
    assert on_gpu.keys() == on_cpu.keys()
    for rid, req in zip((r.request_id for r in batch), batch, strict=True):
        if req.sampling.temperature == 0:
            assert on_gpu[rid].token_ids == on_cpu[rid].token_ids, rid
        assert on_gpu[rid].token_ids == again[rid].token_ids, rid


@pytest.mark.parametrize("model_name", ["deepseek_v3", "glm4_moe"])
def test_prompt_and_token_logprobs_equal_transformers(model_name: str, models: ModelShelf) -> None:
    """Log-probs a client gets (prompt scoring across chunk edges, and generated tokens' top-k)
    are transformers' log_softmax on the same checkpoint, computed without any cache."""
    from tests.backend.conformance import reference_logits
    from tests.backend.tiny_checkpoints import load_reference

    model = models[model_name]
    reference = load_reference(model_name, models.root / model_name)
    prompt = prompt_of(8, 37, vocab_of(model))
    engine = make_engine(model, max_num_batched_tokens=16)
    req = request("x", prompt, max_tokens=5, logprobs=True, top_logprobs=3, prompt_logprobs=True)
    result = run_all(engine, [*mixed_batch(vocab_of(model))[:3], req])["x"]
    expected = torch.log_softmax(reference_logits(reference, prompt + result.token_ids), dim=-1)  # [L, V]
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    for pos, lp in enumerate(result.prompt_logprobs[1:], start=1):
        assert lp is not None and lp.token_id == prompt[pos]
        assert abs(lp.logprob - float(expected[pos - 1, prompt[pos]])) < 1e-4
    for i, lp in enumerate(result.logprobs):
        row = expected[len(prompt) - 1 + i]
        assert lp.token_id == int(row.argmax()) and abs(lp.logprob - float(row.max())) < 1e-4
        assert [t.token_id for t in lp.top] == row.topk(3).indices.tolist()


def fail_once(owner: object, method: str, message: str) -> None:
    """Make `owner.method(...)` raise `RuntimeError(message)` on its next call only."""
    original = getattr(owner, method)

    def broken(*args: object, **kwargs: object) -> None:
        setattr(owner, method, original)
        raise RuntimeError(message)

    setattr(owner, method, broken)


async def test_a_failing_step_ends_every_live_request_and_the_engine_keeps_serving() -> None:
    engine = make_engine(num_pages=16)
    front = AsyncEngine(engine)
    front.start()
    try:
        stream = front.generate(request("victim", NEEDLE, max_tokens=50))
        assert len((await stream.__anext__()).token_ids) == 1
        fail_once(engine.runner.model, "forward", "device fell over")
        last = [out async for out in stream][-1]
        assert last.finish_reason == "abort" and last.error is not None and last.error.code == "internal"
        assert "device fell over" in last.error.message
        after = [out async for out in front.generate(request("after", NEEDLE, max_tokens=3))]
        assert sum(len(o.token_ids) for o in after) == 3 and after[-1].finish_reason == "length"
        assert front.load().free_pages == 16
    finally:
        front.stop()


def test_fp8_kv_cache_without_scales_is_refused() -> None:
    with pytest.raises(ValueError, match="scales"):
        make_engine(kv_dtype="float8_e4m3fn")


async def test_a_stopped_async_engine_refuses_requests_instead_of_leaving_them_hanging() -> None:
    front = AsyncEngine(make_engine(num_pages=16))
    front.start()
    front.stop()
    with pytest.raises(Aborted):
        await asyncio.wait_for(anext(front.generate(request("late", NEEDLE, max_tokens=2))), timeout=5)
    # an add still queued when the engine thread exits ends too, one way or the other
    front = AsyncEngine(make_engine(num_pages=16))
    stream = front.generate(request("queued", NEEDLE, max_tokens=200))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # the add is queued; no engine thread runs yet
    front.start()
    front.stop()
    try:
        out = await asyncio.wait_for(first, timeout=5)
        assert out.finish_reason == "abort" or out.token_ids
    except Aborted:
        pass
    await stream.aclose()


async def test_a_bug_while_adding_a_request_refuses_it_and_the_engine_thread_keeps_serving() -> None:
    engine = make_engine(num_pages=16)
    fail_once(engine, "add_request", "bad image tensor")
    front = AsyncEngine(engine)
    front.start()
    try:
        with pytest.raises(EngineError, match="bad image tensor") as refused:
            await asyncio.wait_for(anext(front.generate(request("first", NEEDLE, max_tokens=2))), timeout=5)
        assert refused.value.code == "internal"
        after = [out async for out in front.generate(request("after", NEEDLE, max_tokens=3))]
        assert sum(len(o.token_ids) for o in after) == 3 and after[-1].finish_reason == "length"
    finally:
        front.stop()


def test_pages_of_a_failed_step_come_back_so_a_request_needing_the_whole_pool_still_runs() -> None:
    engine = make_engine(num_pages=4)
    fail_once(engine.runner.model, "forward", "device fell over")
    engine.add_request(request("victim", prompt_of(1, 40), max_tokens=20))  # 3 of the 4 pages
    with pytest.raises(RuntimeError, match="device fell over"):
        engine.step()
    engine.fail_all(EngineError("the step failed"))
    assert engine.load().free_pages == 4  # nothing of the failed step can still write into them
    whole_pool = run_all(engine, [request("after", prompt_of(2, 60), max_tokens=4)], max_steps=50)
    assert whole_pool["after"].finish_reason == "length"


async def test_a_reused_request_id_never_receives_the_previous_stream_outputs() -> None:
    """A stream that left is aborted only at the next step; a new stream under the same id (a retry)
    must neither be refused for it nor be handed the old request's tokens."""
    fresh = prompt_of(5, 9)
    alone = run_all(make_engine(num_pages=16), [request("x", fresh, max_tokens=6)])["x"].token_ids
    front = AsyncEngine(make_engine(num_pages=16))
    front.start()
    try:
        for _ in range(5):
            old = front.generate(request("x", NEEDLE, max_tokens=200))
            await anext(old)
            await old.aclose()  # the engine keeps stepping it until the abort lands
            outs = [out async for out in front.generate(request("x", fresh, max_tokens=6))]
            assert all(out.request_id == "x" for out in outs)
            assert [t for out in outs for t in out.token_ids] == alone
            assert outs[-1].finish_reason == "length"
    finally:
        front.stop()


def test_a_stream_whose_event_loop_is_gone_does_not_kill_the_engine_thread() -> None:
    front = AsyncEngine(make_engine(num_pages=16))
    front.start()
    try:

        async def leave_open() -> AsyncIterator[EngineOutput]:
            stream = front.generate(request("orphan", NEEDLE, max_tokens=200))
            await anext(stream)
            return stream  # never closed: its event loop ends under it

        loop = asyncio.new_event_loop()
        orphan = loop.run_until_complete(leave_open())
        loop.close()

        async def after() -> list[EngineOutput]:
            stream = front.generate(request("after", NEEDLE, max_tokens=3))
            return await asyncio.wait_for(_collect(stream), timeout=10)

        outs = asyncio.run(after())
        assert sum(len(o.token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"
        del orphan
    finally:
        front.stop()


async def _collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [out async for out in stream]


def test_unseeded_requests_differ_across_engine_restarts_unless_the_engine_is_seeded() -> None:
    """A request without a seed samples from a generator the engine seeds: from the OS by default, so
    a restarted server does not replay the same samples; from `EngineConfig.seed` when it is set."""
    assert EngineConfig().seed is None

    def sampled(**config: object) -> list[int]:
        req = request("u", NEEDLE, temperature=1.0, max_tokens=24)
        return run_all(make_engine(**config), [req])["u"].token_ids

    assert sampled() != sampled()  # 24 draws of the tiny model's near-flat distribution
    assert sampled(seed=7) == sampled(seed=7)


async def test_an_engine_thread_that_dies_ends_every_stream_and_says_so() -> None:
    """A bug outside a step (here: the load report after it raises) once killed the engine thread
    silently: `/v1/health` still said ok and every stream, old or new, waited forever. Now each
    live stream ends with an error, a new request is refused at once, and `is_alive` turns False
    (the backend's health then reports `failed`, and the gateway ejects the replica)."""
    engine = make_engine(num_pages=16)
    front = AsyncEngine(engine)
    deaths: list[str] = []
    front.on_death = deaths.append  # the backend's main exits there (its supervisor restarts it)
    front.start()
    try:
        stream = front.generate(request("a", prompt_of(1, 12), max_tokens=50))
        first = await anext(stream)
        assert first.error is None and front.is_alive

        def broken_load() -> object:
            raise RuntimeError("a bug in the load report")

        engine.load = broken_load  # type: ignore[method-assign]
        outs = [first]
        async with asyncio.timeout(10):
            async for out in stream:
                outs.append(out)
        assert outs[-1].finish_reason == "abort" and outs[-1].error is not None
        assert not front.is_alive
        for _ in range(100):
            if deaths:
                break
            await asyncio.sleep(0.01)
        assert len(deaths) == 1 and "a bug in the load report" in deaths[0]
        with pytest.raises(Aborted, match="failed"):
            async with asyncio.timeout(10):
                async for _ in front.generate(request("b", prompt_of(2, 12), max_tokens=5)):
                    pass
    finally:
        front.stop()
