"""Every tensor of a checkpoint, by name and shape, from config.json alone.

`kumo plan` sizes a deployment from these without any weights, and `kumo quantize` labels its size
report with `tensor_class`. Names are the Hugging Face checkpoint names of the DeepSeek-V3 family
(Kimi K2 / K2.5 / K2.6, GLM-5 with its DSA indexer) and of GLM-4.5 (GQA), as in engine-anchors §1e:
`model.layers.{L}.self_attn.*`, `.mlp.experts.{E}.{gate,up,down}_proj`, `.mlp.shared_experts.*`,
`.mlp.gate` (router) with its fp32 `e_score_correction_bias`; the multimodal K2.5 layout nests the
text model under `language_model.` and adds `vision_tower.*` / `mm_projector.*`. Multi-token
prediction layers (`num_nextn_predict_layers`) follow the last layer, as the checkpoints store them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BF16, FP32 = 2, 4
TEXT_PREFIX = "language_model."  # the K2.5 multimodal layout's text model; the loader strips it


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype_bytes: int = BF16
    is_linear: bool = False  # a Linear's 2-D weight: the only kind a QuantScheme may quantize

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def served_module(self) -> str:
        """The module's name in the served model, which a checkpoint's `ignore` list is matched on."""
        return self.module.removeprefix(TEXT_PREFIX)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's block: K2.5/K2.6 keep it under `text_config`."""
    block: dict[str, Any] = config.get("text_config", config)
    return block


def is_mla(tc: dict[str, Any]) -> bool:
    return tc.get("kv_lora_rank") is not None


def has_indexer(tc: dict[str, Any]) -> bool:
    return tc.get("index_n_heads") is not None


def _linear(
    specs: list[TensorSpec], name: str, out_f: int, in_f: int, bias: bool = False, is_linear: bool = True
) -> None:
    specs.append(TensorSpec(f"{name}.weight", (out_f, in_f), is_linear=is_linear))
    if bias:
        specs.append(TensorSpec(f"{name}.bias", (out_f,)))


def _norm(specs: list[TensorSpec], name: str, dim: int, bias: bool = False) -> None:
    specs.append(TensorSpec(f"{name}.weight", (dim,)))
    if bias:
        specs.append(TensorSpec(f"{name}.bias", (dim,)))


def has_own_indexer(tc: dict[str, Any], layer: int) -> bool:
    """GLM-5's DSA: a layer whose `indexer_types` entry is "shared" reuses another layer's indexer."""
    types = tc.get("indexer_types") or []
    return has_indexer(tc) and (layer >= len(types) or types[layer] != "shared")


def _attention(specs: list[TensorSpec], p: str, tc: dict[str, Any], layer: int) -> None:
    h, heads = tc["hidden_size"], tc["num_attention_heads"]
    if is_mla(tc):
        nope, rope, v, kv = (
            tc["qk_nope_head_dim"],
            tc["qk_rope_head_dim"],
            tc["v_head_dim"],
            tc["kv_lora_rank"],
        )
        q_lora = tc.get("q_lora_rank")
        if q_lora:
            _linear(specs, f"{p}.q_a_proj", q_lora, h)
            _norm(specs, f"{p}.q_a_layernorm", q_lora)
            _linear(specs, f"{p}.q_b_proj", heads * (nope + rope), q_lora)
        else:
            _linear(specs, f"{p}.q_proj", heads * (nope + rope), h)
        _linear(specs, f"{p}.kv_a_proj_with_mqa", kv + rope, h)
        _norm(specs, f"{p}.kv_a_layernorm", kv)
        _linear(specs, f"{p}.kv_b_proj", heads * (nope + v), kv)
        _linear(specs, f"{p}.o_proj", h, heads * v)
        if has_own_indexer(tc, layer):
            ih, idim = tc["index_n_heads"], tc["index_head_dim"]
            _linear(specs, f"{p}.indexer.wq_b", ih * idim, tc["q_lora_rank"])  # DSA has a q LoRA
            _linear(specs, f"{p}.indexer.wk", idim, h)
            _norm(specs, f"{p}.indexer.k_norm", idim, bias=True)
            _linear(specs, f"{p}.indexer.weights_proj", ih, h)
        return
    hd = tc.get("head_dim") or h // heads
    kvh, bias = tc["num_key_value_heads"], bool(tc.get("attention_bias"))
    _linear(specs, f"{p}.q_proj", heads * hd, h, bias)
    _linear(specs, f"{p}.k_proj", kvh * hd, h, bias)
    _linear(specs, f"{p}.v_proj", kvh * hd, h, bias)
    _linear(specs, f"{p}.o_proj", h, heads * hd)
    if tc.get("use_qk_norm"):
        _norm(specs, f"{p}.q_norm", hd)
        _norm(specs, f"{p}.k_norm", hd)


def _mlp(specs: list[TensorSpec], p: str, h: int, inter: int) -> None:
    _linear(specs, f"{p}.gate_proj", inter, h)
    _linear(specs, f"{p}.up_proj", inter, h)
    _linear(specs, f"{p}.down_proj", h, inter)


