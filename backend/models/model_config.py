"""ModelConfig: what a checkpoint's config.json (and generation_config.json) says about its text model.

Read once by the loader; everything the layers need comes from here, nothing is hard-coded per model.
Config keys are accepted as real checkpoints write them (`rope_scaling`, `rope_theta`,
`partial_rotary_factor` at the top level) and as current transformers writes them (`rope_parameters`
holding all of those). Kimi K2.5 / K2.6 nest the text model under `text_config`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import CheckpointError

# architecture name → the family its text model belongs to
FAMILIES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "mla",
    "KimiK25ForConditionalGeneration": "mla",
    "Kimi_K25ForConditionalGeneration": "mla",
    "GlmMoeDsaForCausalLM": "mla_dsa",
    "Glm4MoeForCausalLM": "gqa",
}
NESTED_ARCHITECTURES = {"KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters; `dim` is the number of rotated dims of one head."""

    rope_type: str  # "default" | "yarn" | "linear"
    theta: float
    dim: int
    is_interleaved: bool  # DeepSeek MLA pairs (x0, x1), (x2, x3)…; NeoX halves otherwise
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # GQA head dim; for MLA the qk head dim (nope + rope)
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    # MoE
    num_routed_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    # GQA
    attention_bias: bool = False
    use_qk_norm: bool = False
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DSA indexer (GLM-5)
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_types: tuple[str, ...] = ()  # "full" | "shared" per layer
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    weight_prefix: str = ""  # stripped from checkpoint names ("language_model." for K2.5)
    # multi-token-prediction layers stored after the last layer (DeepSeek-V3 layout; backend/models/mtp.py)
    num_nextn_predict_layers: int = 0

    @property
    def family(self) -> str:
        return FAMILIES[self.architecture]

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale; MLA with YaRN multiplies by mscale(factor, mscale_all_dim)²."""
        scale: float = self.head_dim**-0.5
        r = self.rope
        if self.family != "gqa" and r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        raw = _read_json(path / "config.json")
        generation = (
            _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
        )
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise CheckpointError("config.json names no architecture")
        architecture = architectures[0]
        if architecture not in FAMILIES:
            raise CheckpointError(f"unknown architecture {architecture!r}; supported: {sorted(FAMILIES)}")
        text = raw
        prefix = ""
        if architecture in NESTED_ARCHITECTURES:
            if "text_config" not in raw:
                raise CheckpointError(f"{architecture} config.json has no text_config")
            text = raw["text_config"]
            prefix = "language_model."
        family = FAMILIES[architecture]
        get = _Getter(text)
        num_layers = get.req("num_hidden_layers", int)
        num_heads = get.req("num_attention_heads", int)
        hidden = get.req("hidden_size", int)
        mla = family != "gqa"
        if mla:
            nope, rope_dim = get.req("qk_nope_head_dim", int), get.req("qk_rope_head_dim", int)
            head_dim, rotary_dim = nope + rope_dim, rope_dim
        else:
            head_dim = get.opt("head_dim", int, hidden // num_heads)
            default_partial = 0.5 if text.get("model_type") == "glm4_moe" else 1.0
            partial = _rope_dict(text).get("partial_rotary_factor", text.get("partial_rotary_factor"))
            rotary_dim = int(head_dim * (default_partial if partial is None else float(partial)))
        first_dense = get.opt("first_k_dense_replace", int, 0)
        moe_freq = get.opt("moe_layer_freq", int, 1)
        mlp_types = text.get("mlp_layer_types") or [
            "sparse" if i >= first_dense and i % moe_freq == 0 else "dense" for i in range(num_layers)
        ]
        scoring, topk_method = text.get("scoring_func", "sigmoid"), text.get("topk_method", "noaux_tc")
        if scoring != "sigmoid" or topk_method != "noaux_tc":
            raise CheckpointError(
                f"unsupported routing scoring_func={scoring!r} topk_method={topk_method!r} (only sigmoid noaux_tc)"
            )
        eos = (generation or {}).get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            architecture=architecture,
            model_type=str(text.get("model_type", "")),
            vocab_size=get.req("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=get.req("intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=get.opt("num_key_value_heads", int, num_heads) if not mla else num_heads,
            head_dim=head_dim,
            rms_norm_eps=get.opt("rms_norm_eps", float, 1e-6),
            hidden_act=get.opt("hidden_act", str, "silu"),
            max_position_embeddings=get.req("max_position_embeddings", int),
            tie_word_embeddings=bool(tie),
            rope=_rope_config(
                text, rotary_dim, is_interleaved=mla and bool(text.get("rope_interleave", True))
            ),
            num_routed_experts=get.req("n_routed_experts", int),
            num_experts_per_tok=get.req("num_experts_per_tok", int),
            num_shared_experts=get.opt("n_shared_experts", int, 0),
            moe_intermediate_size=get.req("moe_intermediate_size", int),
            n_group=get.opt("n_group", int, 1),
            topk_group=get.opt("topk_group", int, 1),
            norm_topk_prob=get.opt("norm_topk_prob", bool, True),
            routed_scaling_factor=get.opt("routed_scaling_factor", float, 1.0),
            mlp_layer_types=tuple(mlp_types),
            attention_bias=get.opt("attention_bias", bool, False),
            use_qk_norm=get.opt("use_qk_norm", bool, False),
            q_lora_rank=text.get("q_lora_rank") if mla else None,
            kv_lora_rank=get.req("kv_lora_rank", int) if mla else 0,
            qk_nope_head_dim=get.req("qk_nope_head_dim", int) if mla else 0,
            qk_rope_head_dim=get.req("qk_rope_head_dim", int) if mla else 0,
            v_head_dim=get.req("v_head_dim", int) if mla else 0,
            index_topk=get.req("index_topk", int) if family == "mla_dsa" else 0,
            index_head_dim=get.req("index_head_dim", int) if family == "mla_dsa" else 0,
            index_n_heads=get.req("index_n_heads", int) if family == "mla_dsa" else 0,
            indexer_types=_indexer_types(text, num_layers) if family == "mla_dsa" else (),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            weight_prefix=prefix,
            num_nextn_predict_layers=get.opt("num_nextn_predict_layers", int, 0),
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class _Getter:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw

    def req(self, key: str, kind: type) -> Any:
        if self.raw.get(key) is None:
            raise CheckpointError(f"config.json lacks required key {key!r}")
        return kind(self.raw[key])

    def opt(self, key: str, kind: type, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else kind(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads(path.read_text())
        return config
    except FileNotFoundError as exc:
        raise CheckpointError(f"missing {path.name} in {path.parent}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _rope_dict(text: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters` (transformers ≥ 5) or `rope_scaling` (checkpoints as published)."""
    return dict(text.get("rope_parameters") or text.get("rope_scaling") or {})


