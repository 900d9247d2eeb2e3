"""Speculative decoding with MTP drafts (backend/engine/speculative/decoder.py): exact outputs, pages, tags.

Greedy outputs with speculation must equal those without, token for token, on tiny random
checkpoints given random MTP layers (few drafts are accepted: exactness must not depend on them).
A Markov toy (tests/backend/speculative_toy.py) gives a head whose drafts are the target's own
tokens (every draft accepted) and a known distribution for the χ² test of sampled outputs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.models.loader import load_model, prepare_model
from schemas.backend import parse_speculative
from tests.backend.engine_helpers import Result, collect, request, run_all
from tests.backend.speculative_toy import MarkovModel
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

ARCHS = ("deepseek_v3", "glm_moe_dsa")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        arch: load_model(add_mtp_layers(make_tiny(arch, root / arch)), dtype=torch.float32, num_mtp_layers=1)
        for arch in ARCHS
    }


def engine_for(model: Any, k: int, **config: Any) -> Engine:
    values = dict(num_pages=96, page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
    # a configured draft cost: drafting as the cost model says, not as this host's step times do
    values |= dict(num_speculative_tokens=k, speculative_max_seqs=16, speculative_draft_cost=0.25) | config
    config = EngineConfig.build(**values)
    return Engine.from_prepared(prepare_model(model, config), config)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def check_pool(engine: Engine) -> None:
    """Every running sequence holds only the pages of its tokens, or, while it drafts, those of its
    next step's drafts too (its spare pages, kept between steps), each under its current tag, and
    the cache's tags are the allocator's. (Every test also checks the pool is whole at the end.)"""
    bm = engine.block_manager
    K = engine.spec.K if engine.spec is not None else 0
    spares = bm.spare_holders
    assert set(spares) <= {seq.request_id for seq in engine.scheduler.running}
    for seq in engine.scheduler.running:
        # a plain decode's newest token gets its page when it is scheduled; a drafting sequence
        # keeps the pages of the chained drafts its last step reserved (n_then + 2K - 1 tokens)
        window = seq.num_prompt_tokens + seq.request.sampling.max_tokens
        most = min(seq.num_tokens + 2 * K - 2, window) if seq.request_id in spares else seq.num_tokens
        assert bm.num_pages_for(seq.num_tokens - 1) <= len(seq.page_table) <= bm.num_pages_for(most)
        assert [(r.page_id, r.tag) for r in seq.page_table] == [
            (r.page_id, r.tag) for r in bm._ledger[seq.request_id]
        ]
        assert all(bm.tags[r.page_id] == r.tag for r in seq.page_table)
    tags = engine.runner.kv_cache.page_tags.tolist()
    assert tags[: len(bm.tags)] == bm.tags and set(tags[len(bm.tags) :]) <= {0}  # the graphs' scratch page


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical(loaded: dict[str, Any], arch: str, k: int) -> None:
    model = loaded[arch]
    ps = prompts(24, model.config.vocab_size, seed=k)
    reqs = [request(f"r{i}", p, max_tokens=1 + i % 13) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0), reqs)
    # drafting from the first step: the cap counts waiting requests too, and 24 arrive at once
    engine = engine_for(model, k, speculative_max_seqs=24)
    for r in reqs:
        engine.add_request(r)
    spec: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(spec, engine.step())
        check_pool(engine)
    for r in reqs:
        assert spec[r.request_id].error is None
        assert spec[r.request_id].token_ids == plain[r.request_id].token_ids, r.request_id
    s = engine.stats
    assert s.spec_drafted_tokens > 0 and s.tag_check_aborts == 0
    assert engine.block_manager.num_quarantined_pages == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


class OracleDrafts:
    """Replaces the MTP's drafts after each step with the plain run's next tokens, each wrong with
    probability `p_wrong`: verify then accepts runs of every length, on the real model."""

    def __init__(self, engine: Engine, plain: dict[str, Result], p_wrong: float, seed: int = 0) -> None:
        spec = engine.spec
        assert spec is not None
        self.rng = torch.Generator().manual_seed(seed)
        run = spec.run

        def oracle_run(*args: Any) -> Any:
            results = run(*args)
            for rid, (num_tokens, drafts) in list(spec.book.proposed.items()):
                seq = engine._seqs[rid]
                at = num_tokens - seq.num_prompt_tokens  # output index of the first draft
                truth = plain[rid].token_ids[at : at + len(drafts)]
                wrong = torch.rand(len(truth), generator=self.rng) < p_wrong
                spec.book.proposed[rid] = (
                    num_tokens,
                    [(t + 1) % 256 if w else t for t, w in zip(truth, wrong.tolist(), strict=True)],
                )
            return results

        spec.run = oracle_run  # type: ignore[method-assign]


PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalized"])
def test_greedy_identical_when_drafts_are_often_right(
    loaded: dict[str, Any], arch: str, penalties: dict[str, float]
) -> None:
    """Penalties see the accepted drafts as context: row i is penalized over the tokens before it."""
    model = loaded[arch]
    ps = prompts(16, model.config.vocab_size, seed=7)
    reqs = [
        request(f"r{i}", p, max_tokens=4 + i % 19, logprobs=True, top_logprobs=2, **penalties)
        for i, p in enumerate(ps)
    ]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3)
    OracleDrafts(engine, plain, p_wrong=0.25)
    for r in reqs:
        engine.add_request(r)
    spec: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(spec, engine.step())
        check_pool(engine)
    for r in reqs:
        got, want = spec[r.request_id], plain[r.request_id]
        assert got.token_ids == want.token_ids, r.request_id
        assert got.finish_reason == want.finish_reason
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)
        assert spec[r.request_id].outputs[-1].num_output_tokens == len(want.token_ids)
    s = engine.stats
    assert s.spec_accepted_tokens > s.spec_drafted_tokens / 3  # the accept path ran, at every length
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


def toy_engine(model: MarkovModel, k: int, detokenize: Any = None, **config: Any) -> Engine:
    values = dict(num_pages=256, page_size=4, max_num_batched_tokens=512, max_num_seqs=64)
    # always K drafts (these tests count them); the draft policy has tests of its own
    values |= dict(num_speculative_tokens=k, speculative_max_seqs=64, speculative_adaptive=False) | config
    return Engine(
        model,
        EngineConfig.build(**values),
        vocab_size=model.vocab_size,
        context_window=512,
        detokenize=detokenize,
    )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_draft_accepted_when_the_head_is_the_target(k: int) -> None:
    V = 16
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3
    engine = toy_engine(MarkovModel(target, target), k)
    max_tokens = 1 + 4 * (k + 1)  # the prefill's token, then four full verify steps
    results = run_all(engine, [request(f"r{i}", [i % V], max_tokens=max_tokens) for i in range(8)])
    for i in range(8):
        x, want = i % V, []
        for _ in range(max_tokens):
            x = int(target[x].argmax())
            want.append(x)
        assert results[f"r{i}"].token_ids == want
    s = engine.stats
    assert s.spec_accepted_tokens == s.spec_drafted_tokens == 8 * 4 * k
    assert s.steps == 1 + 4 and s.spec_verifies == 8 * 4
    assert 1 + s.spec_accepted_tokens / s.spec_verifies == k + 1  # tokens per verify: the most there are


def trigram_counts(engine: Engine, x0: int, n: int, vocab: int, params: dict[str, Any]) -> torch.Tensor:
    """`[V, V, V]` float64: how often `n` seeded requests (seeds 0 … n−1, 64 a batch) from the prompt
    `[x0]` generated each run of tokens 2 … 4 (the χ² tests' counts)."""
    counts = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for batch in range(n // 64 + 1):
        ids = range(batch * 64, min(n, (batch + 1) * 64))
        results = run_all(engine, [request(f"r{i}", [x0], seed=i, **params) for i in ids])
        for r in results.values():
            counts[tuple(r.token_ids[1:])] += 1
    return counts


def chi2_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P(χ² ≥ the statistic) over the cells expected ≥ 5 times (the rest pooled into one)."""
    n = observed.sum()
    expected = expected_probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2) / exp)[keep].sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def reference_probs(
    logits: torch.Tensor, seen: set[int], temperature: float, top_k: int, rep: float
) -> torch.Tensor:
    """The target's sampling distribution, written out: repetition penalty over the seen tokens,
    temperature, top-k."""
    x = logits.clone().double()
    for t in seen:
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    x = x / temperature
    if top_k:
        kth = x.topk(top_k).values[-1]
        x[x < kth] = float("-inf")
    return torch.softmax(x, dim=-1)


@pytest.mark.slow  # a χ² test over many samples
@pytest.mark.parametrize(
    ("temperature", "top_k", "rep"), [(1.0, 0, 1.0), (0.7, 4, 1.5)], ids=["plain", "penalized"]
)
def test_sampled_outputs_follow_the_target(temperature: float, top_k: int, rep: float) -> None:
    """χ² on the (2nd, 3rd, 4th) output tokens, drawn by one verify step of two drafts (accepted
    drafts, redraws after a rejection, bonus tokens); the head is the target plus noise, so its
    greedy drafts are often but not always accepted."""
    V, x0, N = 6, 0, 6000
    g = torch.Generator().manual_seed(1)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g)
    engine = toy_engine(MarkovModel(target, draft), 2)
    params = dict(temperature=temperature, top_k=top_k, repetition_penalty=rep, max_tokens=4)
    counts = trigram_counts(engine, x0, N, V, params)
    expected = torch.zeros(V, V, V, dtype=torch.float64)
    for t1, t2, t3, t4 in itertools.product(range(V), repeat=4):
        p = reference_probs(target[x0], {x0}, temperature, top_k, rep)[t1]
        p = p * reference_probs(target[t1], {x0, t1}, temperature, top_k, rep)[t2]
        p = p * reference_probs(target[t2], {x0, t1, t2}, temperature, top_k, rep)[t3]
        expected[t2, t3, t4] += p * reference_probs(target[t3], {x0, t1, t2, t3}, temperature, top_k, rep)[t4]
    s = engine.stats
    assert s.spec_drafted_tokens >= 2 * N  # two drafts verified in every request's first verify
    assert 0.2 < s.spec_accepted_tokens / s.spec_drafted_tokens < 0.9  # accepts and rejects both ran
    assert chi2_p_value(counts.flatten(), expected.flatten()) > 1e-3


def test_parse_speculative() -> None:
    assert [parse_speculative(t) for t in (None, "", "off", "mtp:1", "mtp:3")] == [0, 0, 0, 1, 3]
    for bad in ("mtp:0", "mtp:4", "eagle:2", "mtp"):
        with pytest.raises(ValueError, match="mtp:K"):
            parse_speculative(bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tag_fault_in_a_draft_page_aborts_only_that_request(loaded: dict[str, Any], arch: str) -> None:
    """After the verify forward, before the draft forward, the victim's page where the draft's KV
    goes is handed to another request: the draft's tag check must catch it, and abort it alone."""
    from tests.backend.engine_faults import FaultInjector

    model = loaded[arch]
    ps = prompts(3, model.config.vocab_size, seed=11)
    reqs = [request(f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 2)
    injector = FaultInjector(engine)
    forward_mtp = model.model.forward_mtp
    calls = itertools.count()

    def faulty_forward_mtp(batch: Any, hidden: torch.Tensor, depth: int, step: Any = None, **kw: Any) -> Any:
        if next(calls) == 4:  # a decode step's first draft forward (the prompts went first)
            victim = injector.seq("r0")
            page = victim.page_table[victim.num_computed_tokens // engine.block_manager.page_size].page_id
            injector._give(page, injector.seq("r1"))
            engine.runner.apply_tag_updates(engine.block_manager.take_tag_updates())
        return forward_mtp(batch, hidden, depth, step, **kw)

    model.model.forward_mtp = faulty_forward_mtp
    try:
        results = run_all(engine, reqs)
    finally:
        del model.model.forward_mtp
    assert results["r0"].error is not None and results["r0"].error.code == "integrity_abort"
    assert len(results["r0"].token_ids) < 12
    for rid in ("r1", "r2"):
        assert results[rid].error is None and results[rid].token_ids == plain[rid].token_ids
    assert engine.stats.tag_check_aborts == 1
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


def test_a_request_with_a_grammar_does_not_draft() -> None:
    """Grammar masks depend on the accepted text: such a request runs plain, beside drafting ones."""
    from tests.backend.engine.test_engine import EvenTokensOnly

    V = 16
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3
    engine = toy_engine(MarkovModel(target, target), 3)
    constraint = EvenTokensOnly()
    engine.add_request(request("c", [1], max_tokens=10, temperature=1.0, seed=3), constraint=constraint)
    engine.add_request(request("free", [1], max_tokens=9))
    results: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(results, engine.step())
    assert all(t % 2 == 0 for t in results["c"].token_ids) and constraint.accepted == results["c"].token_ids
    assert all(len(o.token_ids) == 1 for o in results["c"].outputs if o.token_ids)
    assert max(len(o.token_ids) for o in results["free"].outputs) == 4  # it drafted and accepted


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_under_preemption(loaded: dict[str, Any], arch: str) -> None:
    """A pool too small for every request's draft pages: drafts are skipped or requests preempted
    and recomputed; outputs stay the plain run's and no page leaks."""
    model = loaded[arch]
    ps = prompts(10, model.config.vocab_size, seed=5)
    reqs = [request(f"r{i}", p, max_tokens=24) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0, num_pages=40), reqs)
    engine = engine_for(model, 3, num_pages=16)
    OracleDrafts(engine, plain, p_wrong=0.3)
    spec = run_all(engine, reqs)
    assert engine.stats.preemptions > 0 and engine.stats.spec_accepted_tokens > 0
    for r in reqs:
        assert spec[r.request_id].token_ids == plain[r.request_id].token_ids, r.request_id
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prefix_cache_keeps_only_accepted_tokens(loaded: dict[str, Any], arch: str) -> None:
    """Pages cached by a speculative run (drafts often rejected) serve later prompts that extend
    its outputs: their continuations must equal a fresh engine's, which shares no page."""
    model = loaded[arch]
    ps = prompts(8, model.config.vocab_size, seed=9)
    first = [request(f"r{i}", p, max_tokens=20) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0), first)
    engine = engine_for(model, 3)
    OracleDrafts(engine, plain, p_wrong=0.5)
    assert {k: v.token_ids for k, v in run_all(engine, first).items()} == {
        k: v.token_ids for k, v in plain.items()
    }
    second = [request(f"s{i}", p + plain[f"r{i}"].token_ids, max_tokens=6) for i, p in enumerate(ps)]
    fresh = run_all(engine_for(model, 0, enable_prefix_cache=False), second)
    engine.spec.run = type(engine.spec).run.__get__(engine.spec)  # type: ignore[union-attr, method-assign]
    reused = run_all(engine, second)
    assert sum(r.num_cached_tokens for r in reused.values()) > 0
    for r in second:
        assert reused[r.request_id].token_ids == fresh[r.request_id].token_ids, r.request_id


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize("k", [1, 3])
def test_stops_inside_an_accepted_run(k: int) -> None:
    """A stop string, a stop token and max_tokens met in the middle of a step's accepted tokens:
    the tokens after it are dropped, as if it had been decoded one token at a time."""
    V = 16
    successor = torch.tensor([(5 * x + 3) % V for x in range(V)])  # one cycle through all 16 tokens
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    target[torch.arange(V), successor] += 6.0
    chain, x = [], 5
    for _ in range(12):
        x = int(target[x].argmax())
        chain.append(x)
    cases = {
        "string": dict(stop=[letters(chain[2:4])], max_tokens=12),
        "token": dict(stop_token_ids=[chain[6]], max_tokens=12),
        "length": dict(max_tokens=7),
    }
    for name, params in cases.items():
        want = run_all(toy_engine(MarkovModel(target, target), 0, letters), [request(name, [5], **params)])
        engine = toy_engine(MarkovModel(target, target), k, letters)
        got = run_all(engine, [request(name, [5], **params)])
        assert got[name].token_ids == want[name].token_ids, name
        assert got[name].finish_reason == want[name].finish_reason
        assert got[name].outputs[-1].num_output_tokens == len(want[name].token_ids)
        assert engine.stats.spec_accepted_tokens > 0
        assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize(("weights", "extra"), [("int4-g32", []), ("fp8-block", ["--all-linear"])])
def test_quantized_mtp_layers_load_and_decode_exactly(tmp_path: Path, weights: str, extra: list[str]) -> None:
    """`kumo quantize` treats the MTP layers like the others (INT4 routed experts, FP8 Linears);
    they load back through the same walker, and greedy speculation stays exact."""
    from backend.quant.experts import QuantExperts
    from backend.tools.quantize import main as quantize

    src = add_mtp_layers(make_tiny("glm_moe_dsa", tmp_path / "src"))
    dst = tmp_path / "dst"
    assert quantize([str(src), str(dst), "--weights", weights, *extra]) == 0
    model = load_model(dst, dtype=torch.float32, num_mtp_layers=1)
    assert isinstance(model.model.mtp[0].mlp.experts, QuantExperts)
    reqs = [request(f"r{i}", p, max_tokens=10) for i, p in enumerate(prompts(6, 256, seed=2))]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 2)
    OracleDrafts(engine, plain, p_wrong=0.3)
    spec = run_all(engine, reqs)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    assert engine.stats.spec_accepted_tokens > 0


def test_mtp_layers_are_loaded_only_when_asked(tmp_path: Path) -> None:
    from backend.errors import CheckpointError

    path = make_tiny("deepseek_v3", tmp_path / "plain")  # its config says 1 MTP layer; no tensors
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.3\."):
        load_model(path, dtype=torch.float32, num_mtp_layers=1)
    add_mtp_layers(path)
    without = load_model(path, dtype=torch.float32)
    assert without.model.num_mtp_layers == 0 and len(without.model.cache_specs()) == 3
    with_mtp = load_model(path, dtype=torch.float32, num_mtp_layers=1)
    assert len(with_mtp.model.cache_specs()) == 4  # the MTP layer's KV slot follows the model's
    exported = dict(with_mtp.model.export_weights())
    assert (
        "model.layers.3.eh_proj.weight" in exported
        and "model.layers.3.mlp.experts.7.down_proj.weight" in exported
    )


def test_stop_strings_without_an_engine_detokenizer_do_not_draft() -> None:
    """The serving layer matches stop strings then: it could cut the text inside an accepted run,
    not the tokens and usage, so such a request runs plain beside drafting ones."""
    V = 16
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3
    engine = toy_engine(MarkovModel(target, target), 2)
    engine.add_request(request("stops", [1], max_tokens=8, stop=["zz"]))
    engine.add_request(request("free", [1], max_tokens=8))
    results: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(results, engine.step())
    assert all(len(o.token_ids) <= 1 for o in results["stops"].outputs)
    assert results["stops"].token_ids == results["free"].token_ids
    assert max(len(o.token_ids) for o in results["free"].outputs) == 3


def assert_same_or_tied(got: Result, want: Result, rid: str) -> int:
    """Equal tokens, up to a first difference that must be a tie (top two log-probs within 1e-5
    in the plain run, the speculative run taking the other one); 1 if such a tie was met."""
    for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=False)):
        if a != b:
            top = want.logprobs[j].top
            assert abs(top[0].logprob - top[1].logprob) < 1e-5 and a in (top[0].token_id, top[1].token_id), (
                f"{rid}: token {j} differs ({a} vs {b}) without a tie"
            )
            return 1
    assert got.token_ids == want.token_ids, rid
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_over_a_thousand_prompts(loaded: dict[str, Any], arch: str) -> None:
    """512 prompts per architecture (1,024 in all), fp32, K = 3: half drafted by the random MTP
    layer (almost every draft rejected), half by oracle drafts (long accepted runs)."""
    model = loaded[arch]
    ps = prompts(512, model.config.vocab_size, seed=100)
    reqs = [
        request(f"r{i}", p, max_tokens=1 + i % 16, logprobs=True, top_logprobs=2) for i, p in enumerate(ps)
    ]
    plain: dict[str, Result] = {}
    for start in range(0, len(reqs), 64):
        plain |= run_all(engine_for(model, 0), reqs[start : start + 64])
    ties = 0
    for half, oracle in ((reqs[:256], False), (reqs[256:], True)):
        for start in range(0, len(half), 64):
            engine = engine_for(model, 3)
            if oracle:
                OracleDrafts(engine, plain, p_wrong=0.3, seed=start)
            spec = run_all(engine, half[start : start + 64])
            ties += sum(
                assert_same_or_tied(spec[r.request_id], plain[r.request_id], r.request_id)
                for r in half[start : start + 64]
            )
            assert engine.block_manager.num_available_pages == engine.block_manager.num_pages
    assert ties <= 2