def _layer(specs: list[TensorSpec], p: str, idx: int, tc: dict[str, Any]) -> None:
    h = tc["hidden_size"]
    _norm(specs, f"{p}.input_layernorm", h)
    _norm(specs, f"{p}.post_attention_layernorm", h)
    _attention(specs, f"{p}.self_attn", tc, idx)
    if idx < tc.get("first_k_dense_replace", 0) or not tc.get("n_routed_experts"):
        _mlp(specs, f"{p}.mlp", h, tc["intermediate_size"])
        return
    num_experts, inter = tc["n_routed_experts"], tc["moe_intermediate_size"]
    # the router is no Linear (Moonshot's MoEGate, Kumo's Router): a `Linear` target never takes it
    _linear(specs, f"{p}.mlp.gate", num_experts, h, is_linear=False)
    specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (num_experts,), FP32))
    for e in range(num_experts):
        _mlp(specs, f"{p}.mlp.experts.{e}", h, inter)
    if tc.get("n_shared_experts"):
        _mlp(specs, f"{p}.mlp.shared_experts", h, inter * tc["n_shared_experts"])


def _vision(specs: list[TensorSpec], vc: dict[str, Any], text_hidden: int) -> None:
    """MoonViT as the K2.5 checkpoints lay it out (patch conv, 2-D position table, blocks, merger)."""
    d, mlp, p = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    specs.append(TensorSpec("vision_tower.patch_embed.proj.weight", (d, 3, p, p)))
    specs.append(TensorSpec("vision_tower.patch_embed.proj.bias", (d,)))
    specs.append(
        TensorSpec("vision_tower.patch_embed.pos_emb.weight", (vc["pos_emb_height"], vc["pos_emb_width"], d))
    )
    for i in range(vc["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}"
        _norm(specs, f"{b}.norm0", d, bias=True)
        _norm(specs, f"{b}.norm1", d, bias=True)
        _linear(specs, f"{b}.wqkv", 3 * d, d, bias=True)
        _linear(specs, f"{b}.wo", d, d, bias=True)
        _linear(specs, f"{b}.mlp.fc0", mlp, d, bias=True)
        _linear(specs, f"{b}.mlp.fc1", d, mlp, bias=True)
    _norm(specs, "vision_tower.encoder.final_layernorm", d, bias=True)
    kh, kw = vc.get("merge_kernel_size", [2, 2])
    merged = vc.get("projection_hidden_size", d) * kh * kw
    _norm(specs, "mm_projector.pre_norm", vc.get("projection_hidden_size", d), bias=True)
    _linear(specs, "mm_projector.proj.0", merged, merged, bias=True)
    _linear(specs, "mm_projector.proj.2", text_hidden, merged, bias=True)


def checkpoint_tensors(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor the checkpoint of `config` holds, unquantized (BF16; fp32 router biases)."""
    tc = text_config(config)
    prefix = TEXT_PREFIX if "text_config" in config else ""
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    specs: list[TensorSpec] = [TensorSpec(f"{prefix}model.embed_tokens.weight", (vocab, h))]
    num_layers = tc["num_hidden_layers"]
    for idx in range(num_layers + tc.get("num_nextn_predict_layers", 0)):
        p = f"{prefix}model.layers.{idx}"
        _layer(specs, p, idx, tc)
        if idx >= num_layers:  # MTP: its own embedding, projection and head, as DeepSeek-V3 stores them
            for n in ("enorm", "hnorm", "shared_head.norm"):
                _norm(specs, f"{p}.{n}", h)
            _linear(specs, f"{p}.eh_proj", h, 2 * h)
            specs.append(TensorSpec(f"{p}.embed_tokens.weight", (vocab, h)))
            _linear(specs, f"{p}.shared_head.head", vocab, h)
    _norm(specs, f"{prefix}model.norm", h)
    if not tc.get("tie_word_embeddings", False):
        _linear(specs, f"{prefix}lm_head", vocab, h)
    if "vision_config" in config:
        _vision(specs, config["vision_config"], h)
    return specs


_CLASSES = (
    ("vision", re.compile(r"(vision_tower|mm_projector)\.")),
    ("routed_experts", re.compile(r"\.mlp\.experts\.")),
    ("shared_experts", re.compile(r"\.mlp\.shared_experts\.")),
    ("router", re.compile(r"\.mlp\.gate\.")),
    ("indexer", re.compile(r"\.self_attn\.indexer\.")),
    ("attention", re.compile(r"\.self_attn\.")),
    ("dense_mlp", re.compile(r"\.mlp\.(gate|up|down)_proj\.")),
    ("embeddings", re.compile(r"embed_tokens\.")),
    ("lm_head", re.compile(r"(^|\.)(lm_head|shared_head\.head)\.")),
    ("norms", re.compile(r"norm\.(weight|bias)$")),
)


def tensor_class(name: str) -> str:
    """The row of the size report a tensor is counted in."""
    for label, pattern in _CLASSES:
        if pattern.search(name):
            return label
    return "other"


def layer_index(name: str) -> int | None:
    m = re.search(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None
