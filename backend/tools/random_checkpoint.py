"""Random-weight checkpoints of the exact served architectures, written by Kumo's own model code.

`kumo serve` needs a servable model on first start, before trained small checkpoints ship. This
writes a Hugging Face-style folder: config.json (the published config of the kind, from
`models/configs/`, shrunk to a small shape but keeping every architectural choice: RoPE / YaRN,
routing, dense-first layers, DSA, QK-norm, …), generation_config.json, the family's tokenizer files
(`backend.text.tokenizer_files`), and model.safetensors under the names the published checkpoints use
(per-expert tensors, K2.6's `language_model.` prefix and its vision tower). No transformers.

`make_random_checkpoint(kind, path)` writes the folder whole or not at all: beside its destination,
then renamed into place, because `kumo serve` takes an existing `config.json` to mean "ready". Its
command line is `python -m backend.tools.random_checkpoint KIND PATH` (KIND: kimi-k2.6 | glm-5.2 | glm-4.5).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from backend.models import ARCHITECTURES
from backend.models.model_config import ModelConfig
from backend.models.moonvit import MoonViT, VisionConfig
from backend.text.tokenizer_files import Family, TokenizerFormat, write_tokenizer_files

PUBLISHED_CONFIGS = Path(__file__).resolve().parents[2] / "models" / "configs"
KINDS = ("kimi-k2.6", "glm-5.2", "glm-4.5")
INIT_STD = 0.02
T = TypeVar("T")

SMALL_TEXT: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    num_nextn_predict_layers=0,
)
SMALL_MLA: dict[str, Any] = dict(
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
)
SMALL_DSA: dict[str, Any] = dict(index_topk=64, index_head_dim=32, index_n_heads=4)
SMALL_GQA: dict[str, Any] = dict(num_key_value_heads=2, head_dim=32)
SMALL_VISION: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, pos_emb_height=16,
    pos_emb_width=16,
)  # fmt: skip
# MoonViT parameter prefixes → the names K2.5 / K2.6 checkpoints give them
_VISION_NAMES = (
    ("patch_proj.", "vision_tower.patch_embed.proj."),
    ("pos_emb", "vision_tower.patch_embed.pos_emb.weight"),
    ("final_layernorm.", "vision_tower.encoder.final_layernorm."),
    ("blocks.", "vision_tower.encoder.blocks."),
    ("pre_norm.", "mm_projector.pre_norm."),
    ("proj_in.", "mm_projector.proj.0."),
    ("proj_out.", "mm_projector.proj.2."),
)
# the stop tokens of each family's published generation_config.json, by content
_EOS = {"kimi": ("[EOS]", "<|im_end|>"), "glm": ("<|endoftext|>", "<|user|>", "<|observation|>")}


def small_config(
    published: dict[str, Any], *, vocab_size: int, bos: int | None, eos: list[int]
) -> dict[str, Any]:
    """The published config with small sizes; K2.5-style configs keep their nesting and vision block."""
    raw = {k: v for k, v in published.items() if not k.startswith("_") and k != "quantization_config"}
    nested = "text_config" in raw
    text = dict(raw["text_config"] if nested else raw)
    text.pop("quantization_config", None)
    mla = "kv_lora_rank" in text
    text |= (
        SMALL_TEXT
        | (SMALL_MLA if mla else SMALL_GQA)
        | {"vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos}
    )
    if mla:
        text["num_key_value_heads"] = text["num_attention_heads"]
        text["qk_head_dim"] = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        text["head_dim"] = text["qk_rope_head_dim"]
    if "index_topk" in text:
        text |= SMALL_DSA
        text.pop("index_topk_pattern", None)
        n = text["num_hidden_layers"]
        text["indexer_types"] = (text.get("indexer_types") or ["full"] * n)[:n]
    text.pop("mlp_layer_types", None)
    text["n_group"] = min(int(text.get("n_group") or 1), text["n_routed_experts"])
    text["topk_group"] = min(int(text.get("topk_group") or 1), text["n_group"])
    if not nested:
        return text
    raw["text_config"] = text
    raw["vision_config"] = dict(raw.get("vision_config", {})) | SMALL_VISION
    raw["projection_hidden_size"] = SMALL_VISION["hidden_size"]
    return raw


def random_text_weights(config: ModelConfig, *, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our model of `config` with random weights, exported under the published tensor names."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[config.architecture](config, dtype=torch.float32)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("bias"):
                t.zero_()  # linear and LayerNorm biases, and the router's selection bias
            elif "norm" in name:
                t.fill_(1.0)
            else:
                t.normal_(0.0, INIT_STD)
    out = {}
    for name, t in model.export_weights():  # type: ignore[operator]
        keep_fp32 = name.endswith("e_score_correction_bias")
        out[config.weight_prefix + name] = t.to(torch.float32 if keep_fp32 else dtype).contiguous()
    return out


def random_vision_weights(
    raw: dict[str, Any], text_hidden: int, *, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed + 1)
    tower = MoonViT(VisionConfig.from_config(raw, text_hidden))
    out = {}
    for name, p in tower.named_parameters():
        t = (
            torch.ones_like(p)
            if "norm" in name and name.endswith("weight")
            else torch.randn_like(p) * INIT_STD
        )
        local, published = next((a, b) for a, b in _VISION_NAMES if name.startswith(a))
        rest = name[len(local) :].replace(".fc0.", ".mlp.fc0.").replace(".fc1.", ".mlp.fc1.")
        out[published + rest] = t.to(dtype).contiguous()
    return out


def write_random_checkpoint(
    kind: str, path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write a small random checkpoint of `kind` (one of KINDS) at `path`; returns the path."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    path = Path(path)
    published = json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text())
    family: Family = "kimi" if kind.startswith("kimi") else "glm"
    fmt: TokenizerFormat = "tiktoken" if family == "kimi" else "tokenizer.json"
    num_ids = write_tokenizer_files(family, path, fmt=fmt, glm_generation="4.5" if kind == "glm-4.5" else "5")
    ids = _special_ids(path)
    eos = [ids[t] for t in _EOS[family]]
    raw = small_config(published, vocab_size=-(-num_ids // 64) * 64, bos=ids.get("[BOS]"), eos=eos)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids.get("[BOS]"), "eos_token_id": eos})
    )
    config = ModelConfig.from_dict(raw)
    tensors = random_text_weights(config, seed=seed, dtype=dtype)
    if "vision_config" in raw:
        tensors |= random_vision_weights(raw, config.hidden_size, seed=seed, dtype=dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _special_ids(path: Path) -> dict[str, int]:
    decoder = json.loads((path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    return {entry["content"]: int(i) for i, entry in decoder.items()}


def make_random_checkpoint(
    kind: str, path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the `kind` checkpoint at `path` (which must not exist yet) and return it."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    write_whole(target, lambda staging: write_random_checkpoint(kind, staging, seed=seed, dtype=dtype))
    return target


def write_whole(target: Path, write: Callable[[Path], T]) -> T:
    """`write(folder)` into a staging folder beside `target`, renamed to it once complete: a folder
    with a config.json is never half written (`kumo serve` takes one to mean ready)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        out = write(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backend.tools.random_checkpoint",
        description="Write a small random checkpoint that a backend can serve.",
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    make_random_checkpoint(args.kind, args.path, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(f"wrote a random {args.kind} checkpoint to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