def test_backend_settings_take_speculative() -> None:
    from backend.server.settings import build_settings

    env = {"KUMO_BACKEND_SECRET": "from-the-environment"}
    base = ["--model", "m", "--port", "1"]
    assert build_settings(base, env).speculative == 0
    assert build_settings([*base, "--speculative", "mtp:3"], env).speculative == 3
    assert build_settings([*base, "--speculative-max-seqs", "4"], env).speculative_max_seqs == 4
    assert build_settings(base, env).speculative_adaptive is True
    fixed = build_settings([*base, "--no-speculative-adaptive", "--speculative-saturation-rows", "128"], env)
    assert (fixed.speculative_adaptive, fixed.speculative_saturation_rows) == (False, 128)
    with pytest.raises(SystemExit):
        build_settings([*base, "--speculative", "mtp:9"], env)


def test_a_separately_shipped_draft_loads_like_one_in_the_checkpoint(tmp_path: Path) -> None:
    """Kimi K2 ships no MTP layer: its draft comes as a folder of the MTP tensors alone (under the
    checkpoint's names) with a config.json; it loads into the same modules, and decodes the same."""
    import json

    from safetensors.torch import load_file, save_file

    whole = add_mtp_layers(make_tiny("kimi_k2", tmp_path / "whole"))
    tensors = load_file(str(whole / "model.safetensors"))
    n = json.loads((whole / "config.json").read_text())["num_hidden_layers"]
    is_mtp = {k: k.startswith(f"model.layers.{n}.") for k in tensors}
    target = make_tiny("kimi_k2", tmp_path / "target", num_nextn_predict_layers=0)
    save_file({k: v for k, v in tensors.items() if not is_mtp[k]}, str(target / "model.safetensors"))
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file({k: v for k, v in tensors.items() if is_mtp[k]}, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 1}))

    shipped = load_model(whole, dtype=torch.float32, num_mtp_layers=1)
    apart = load_model(target, dtype=torch.float32, num_mtp_layers=1, draft=draft)
    want, got = shipped.model.state_dict(), apart.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    reqs = [request(f"r{i}", p, max_tokens=8) for i, p in enumerate(prompts(4, 256, seed=4))]
    a, b = run_all(engine_for(shipped, 2), reqs), run_all(engine_for(apart, 2), reqs)
    assert {k: v.token_ids for k, v in a.items()} == {k: v.token_ids for k, v in b.items()}
