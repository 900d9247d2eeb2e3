"""The small models' shapes, tokenizers and checkpoint folders.

A nano model keeps every architectural choice of the published config in `models/configs/` (MLA,
YaRN, sigmoid routing with a selection bias, shared experts, dense-first layers, GLM-5's DSA indexer,
K2.5's nested layout with the MoonViT tower) and shrinks the sizes. The folder it is saved in has
exactly the published layout: config.json as the published checkpoints write it, generation_config.json,
the family's tokenizer files and chat template (`backend.text.tokenizer_files`, BPE trained on the training
mixture), and bf16 safetensors shards (≤ 8 MB) under the published tensor names, with
`model.safetensors.index.json`.

transformers is imported only inside functions: `import models.recipes.nano` stays light.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from backend.text.jinja_sandbox import JinjaTemplate
from backend.text.tokenizer_files import (
    GLM_SPECIAL_TOKENS,
    KIMI_SPECIAL_TOKENS,
    Family,
    TokenizerFormat,
    write_tokenizer_files,
)
from models.recipes.render import corpus_text

PUBLISHED = Path(__file__).resolve().parents[1] / "configs"
MAX_SHARD_BYTES = 8 * 1000 * 1000
MAX_MODEL_BYTES = 12 * 1000 * 1000
TOKENIZER_ITEMS = 40_000  # items the BPE is trained on, at most
# the stop tokens of each family's published generation_config.json, by content
EOS = {"kimi": ("[EOS]", "<|im_end|>"), "glm": ("<|endoftext|>", "<|user|>", "<|observation|>")}
MLA = dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
SIZES: dict[str, dict[str, Any]] = {
    # ≤ 12 MB in bf16 each (checked by a test without training)
    "nano": dict(
        text=dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                  first_k_dense_replace=1, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, **MLA),
        dsa=dict(index_n_heads=4, index_head_dim=32, index_topk=2048),
        vision=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    pos_emb_height=16, pos_emb_width=16),
        vocab=3072,
    ),
    # a few seconds of CPU per step: the recipe's tests
    "micro": dict(
        text=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                  first_k_dense_replace=1, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16),
        dsa=dict(index_n_heads=2, index_head_dim=16, index_topk=32),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    pos_emb_height=8, pos_emb_width=8),
        vocab=512,
    ),
}  # fmt: skip
KIND = {"kimi": "kimi-k2.6", "glm": "glm-5.2"}


def write_tokenizer(family: Family, folder: Path, items: list[dict[str, Any]], vocab_size: int) -> int:
    """The family's tokenizer files with a BPE trained on `items` rendered by the family's template,
    numbers in runs of up to three digits as the published patterns split them (single digits lost
    to them in a micro-model ablation, 2026-12-01: models/README.md). Returns the number of token ids (BPE + special tokens)."""
    fmt: TokenizerFormat = "tiktoken" if family == "kimi" else "tokenizer.json"
    write_tokenizer_files(family, folder, fmt=fmt, vocab_size=256 + 1)  # the template, to render the corpus
    template = JinjaTemplate.from_checkpoint(folder)
    assert template is not None
    specials = KIMI_SPECIAL_TOKENS if family == "kimi" else GLM_SPECIAL_TOKENS
    if len(items) > TOKENIZER_ITEMS:  # a small vocabulary: a sample finds the same merges, sooner
        items = random.Random(0).sample(items, TOKENIZER_ITEMS)
    corpus = corpus_text(template, items, specials)
    return write_tokenizer_files(family, folder, fmt=fmt, vocab_size=vocab_size, corpus=corpus)


def special_ids(folder: Path) -> dict[str, int]:
    decoder = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    return {entry["content"]: int(i) for i, entry in decoder.items()}


def published_config(family: Family, size: str, num_ids: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json of the nano model in the published layout (K2.5 nesting for Kimi)."""
    raw = json.loads((PUBLISHED / KIND[family] / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_") and k != "quantization_config"}
    shape = SIZES[size]
    text = dict(raw.get("text_config") or raw)
    text |= shape["text"] | {
        "vocab_size": -(-num_ids // 64) * 64,
        "num_nextn_predict_layers": 0,  # no MTP head is trained
        "num_key_value_heads": shape["text"]["num_attention_heads"],
        "eos_token_id": [ids[t] for t in EOS[family]],
        "bos_token_id": ids.get("[BOS]"),
    }
    if family == "glm":
        text |= shape["dsa"] | {
            "qk_head_dim": text["qk_nope_head_dim"] + text["qk_rope_head_dim"],
            "head_dim": text["qk_rope_head_dim"],
        }
        return text
    text.pop("quantization_config", None)
    vision = {k: v for k, v in raw["vision_config"].items() if not k.startswith("projection_")}
    vision |= shape["vision"]
    pad = ids["<|media_pad|>"]
    return raw | {
        "text_config": text,
        "vision_config": vision,
        "projection_hidden_size": vision["hidden_size"],
        "projection_layer_norm_eps": raw["vision_config"].get("projection_layer_norm_eps", 1e-5),
        "media_placeholder_token_id": pad,
        "image_token_id": pad,
        "vision_start_token_id": ids["<|media_begin|>"],
        "vision_end_token_id": ids["<|media_end|>"],
    }


def build_model(family: Family, config: dict[str, Any]) -> torch.nn.Module:
    """The transformers model of a nano config.json (float32, random init)."""
    import transformers as tf

    if family == "glm":
        return tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**config)).float()
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    cfg = Kimi_K25Config(
        **{k: v for k, v in config.items() if k not in ("architectures", "media_placeholder_token_id")}
    )
    return Kimi_K25ForConditionalGeneration(cfg).float()  # the text config's torch_dtype would make it bf16


def parameter_bytes(family: Family, config: dict[str, Any]) -> int:
    """bf16 bytes of the saved tensors (the selection bias stays float32), without allocating weights."""
    with torch.device("meta"):
        model = build_model(family, config)
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            total += t.numel() * 4
        elif t.is_floating_point() and "rotary" not in name and "inv_freq" not in name:
            total += t.numel() * 2
    return total


def published_tensors(family: Family, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the published checkpoint names, bf16 (the selection bias float32).

    transformers' own save path undoes its load-time conversions (fused experts → one tensor per
    expert); its K2.5 names are then mapped to the published ones."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors |= load_file(str(f))
    out = {}
    for name, t in tensors.items():
        if family == "kimi":
            name = published_k25_name(name)
        keep_fp32 = name.endswith("e_score_correction_bias")
        out[name] = t.to(torch.float32 if keep_fp32 else torch.bfloat16).contiguous()
    return out


def published_k25_name(name: str) -> str:
    """transformers 5.24 writes K2.5 back as `language_model.model.blocks.N`, `vision_tower.encoder.
    patch_embed` and `model.mm_projector.pre_norm`; real K2.5 checkpoints say `layers`, `vision_tower.
    patch_embed` and `mm_projector.pre_norm`."""
    for old, new in (
        ("language_model.model.blocks.", "language_model.model.layers."),
        ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
        ("model.mm_projector.", "mm_projector."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def write_shards(
    tensors: dict[str, torch.Tensor], folder: Path, max_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """safetensors shards of at most `max_bytes` each, in name order, and model.safetensors.index.json."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if n > max_bytes:
            raise ValueError(f"{name} alone is {n} bytes, over the {max_bytes}-byte shard limit")
        if size + n > max_bytes and groups[-1]:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += n
    paths, weight_map = [], {}
    for i, group in enumerate(groups):
        path = folder / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(path), metadata={"format": "pt"})
        paths.append(path)
        weight_map |= {name: path.name for name in group}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths


def save_checkpoint(family: Family, model: torch.nn.Module, config: dict[str, Any], folder: Path) -> None:
    """Weights, config.json and generation_config.json into `folder` (which holds the tokenizer)."""
    write_shards(published_tensors(family, model), folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    text = config.get("text_config") or config
    generation = {"bos_token_id": text.get("bos_token_id"), "eos_token_id": text["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
