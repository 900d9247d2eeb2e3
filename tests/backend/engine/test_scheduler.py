"""Scheduler through the engine: chunked prefill, decodes never starve, admission by pages,
preemption by recompute, refusals with structured errors."""

from __future__ import annotations

import pytest

from backend.errors import Busy, ContextWindowExceeded, InvalidRequest
from tests.backend.engine_helpers import Result, collect, make_engine, prompt_of, request, run_all


def test_long_prompt_is_prefilled_in_chunks_while_running_decodes_keep_going() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request(request("short", prompt_of(1, 4), max_tokens=20))
    results: dict[str, Result] = {}
    collect(results, engine.step())  # short: prefill + first token
    engine.add_request(request("long", prompt_of(2, 60), max_tokens=3))
    chunk_sizes = []
    while engine.has_unfinished:
        before = len(results["short"].token_ids) if "short" in results else 0
        sched_tokens = engine.stats.computed_tokens
        collect(results, engine.step())
        chunk_sizes.append(engine.stats.computed_tokens - sched_tokens)
        if results["short"].finish_reason is None or len(results["short"].token_ids) > before:
            assert len(results["short"].token_ids) == before + 1 or results["short"].finish_reason
    assert max(chunk_sizes) <= 16  # the budget holds, decode token included
    assert results["long"].finish_reason == "length" and len(results["short"].token_ids) == 20
    # chunking changes nothing: the same prompt prefilled in one go gives the same tokens
    solo = run_all(make_engine(max_num_batched_tokens=128), [request("long", prompt_of(2, 60), max_tokens=3)])
    assert solo["long"].token_ids == results["long"].token_ids


def test_every_running_decode_gets_a_token_every_step() -> None:
    engine = make_engine(max_num_batched_tokens=20)
    for i in range(4):
        engine.add_request(request(f"d{i}", prompt_of(i, 3), max_tokens=30))
    results: dict[str, Result] = {}
    collect(results, engine.step())
    for i in range(3):
        engine.add_request(request(f"p{i}", prompt_of(10 + i, 50), max_tokens=2))
    for _ in range(10):
        counts = {f"d{i}": len(results[f"d{i}"].token_ids) for i in range(4)}
        collect(results, engine.step())
        assert all(len(results[k].token_ids) == v + 1 for k, v in counts.items())


def test_admission_waits_for_free_pages_and_load_reports_it() -> None:
    engine = make_engine(num_pages=6)
    engine.add_request(request("a", prompt_of(1, 60), max_tokens=30))  # 4 pages now, 6 at the end
    engine.add_request(request("b", prompt_of(2, 40), max_tokens=4))  # 3 pages: must wait
    results: dict[str, Result] = {}
    collect(results, engine.step())
    load = engine.load()
    assert (load.running, load.waiting, load.total_pages) == (1, 1, 6)
    while engine.has_unfinished:
        collect(results, engine.step())
    assert results["a"].finish_reason == results["b"].finish_reason == "length"
    assert engine.load().free_pages == 6


def test_max_num_seqs_bounds_the_running_set() -> None:
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        engine.add_request(request(f"r{i}", prompt_of(i, 5), max_tokens=3))
    engine.step()
    assert engine.load().running == 2 and engine.load().waiting == 3


def test_out_of_pages_preempts_the_newest_and_recomputes_it_to_the_same_tokens() -> None:
    prompts = {f"r{i}": prompt_of(40 + i, 14) for i in range(3)}
    solo = {
        rid: run_all(make_engine(), [request(rid, p, max_tokens=30)])[rid].token_ids
        for rid, p in prompts.items()
    }
    engine = make_engine(num_pages=7)  # each needs 3 pages at the end: not all three at once
    results = run_all(engine, [request(rid, p, max_tokens=30) for rid, p in prompts.items()])
    assert engine.stats.preemptions >= 1
    assert {rid: r.token_ids for rid, r in results.items()} == solo
    assert all(len(r.outputs) == 30 for r in results.values())  # no token emitted twice
    assert engine.load().free_pages == 7 and sum(engine.block_manager.refcounts) == 0


