"""Shared layers against transformers' own modules: noaux_tc routing and RoPE / YaRN frequencies."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from backend.models.layers.moe import Router
from backend.models.layers.rotary import Rotary, inv_freq_and_factor
from backend.models.model_config import ModelConfig, RopeConfig
from tests.backend.tiny_checkpoints import config_dict


def _configs(**overrides: object) -> tuple[DeepseekV3Config, ModelConfig]:
    cfg = config_dict("deepseek_v3", **overrides)
    hf = DeepseekV3Config(**cfg)
    ours = ModelConfig.from_dict(hf.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]})
    return hf, ours


@pytest.mark.parametrize(
    ("n_group", "topk_group", "norm_topk_prob"), [(4, 2, True), (4, 1, False), (1, 1, True), (8, 3, True)]
)
def test_router_matches_transformers(n_group: int, topk_group: int, norm_topk_prob: bool) -> None:
    hf_cfg, cfg = _configs(
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        num_experts_per_tok=3,
        n_routed_experts=32,
    )
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(hf_cfg)
    ref.weight.data.normal_(0, 0.1)
    ref.e_score_correction_bias.normal_(0, 0.3)  # large enough to change which experts are picked
    ours = Router(cfg)
    ours.weight.copy_(ref.weight.data)
    ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(200, cfg.hidden_size)
    _, ref_w, ref_ids = ref(x)
    w, ids = ours(x)
    order_ref, order = ref_ids.sort(-1), ids.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    torch.testing.assert_close(
        w.gather(1, order.indices), ref_w.gather(1, order_ref.indices), atol=1e-6, rtol=1e-6
    )
    # the bias only picks: weights are the unbiased sigmoid scores of the picked experts
    scores = torch.sigmoid(x @ ref.weight.data.T).gather(1, ids)
    expected = scores / scores.sum(-1, keepdim=True) if norm_topk_prob else scores
    torch.testing.assert_close(w, expected * cfg.routed_scaling_factor, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="default", rope_theta=10000.0),
        dict(rope_type="yarn", rope_theta=50000.0, factor=64.0, original_max_position_embeddings=32,
             beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707, truncate=False),
        dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16),
        dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    ],
)  # fmt: skip
def test_rope_frequencies_match_transformers(rope: dict[str, object]) -> None:
    hf, ours = _configs(rope_parameters=dict(rope))
    inv_freq, factor = inv_freq_and_factor(ours.rope)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS.get(str(rope["rope_type"]), _default)(hf)
    torch.testing.assert_close(inv_freq, ref_inv_freq, atol=0, rtol=1e-6)
    assert factor == pytest.approx(ref_factor)


def _default(config: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    dim, base = config.qk_rope_head_dim, config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


@pytest.mark.parametrize(
    "rope",
    [
        RopeConfig("default", 10000.0, 64, True),
        RopeConfig(
            "yarn",
            50000.0,
            64,
            True,
            factor=32.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=0.5,
        ),
    ],
    ids=["default", "yarn"],
)
def test_a_prepared_cos_sin_table_gives_the_computed_values(rope: RopeConfig) -> None:
    """`Rotary.prepare_table` (one gather a forward on CUDA, where computing is six launches): the
    same cos and sin as computing them, as unit-stride rows the rope kernels take; a wider table is
    made anew while the narrower one stays alive (a captured graph may read it)."""
    rotary = Rotary(rope)
    positions = torch.tensor([0, 1, 7, 4095, 4096, 99, 5])
    want = rotary.cos_sin(positions, torch.bfloat16)
    rotary.prepare_table(100, torch.bfloat16, "cpu")
    rotary.prepare_table(4097, torch.bfloat16, "cpu")
    rotary.prepare_table(50, torch.bfloat16, "cpu")  # narrower: the widest stands
    tables = rotary._tables[(torch.bfloat16, torch.device("cpu"))]
    assert [t.shape for t in tables] == [(100, 2, 32), (4097, 2, 32)]
    got = rotary.cos_sin(positions, torch.bfloat16)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride(1) == 1
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # another dtype has no table: computed
    assert rotary.cos_sin(positions, torch.float32)[0].is_contiguous()


@pytest.mark.gpu
def test_the_cuda_table_is_bit_for_bit_the_computed_cos_sin() -> None:
    """On CUDA (where runners use it) the gathered values are the computed ones exactly: the same
    elementwise kernels over the same float32 inputs, whatever the tensor's shape."""
    rope = RopeConfig("yarn", 50000.0, 64, True, factor=32.0, original_max_position_embeddings=4096)
    rotary = Rotary(rope)
    positions = torch.randint(0, 70_000, (513,), device="cuda")
    want = rotary.cos_sin(positions, torch.bfloat16)
    rotary.prepare_table(70_000, torch.bfloat16, "cuda")
    got = rotary.cos_sin(positions, torch.bfloat16)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
