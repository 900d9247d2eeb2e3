"""The benchmark geometry: published per-layer shapes, truncated depth, KV pool as `kumo plan` sizes it."""

from __future__ import annotations

import json

import pytest

from backend.tools.plan import GB, make_plan
from benchmarks.engine.geometry import FULL_TP, H200_MEM, PUBLISHED_CONFIGS, make_geometry
from benchmarks.engine.weights import planned_weight_bytes

H200_USABLE = 139 * 2**30  # what the device reports


def _published_text(kind: str) -> dict:
    raw = json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text())
    return raw.get("text_config", raw)


@pytest.mark.parametrize("kind", ["glm-5.2", "kimi-k2.6"])
def test_truncated_model_keeps_published_per_layer_shapes(kind: str) -> None:
    g = make_geometry(kind, 4)
    published = _published_text(kind)
    config = g.model_config
    for key in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
                "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "num_attention_heads"):  # fmt: skip
        assert g.text[key] == published[key], key
    assert config.num_hidden_layers == 4 and config.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert g.full_num_layers == published["num_hidden_layers"]
    assert "near uniform" in g.describe()["routing"]


@pytest.mark.parametrize(
    ("kind", "fmt", "plan_weights", "kv"),
    [
        ("glm-5.2", "int4", "int4-g32", "bf16"),
        ("glm-5.2", "fp8", "fp8-block", "bf16"),
        ("glm-5.2", "int4", "int4-g32", "fp8"),
        ("kimi-k2.6", "int4", "int4-g32", "bf16"),
        ("kimi-k2.6", "int4", "int4-g32", "fp8"),
    ],
)
def test_kv_pool_is_what_kumo_plan_gives_the_full_model_per_gpu(
    kind: str, fmt: str, plan_weights: str, kv: str
) -> None:
    g = make_geometry(kind, 4)
    sizing = g.kv_sizing(fmt, kv)  # type: ignore[arg-type]
    config = json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text())
    plan = make_plan(config, gpu_mem=141 * GB, tp=8, weights=plan_weights, kv_dtype=kv)  # type: ignore[arg-type]
    assert (sizing.gpu_mem, sizing.tp) == (H200_MEM, FULL_TP)
    assert sizing.kv_tokens == plan.kv_tokens > 0
    assert sizing.num_pages == plan.kv_tokens // 16
    assert sizing.plan_weights_per_gpu == plan.weights_per_gpu
    # FP8 KV doubles the tokens of the same pool (the comparison's point)
    if kv == "fp8":
        assert sizing.kv_tokens >= 2 * g.kv_sizing(fmt, "bf16").kv_tokens - 16  # type: ignore[arg-type]
    assert sizing.max_concurrency(2048 + 256) == sizing.num_pages // (2304 // 16)


def test_formats_that_do_not_fit_8_gpus_get_the_pool_of_one_that_does() -> None:
    kimi = make_geometry("kimi-k2.6", 4)
    assert kimi.kv_sizing("bf16", "bf16").plan_weights == "int4-g32"
    assert kimi.kv_sizing("fp8", "bf16").plan_weights == "int4-g32"
    assert make_geometry("glm-5.2", 4).kv_sizing("bf16", "bf16").plan_weights == "fp8-block"


@pytest.mark.parametrize("kind", ["glm-5.2", "kimi-k2.6"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "int4-all", "fp8-all"])
def test_default_depth_fits_one_h200_in_every_variant(kind: str, fmt: str) -> None:
    g = make_geometry(kind, 4)
    kv = g.kv_sizing(fmt, "bf16")  # type: ignore[arg-type]
    per_token_layer = kv.plan_kv_bytes_per_token // g.full_num_layers
    total = planned_weight_bytes(g, fmt) + kv.num_pages * kv.page_size * per_token_layer * g.num_layers  # type: ignore[arg-type]
    assert total < 0.85 * H200_USABLE, f"{total / 2**30:.1f} GiB"