def test_preemption_takes_the_newest_request() -> None:
    engine = make_engine(num_pages=5, enable_prefix_cache=False)
    engine.add_request(request("old", prompt_of(1, 15), max_tokens=40))
    engine.step()
    engine.add_request(request("new", prompt_of(2, 15), max_tokens=40))
    while not engine.stats.preemptions:
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["new"]
    assert [s.request_id for s in engine.scheduler.running] == ["old"]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "error", "words"),
    [
        ([], 4, InvalidRequest, "empty"),
        ([1, 2], 0, InvalidRequest, "max_tokens"),
        ([1, 500], 4, InvalidRequest, "vocabulary"),
        (list(range(90)) * 5, 100, ContextWindowExceeded, "(550)"),
    ],
)
def test_bad_input_is_refused_with_a_structured_error(
    prompt: list[int], max_tokens: int, error: type[Exception], words: str
) -> None:
    engine = make_engine()
    req = request("bad", prompt)
    req.sampling.max_tokens = max_tokens
    with pytest.raises(error) as info:
        engine.add_request(req)
    assert words in str(info.value)
    assert not engine.has_unfinished and engine.load().waiting == 0


def test_context_window_error_names_both_numbers_and_uses_the_override() -> None:
    engine = make_engine(context_window=100)
    with pytest.raises(ContextWindowExceeded) as info:
        engine.add_request(request("big", prompt_of(1, 90), max_tokens=20))
    assert (info.value.num_requested, info.value.context_window) == (110, 100)
    assert "110" in info.value.message and "100" in info.value.message
    assert info.value.to_event().code == "context_window_exceeded" and info.value.status == 413


def test_a_request_bigger_than_the_pool_is_over_the_replicas_window() -> None:
    """The pool bounds what a replica admits, and its card (so the catalog) advertises that bound as
    the context window: a request over it is refused at once as over that window, naming it."""
    engine = make_engine(num_pages=4)
    window = 4 * engine.block_manager.page_size
    engine.add_request(request("fits", prompt_of(1, window - 10), max_tokens=10))  # exactly the pool
    with pytest.raises(ContextWindowExceeded) as info:
        engine.add_request(request("huge", prompt_of(2, window - 9), max_tokens=10))  # a token over
    assert info.value.to_event().code == "context_window_exceeded"
    assert (info.value.num_requested, info.value.context_window) == (window + 1, window)
    assert [s.request.request_id for s in engine.scheduler.waiting] == ["fits"]


def test_reject_if_busy_is_refused_at_once_only_when_it_could_not_start_now() -> None:
    engine = make_engine(num_pages=6)
    idle = request("idle", prompt_of(1, 20), max_tokens=2)
    idle.reject_if_busy = True
    engine.add_request(idle)  # room now: accepted
    engine.add_request(request("hog", prompt_of(2, 60), max_tokens=20))  # queued (no pages left)
    engine.step()
    busy = request("busy", prompt_of(3, 5), max_tokens=2)
    busy.reject_if_busy = True
    with pytest.raises(Busy) as info:
        engine.add_request(busy)
    assert info.value.status == 429
    results = run_all(engine, [])
    assert results["hog"].finish_reason == "length"
    later = request("later", prompt_of(3, 5), max_tokens=2)
    later.reject_if_busy = True
    assert run_all(engine, [later])["later"].finish_reason == "length"


def test_duplicate_request_id_is_refused() -> None:
    engine = make_engine()
    engine.add_request(request("same", [1, 2, 3]))
    with pytest.raises(InvalidRequest):
        engine.add_request(request("same", [4, 5, 6]))


def test_lower_priority_value_is_admitted_first() -> None:
    engine = make_engine(max_num_seqs=1)
    for rid, priority in (("batch1", 5), ("batch2", 5), ("interactive", 0)):
        req = request(rid, prompt_of(len(rid), 5), max_tokens=2)
        req.priority = priority
        engine.add_request(req)
    order: list[str] = []
    while engine.has_unfinished:
        order += [o.request_id for o in engine.step() if o.finish_reason is not None]
    assert order == ["interactive", "batch1", "batch2"]


def test_reject_if_busy_counts_the_budget_running_prefills_will_take() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request(request("long", prompt_of(1, 100), max_tokens=2))
    engine.step()  # one chunk done; the next steps' budget all goes to the rest of its prompt
    eager = request("eager", prompt_of(2, 4), max_tokens=2)
    eager.reject_if_busy = True
    with pytest.raises(Busy):
        engine.add_request(eager)


