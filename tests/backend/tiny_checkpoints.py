"""Tiny random checkpoints written by transformers' own classes (`save_pretrained`), for conformance.

Importable helpers, no pytest fixtures: other test areas reuse them.

    make_tiny(arch, path, **config_overrides) -> Path     # arch in ARCHS
    load_reference(arch, path) -> transformers model     # float32, eager attention, eval mode

The GLM-5 reference picks its indexer's top-k as a stable sort (equal scores: the earlier token);
transformers as released leaves ties to `torch.topk`, which is not causal (`earlier_on_ties`).

Shapes are tiny (hidden 64, 3 layers, 8 experts) but exercise what is easy to get wrong: group-limited
routing (`n_group > 1`), a non-zero selection bias, non-trivial norm weights and biases, YaRN with a
short `original_max_position_embeddings` (32) and mscale ≠ mscale_all_dim, v_head_dim ≠ nope dim,
DSA with a small `index_topk` and a shared indexer layer, GQA with qk-norm, biases and partial RoPE.
`kimi_k2` is written in the published config format (`model_type: kimi_k2`, `rope_scaling`,
top-level `rope_theta`); `kimi_k25` is the nested K2.5 layout (`text_config`, `language_model.` prefix,
vision tower beside it), with the tensor names real K2.5 checkpoints use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

ARCHS = ("deepseek_v3", "kimi_k2", "kimi_k25", "glm_moe_dsa", "glm4_moe")
EOS_IDS = [1, 2]

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=128,  # = factor 4 × YaRN's original 32
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
_MLA: dict[str, Any] = dict(
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24
)
_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    beta_fast=32.0,
    beta_slow=1.0,
)


def config_dict(arch: str, **overrides: Any) -> dict[str, Any]:
    """The transformers config kwargs `make_tiny` uses for `arch` (text model only for kimi_k25)."""
    if arch == "deepseek_v3":
        base = dict(
            _COMMON,
            **_MLA,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=0.8),
        )
    elif arch in ("kimi_k2", "kimi_k25"):
        base = dict(
            _COMMON,
            **_MLA,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            rope_parameters=dict(_YARN, rope_theta=50000.0, mscale=1.0, mscale_all_dim=1.0),
        )
    elif arch == "glm_moe_dsa":
        base = dict(
            _COMMON,
            **_MLA,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            rms_norm_eps=1e-5,
            index_topk=8,
            index_head_dim=16,
            index_n_heads=8,
            indexer_types=["full", "shared", "full"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
    elif arch == "glm4_moe":
        base = dict(
            _COMMON,
            num_key_value_heads=2,
            head_dim=24,
            attention_bias=True,
            use_qk_norm=True,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; one of {ARCHS}")
    base.update(overrides)
    if arch != "glm4_moe":  # MLA: transformers' eager path repeats "kv heads"; one per query head
        base["num_key_value_heads"] = base["num_attention_heads"]
    return base


def _build(arch: str, cfg: dict[str, Any]) -> torch.nn.Module:
    import transformers as tf

    if arch in ("deepseek_v3", "kimi_k2"):
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**cfg))
    if arch == "glm_moe_dsa":
        return tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**cfg))
    if arch == "glm4_moe":
        return tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(**cfg))
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(cfg, model_type="kimi_k2")
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config = Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=32, tie_word_embeddings=False
    )
    return Kimi_K25ForConditionalGeneration(config)


def _perturb(model: torch.nn.Module) -> None:
    """Make the defaults that hide bugs non-trivial: norm weights ≠ 1, biases ≠ 0, selection bias ≠ 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ("norm" in name and name.endswith("weight")):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)


def make_tiny(
    arch: str, path: str | Path, *, seed: int = 0, as_published: bool = True, **config_overrides: Any
) -> Path:
    """Write a tiny random `arch` checkpoint folder at `path` with transformers' `save_pretrained`.

    `as_published=False` keeps exactly what transformers wrote (no kimi_k2 / K2.5 renaming).
    """
    path = Path(path)
    torch.manual_seed(seed)
    model = _build(arch, config_dict(arch, **config_overrides)).float().eval()
    _perturb(model)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": EOS_IDS}))
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    if arch == "kimi_k2" and as_published:
        raw = _published_rope(raw) | {"model_type": "kimi_k2"}
    if arch == "kimi_k25" and as_published:
        raw["architectures"] = ["KimiK25ForConditionalGeneration"]
        raw["text_config"] = _published_rope(raw["text_config"]) | {"model_type": "kimi_k2"}
        _rename_k25_tensors(path)
    config_file.write_text(json.dumps(raw, indent=2))
    return path


