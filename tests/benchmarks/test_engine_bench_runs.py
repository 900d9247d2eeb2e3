"""Offline runs: the figures follow from the step times (fake clock), random weights in every format."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.offline import run_offline
from benchmarks.engine.suite import ab_summary
from benchmarks.engine.weights import build_random_model
from schemas.backend import EngineOutput, EngineRequest


@dataclass
class _Stats:
    steps: int = 0
    computed_tokens: int = 0
    spec_verifies: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class FakeEngine:
    """Prefill of every request in the first step (0.5 s), then one token each per 0.1 s step."""

    t: float = 0.0
    emitted: dict[str, int] = field(default_factory=dict)
    requests: dict[str, EngineRequest] = field(default_factory=dict)
    stats: _Stats = field(default_factory=_Stats)

    def __post_init__(self) -> None:
        self.scheduler = type("S", (), {"num_preemptions": 0, "running": []})()
        self.runner = type("R", (), {"device": torch.device("cpu")})()

    def add_request(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = request
        self.emitted[request.request_id] = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineOutput]:
        prefill = self.stats.steps == 0
        self.t += 0.5 if prefill else 0.1
        self.stats.steps += 1
        self.stats.computed_tokens += (
            sum(len(r.prompt_token_ids) for r in self.requests.values()) if prefill else len(self.requests)
        )
        outs = []
        for rid, req in list(self.requests.items()):
            self.emitted[rid] += 1
            done = self.emitted[rid] == req.sampling.max_tokens
            outs.append(EngineOutput(request_id=rid, token_ids=[7], finish_reason="length" if done else None))
            if done:
                del self.requests[rid]
        return outs


def test_figures_follow_from_step_times() -> None:
    eng = FakeEngine()
    r = run_offline(
        eng, variant="v", concurrency=4, input_len=8, output_len=11, vocab_size=32, clock=lambda: eng.t
    )  # type: ignore[arg-type]
    assert r.finished == 4 and r.output_tokens == 44 and r.steps == 11
    assert r.ttft_ms_p50 == pytest.approx(500.0)
    assert r.tpot_ms_p50 == pytest.approx(100.0)
    assert r.output_tok_s_per_user == pytest.approx(10.0)
    assert r.wall_s == pytest.approx(1.5)
    assert r.output_tok_s == pytest.approx(44 / 1.5)
    # decode alone: the 10 steps after the prefill step, all at the full batch of 4
    assert r.extra["decode_steps"] == 10 and r.extra["decode_batch"] == 4
    assert r.extra["decode_step_ms_p50"] == pytest.approx(100.0)
    assert r.extra["decode_tok_s"] == pytest.approx(40.0)
    # the one step that carried prompt tokens: 4 prompts of 8, no decode rows beside them (no slope)
    assert r.extra["prefill_steps"] == 1 and r.extra["prefill_step_ms_p50"] == pytest.approx(500.0)
    assert r.extra["prefill_step_tokens_p50"] == 32 and "prefill_ms_per_decode_row" not in r.extra


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "int4-all", "fp8-all"])
def test_random_model_in_each_format_has_finite_weights_and_spread_routing(fmt: str) -> None:
    g = make_geometry("glm-5.2", 2, tiny=True)
    model = build_random_model(g, fmt, device="cpu", seed=3)  # type: ignore[arg-type]
    tensors = model.state_dict()
    assert all(torch.isfinite(t.float()).all() for n, t in tensors.items() if t.is_floating_point()), fmt
    if fmt.startswith("int4"):
        packed = next(t for n, t in tensors.items() if n.endswith("gate_up_packed"))
        nibbles = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)]).flatten()
        counts = torch.bincount(nibbles, minlength=16).float()
        assert counts.min() > 0.8 * counts.mean()  # every INT4 value, near uniformly
    router = model.model.layers[1].mlp.gate
    x = torch.randn(4096, g.model_config.hidden_size)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    _, ids = router(x)
    load = torch.bincount(ids.flatten(), minlength=g.model_config.num_routed_experts).float()
    assert load.max() / load.mean() < 1.5  # random routing is near uniform


def test_two_seeds_give_different_weights() -> None:
    g = make_geometry("kimi-k2.6", 2, tiny=True)
    a = build_random_model(g, "int4", device="cpu", seed=0).state_dict()
    b = build_random_model(g, "int4", device="cpu", seed=1).state_dict()
    name = next(n for n in a if n.endswith("down_packed"))
    assert not torch.equal(a[name], b[name])


def test_integrity_overhead_is_the_median_of_paired_rounds() -> None:
    """Drift that slows both runs of a round cancels in the paired difference; the median resists
    the one noisy round."""
    tpot = [(10.5, 10.0), (21.0, 20.0), (15.0, 10.0), (31.5, 30.0), (None, 9.0)]  # (on, off) per round
    rounds = [
        {s: {"tpot_ms_p50": t, "output_tok_s": 1.0} for s, t in zip(("on", "off"), pair, strict=True)}
        for pair in tpot
    ]
    out = ab_summary(rounds)
    assert out["overhead_per_round"] == pytest.approx([0.05, 0.05, 0.5, 0.05])
    assert out["overhead"] == pytest.approx(0.05)
    assert (out["overhead_min"], out["overhead_max"]) == pytest.approx((0.05, 0.5))
    assert out["on"]["n"] == 4 and out["off"]["n"] == 5 and out["off"]["tpot_ms_median"] == 10.0
    assert len(out["samples"]["on"]) == 5


def test_the_prefill_summary_finds_the_cost_of_each_decode_row() -> None:
    """Steps with a full chunk cost 40 ms plus 2 ms per decode row beside it; the last, short chunk is
    left out of the fit."""
    from benchmarks.engine.offline import _prefill_summary

    steps = [(40.0 + 2.0 * rows, 2048, rows) for rows in range(0, 64, 3)] + [(5.0, 300, 63)]
    out = _prefill_summary(steps)
    assert out["prefill_steps"] == len(steps)
    assert out["prefill_ms_per_decode_row"] == pytest.approx(2.0)
    assert out["prefill_ms_at_no_decode_rows"] == pytest.approx(40.0)
    assert _prefill_summary([]) == {"prefill_steps": 0}