def test_abort_of_a_queued_request_ends_it_without_running_it() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request(request("running", prompt_of(1, 5), max_tokens=5))
    engine.add_request(request("queued", prompt_of(2, 5), max_tokens=5))
    engine.step()
    engine.abort("queued")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["queued"].finish_reason == "abort" and outputs["queued"].num_output_tokens == 0
    assert outputs["queued"].error is not None and outputs["queued"].error.code == "aborted"
    assert engine.load().waiting == 0 and len(outputs["running"].token_ids) == 1


def test_engine_config_limits_are_validated_and_named() -> None:
    import msgspec

    from backend.engine.engine_config import EngineConfig

    with pytest.raises(msgspec.ValidationError, match="page_size"):
        EngineConfig.build(page_size=0)
    with pytest.raises(msgspec.ValidationError, match="kv_dtype"):
        EngineConfig.build(kv_dtype="float16")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.build(max_num_seqs=64, max_num_batched_tokens=32)
    config = EngineConfig.build(kv_dtype="bfloat16")
    with pytest.raises(AttributeError):
        config.num_pages = 1  # type: ignore[misc]


def test_queued_batch_work_does_not_make_an_interactive_reject_if_busy_request_busy() -> None:
    """A queued request of a later priority runs after this one, so it is no reason to refuse it."""
    engine = make_engine(num_pages=8)
    engine.add_request(request("running", prompt_of(1, 60), max_tokens=4))  # 4 of the 8 pages
    engine.step()
    batch = request("batch", prompt_of(2, 80), max_tokens=4)  # 6 pages: waits for "running"
    batch.priority = 5
    engine.add_request(batch)
    engine.step()
    assert engine.load().waiting == 1
    interactive = request("interactive", prompt_of(3, 20), max_tokens=4)  # 2 pages: fits now
    interactive.reject_if_busy = True
    engine.add_request(interactive)
    outputs = {o.request_id: o for o in engine.step()}
    assert len(outputs["interactive"].token_ids) == 1  # admitted ahead of the batch request
    # a queued request of the same priority is still a queue to wait behind
    same = request("same", prompt_of(4, 5), max_tokens=2)
    same.priority, same.reject_if_busy = 5, True
    with pytest.raises(Busy):
        engine.add_request(same)
    results = run_all(engine, [])
    assert {r.finish_reason for r in results.values()} == {"length"}