def _rope_config(text: dict[str, Any], dim: int, *, is_interleaved: bool) -> RopeConfig:
    rp = _rope_dict(text)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "yarn", "linear"):
        raise CheckpointError(f"unsupported rope type {rope_type!r}")
    theta = float(rp.get("rope_theta", text.get("rope_theta", 10000.0)))
    max_pos = int(text["max_position_embeddings"])
    original = int(rp.get("original_max_position_embeddings") or max_pos)
    factor = rp.get("factor")
    factor = float(factor) if factor is not None else (max_pos / original if rope_type == "yarn" else 1.0)

    def num(key: str) -> float | None:
        return None if rp.get(key) is None else float(rp[key])

    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        dim=dim,
        is_interleaved=is_interleaved,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=num("beta_fast") or 32.0,
        beta_slow=num("beta_slow") or 1.0,
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        attention_factor=num("attention_factor"),
        truncate=bool(rp.get("truncate", True)),
    )


def _indexer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per-layer DSA indexer mode, as GLM-5 configs give it (explicitly or as a pattern/frequency)."""
    if text.get("indexer_types"):
        return tuple(text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return (
            tuple({"F": "full", "S": "shared"}[c] for c in pattern)
            if isinstance(pattern, str)
            else tuple(pattern)
        )
    freq = max(int(text.get("index_topk_freq", 1)), 1)
    offset = int(text.get("index_skip_topk_offset", 2))
    return tuple("full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers))