def _published_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Rewrite transformers' `rope_parameters` the way published checkpoints write it."""
    raw = dict(raw)
    rp = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    raw["rope_scaling"] = rp
    return raw


def _rename_k25_tensors(path: Path) -> None:
    """Real K2.5 names: `language_model.model.layers.*` (transformers 5 writes `...model.blocks.*` back)."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    renamed = {
        k.replace("language_model.model.blocks.", "language_model.model.layers."): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(file), metadata={"format": "pt"})


def load_reference(arch: str, path: str | Path, *, as_released: bool = False) -> torch.nn.Module:
    """The transformers model of a `make_tiny` folder, float32, eager attention, eval mode.

    GLM-5's indexers choose with `earlier_on_ties` unless `as_released`.
    """
    import transformers as tf

    cls: Any
    if arch in ("deepseek_v3", "kimi_k2"):
        cls = tf.DeepseekV3ForCausalLM
    elif arch == "glm_moe_dsa":
        cls = tf.GlmMoeDsaForCausalLM
    elif arch == "glm4_moe":
        cls = tf.Glm4MoeForCausalLM
    else:
        from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration as cls
    kwargs: dict[str, Any] = {}
    if arch == "kimi_k2":
        # transformers keys its per-expert → fused conversion on model_type; kimi_k2 is deepseek_v3's graph
        config = tf.DeepseekV3Config.from_pretrained(str(path))
        config.model_type = "deepseek_v3"
        kwargs["config"] = config
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
    if arch == "glm_moe_dsa" and not as_released:
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                earlier_on_ties(layer.self_attn.indexer)
    return model


class _StableTopk(TorchFunctionMode):
    """`Tensor.topk` as a stable descending sort: among equal values the lower index comes first."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.Tensor.topk:
            return func(*args, **kwargs)
        x, k = args[0], args[1]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def earlier_on_ties(indexer: torch.nn.Module) -> None:
    """Make a transformers `GlmMoeDsaIndexer` give equal scores to the earlier token.

    As released it takes `index_scores.topk(k)` over its row (the query's keys, then every later
    token masked), and `torch.topk`'s pick among equal scores changes with the row's length: a
    token's output changes when tokens are appended after it (`test_glm_moe_dsa_ties`). Ties are
    frequent: a key that every head's ReLU zeroes scores exactly 0. The rest of its forward is kept.
    """
    forward = indexer.forward

    def stable_forward(*args: Any, **kwargs: Any) -> Any:
        with _StableTopk():
            return forward(*args, **kwargs)

    indexer.forward = stable_forward  # type: ignore[method-assign]


def add_mtp_layers(path: str | Path, *, num_layers: int = 1, seed: int = 0) -> Path:
    """Give a `make_tiny` folder (not kimi_k25) MTP layers in DeepSeek-V3's published layout.

    transformers writes none (it drops `model.layers.{num_hidden_layers + i}.*` when loading), so
    they are made here: the decoder block a perturbed copy of the last layer's (a MoE layer, as
    published), `enorm` / `hnorm` / `shared_head.norm` around 1, `eh_proj [H, 2H]` random, and the
    layer's own copies of the embedding and lm_head, as DeepSeek-V3 ships them.
    """
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    n, H = raw["num_hidden_layers"], raw["hidden_size"]
    last = f"model.layers.{n - 1}."
    for i in range(num_layers):
        mtp = f"model.layers.{n + i}."
        for name, t in list(tensors.items()):
            if name.startswith(last):
                noise = torch.randn(t.shape, generator=g) * 0.02 if t.is_floating_point() else 0
                tensors[mtp + name[len(last) :]] = (t + noise).contiguous()
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{mtp}{norm}.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        tensors[f"{mtp}eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * (2 * H) ** -0.5
        tensors[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{mtp}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw["num_nextn_predict_layers"] = num_layers
    config_file.write_text(json.dumps(raw, indent=2))
    return path