def test_spare_draft_pages_do_not_count_against_a_tenant_share() -> None:
    """A drafting sequence's spare pages (past its tokens) go back to the pool before anyone waits
    for them, so a tenant's share counts only the pages of its tokens (and a decode's next one)."""
    from backend.engine.scheduler import _Shares
    from tests.backend.engine_helpers import TENANT_A

    engine = make_engine(num_pages=8, page_size=4, tenant_share=0.5)
    engine.add_request(request("a", prompt_of(1, 8), max_tokens=20))
    engine.step()  # prefill, and its first token: 9 tokens
    seq = engine.scheduler.running[0]
    bm = engine.block_manager
    assert seq.num_tokens == 9 and bm.reserve_tokens(seq, 20)  # 5 pages: 2 of them spare
    assert len(seq.page_table) == 5 and bm.num_spare_pages == 2
    shares = _Shares.of(engine.scheduler)
    assert shares.max_pages == 4 and shares.num_pages[TENANT_A] == 3 and not shares.is_over(TENANT_A)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skipping_the_share_sort_when_it_would_not_reorder_changes_no_decision(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """One tenant alone, past its share once three tenants arrive at random into a small pool
    (tenant shares enforced, preemptions, waiting requests): every step schedules and preempts the
    same sequences, and every request ends with the same tokens, whether the decode order is sorted
    by share each step (as before) or only when some running tenants are over their share and some
    not (a stable sort of all-equal keys keeps the order); and the sort did run in some steps."""
    import random

    from backend.engine.scheduler import _Shares

    is_split = _Shares.is_split
    num_split = [0]

    def counted(self: _Shares) -> bool:
        split = is_split(self)
        num_split[0] += split
        return split

    def run(always_sort: bool) -> tuple[list[tuple[list[tuple[str, int]], list[str]]], dict[str, list[int]]]:
        with monkeypatch.context() as m:
            m.setattr(_Shares, "is_split", (lambda self: True) if always_sort else counted)
            engine = make_engine(num_pages=16, max_num_batched_tokens=32, max_num_seqs=8)
            rng = random.Random(seed)
            steps: list[tuple[list[tuple[str, int]], list[str]]] = []
            results: dict[str, Result] = {}
            schedule = engine.scheduler.schedule

            def recorded() -> object:
                out = schedule()
                steps.append(
                    (
                        [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled],
                        [s.request_id for s in out.preempted],
                    )
                )
                return out

            m.setattr(engine.scheduler, "schedule", recorded)
            for i in range(6):  # tenant a alone first: past its share once others arrive
                engine.add_request(request(f"a{i}", prompt_of(100 + i, 20), max_tokens=40))
            n = 0
            for step in range(120):
                if 4 <= step < 60 and rng.random() < 0.4:
                    tenant = ("a" * 32, "b" * 32, "c" * 32)[rng.randrange(3) if rng.random() < 0.5 else 0]
                    engine.add_request(
                        request(
                            f"r{n}",
                            prompt_of(n, rng.randint(2, 30)),
                            max_tokens=rng.randint(2, 24),
                            tenant=tenant,
                        )
                    )
                    n += 1
                if engine.has_unfinished:
                    collect(results, engine.step())
            while engine.has_unfinished:
                collect(results, engine.step())
            return steps, {r: v.token_ids for r, v in results.items()}

    fast, fast_tokens = run(always_sort=False)
    slow, slow_tokens = run(always_sort=True)
    assert fast == slow and fast_tokens == slow_tokens
    assert num_split[0] > 0  # tenants were split by their shares: the sort ran
    assert any(preempted for _, preempted in fast)  # the pool was short: shares and preemption acted


def test_a_tenant_over_its_share_is_preempted_first_when_pages_run_out() -> None:
    """Tenant a starts five requests while alone (past its half of the sequences once b arrives);
    when the pool runs out as they all grow, a's newest are preempted, never b's request, although b's
    is the newest of all: a tenant over its share decodes last in each step (decoded in arrival
    order, b's page would be the one missing, with every sequence of a's already scheduled)."""
    engine = make_engine(num_pages=8, max_num_batched_tokens=128, max_num_seqs=8)
    for i in range(5):
        engine.add_request(request(f"a{i}", prompt_of(200 + i, 15), max_tokens=40, ignore_eos=True))
    results: dict[str, Result] = {}
    collect(results, engine.step())
    engine.add_request(request("b", prompt_of(300, 4), max_tokens=40, ignore_eos=True, tenant="b" * 32))
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def recorded() -> object:
        out = schedule()
        preempted.extend(s.request_id for s in out.preempted)
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    while engine.has_unfinished:
        collect(results, engine.step())
    assert preempted and "b" not in preempted, preempted
    assert all(len(r.token_ids) == 40 for r in results.values())


def test_two_tenants_each_asking_more_than_their_share_are_both_served() -> None:
    """Two tenants each send one request larger than their half of the pool (but within the pool),
    nothing else running: both finish, one after the other. (Before, each waited for the other: a
    tenant past its share waited while any other tenant under its share waited, and neither could
    ever start within its share.) A request within its share still goes first past one that is not."""
    engine = make_engine(
        num_pages=8, page_size=4, max_num_batched_tokens=64, max_num_seqs=4, tenant_share=0.5
    )
    engine.add_request(request("a", prompt_of(1, 20), max_tokens=2, tenant="a" * 32))
    engine.add_request(request("b", prompt_of(2, 20), max_tokens=2, tenant="b" * 32))
    results: dict[str, Result] = {}
    for _ in range(50):
        if not engine.has_unfinished:
            break
        collect(results, engine.step())
    assert {r: v.finish_reason for r, v in results.items()} == {"a": "length", "b": "length"}
    # a third tenant's small request, within its share, starts before a's large one ahead of it
    engine.add_request(request("big", prompt_of(3, 20), max_tokens=4, tenant="a" * 32))
    engine.add_request(request("small", prompt_of(4, 6), max_tokens=4, tenant="c" * 32))
    engine.add_request(request("big2", prompt_of(5, 20), max_tokens=4, tenant="b" * 32))
    started = {o.request_id for o in engine.step()}
    assert "small" in started and "big" not in started
    while engine.has_unfinished:
        collect(results, engine.step())
    assert all(results[r].finish_reason == "length" for r in ("big", "small", "big2"))
