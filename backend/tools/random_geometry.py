"""Random-weight checkpoints of a published geometry truncated to a few layers, in the served format.

`backend.tools.random_checkpoint` writes the served architectures in small shapes (a CPU can run
them); this writes the FULL published shapes of `models/configs/KIND` — hidden size, heads, 384 or
256 experts of full width, the whole vocabulary — with only the first `num_layers` layers, so that
`kumo serve --device cuda --model NAME=PATH` serves the real per-layer work on one GPU:

    kind       layers   on disk (INT4 g32 routed experts, the rest BF16)
    kimi-k2.6  2        ~17 GB: 1 dense + 1 MoE layer, embeddings + lm_head 4.7 GB, MoonViT 0.9 GB
    glm-5.2    4        ~13 GB: 3 dense + 1 MoE layer (GLM-5 starts with 3 dense), DSA indexer

The format is what the GPU backend loads: compressed-tensors `pack-quantized` INT4 g32 routed
experts as Kimi K2.6 ships them (its published `quantization_config`; GLM 5.2 gets Kumo's INT4
experts scheme, what `kumo serve` serves it as), every other tensor BF16 (fp32 router biases), under
the published names (`backend.tools.tensor_inventory`), in ~4 GB shards with an index. Tokenizer files
and special ids are the family's small tokenizer (`backend.text.tokenizer_files`), as the small
checkpoints have; ids stay far below the published vocabulary.

Values are drawn on `device` from one seeded `torch.Generator` a tensor: Linears and embeddings
N(0, 0.02²), norms 1, biases 0; INT4 words are uniform random bits (every nibble uniform) with a group
scale of 0.02 / 4.6, so the dequantized weights have the same std. No Python loop touches an element.

    python -m backend.tools.random_geometry KIND PATH --layers N [--device cuda] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from backend.models.checkpoint import INDEX_FILE
from backend.quant.scheme import QuantScheme, config_dict, parse_config, scheme_from_config
from backend.quant.walker import quantized_shapes
from backend.text.tokenizer_files import Family, TokenizerFormat, write_tokenizer_files
from backend.tools.random_checkpoint import (
    _EOS,
    INIT_STD,
    KINDS,
    PUBLISHED_CONFIGS,
    _special_ids,
    write_whole,
)
from backend.tools.shard_writer import ShardWriter
from backend.tools.tensor_inventory import TensorSpec, checkpoint_tensors, text_config

SHARD_BYTES = 4 << 30
INT4_LEVEL_STD = 4.61  # std of a uniform nibble over 16 levels: sqrt((16² − 1) / 12)
PER_LAYER_LISTS = ("indexer_types", "mlp_layer_types", "index_topk_pattern", "layer_types")
Planned = tuple[str, torch.dtype, tuple[int, ...]]


def truncated_config(published: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The published config with its first `num_layers` layers, no MTP layer, and the INT4 experts
    scheme (the published one where the checkpoint ships INT4: Kimi K2.6's)."""
    raw: dict[str, Any] = json.loads(
        json.dumps({k: v for k, v in published.items() if not k.startswith("_")})
    )
    text = text_config(raw)
    text.pop("_kumo_note", None)
    if num_layers > text["num_hidden_layers"]:
        raise ValueError(f"{num_layers} layers asked of a {text['num_hidden_layers']}-layer geometry")
    text["num_hidden_layers"] = num_layers
    text["num_nextn_predict_layers"] = 0
    for key in PER_LAYER_LISTS:
        if isinstance(text.get(key), list):
            text[key] = text[key][:num_layers]
    if "quantization_config" not in raw and "quantization_config" not in text:
        raw["quantization_config"] = config_dict(QuantScheme.build("int4", group_size=32))
    return raw


def scheme_of(raw: dict[str, Any]) -> QuantScheme:
    block = raw.get("quantization_config") or text_config(raw)["quantization_config"]
    return scheme_from_config(parse_config(block))


def planned_tensors(raw: dict[str, Any], scheme: QuantScheme) -> list[tuple[TensorSpec, list[Planned]]]:
    """Every checkpoint tensor of `raw`, each with what is written for it (a quantized Linear: its
    packed words, group scales and shape; anything else: itself)."""
    out = []
    for spec in checkpoint_tensors(raw):
        module, _, leaf = spec.name.rpartition(".")
        if spec.is_linear and leaf == "weight" and scheme.applies_to(spec.served_module, "Linear"):
            written = [(f"{module}.{n}", dt, sh) for n, dt, sh in quantized_shapes(scheme, *spec.shape)]
        else:
            written = [(spec.name, torch.float32 if spec.dtype_bytes == 4 else torch.bfloat16, spec.shape)]
        out.append((spec, written))
    return out


def random_tensor(planned: Planned, g: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """One tensor's random value, drawn on `device`."""
    name, dtype, shape = planned
    module, _, leaf = name.rpartition(".")
    if dtype == torch.int32:  # packed INT4 words: 8 uniform nibbles each
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g, device=device)
    if leaf == "weight_scale":
        return torch.full(shape, INIT_STD / INT4_LEVEL_STD, dtype=dtype, device=device)
    if leaf == "bias" or name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    if "norm" in module.rpartition(".")[2]:  # RMSNorm / LayerNorm weights: input_layernorm, k_norm, …
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype, generator=g, device=device).mul_(INIT_STD)


def _shards(
    planned: list[tuple[TensorSpec, list[Planned]]],
) -> Iterator[list[tuple[TensorSpec, list[Planned]]]]:
    """Whole source tensors grouped into shards of about SHARD_BYTES."""
    shard: list[tuple[TensorSpec, list[Planned]]] = []
    size = 0
    for spec, parts in planned:
        nbytes = sum(torch.empty(0, dtype=dt).element_size() * _numel(sh) for _, dt, sh in parts)
        if shard and size + nbytes > SHARD_BYTES:
            yield shard
            shard, size = [], 0
        shard.append((spec, parts))
        size += nbytes
    if shard:
        yield shard


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_random_geometry(
    raw: dict[str, Any], path: Path, *, family: Family, device: str | torch.device = "cpu", seed: int = 0
) -> dict[str, Any]:
    """Write the checkpoint of config `raw` (with its quantization block) into the folder `path`:
    tokenizer files, config.json, generation_config.json, shards and their index. Returns a report."""
    start = time.perf_counter()
    fmt: TokenizerFormat = "tiktoken" if family == "kimi" else "tokenizer.json"
    write_tokenizer_files(family, path, fmt=fmt)
    ids = _special_ids(path)
    eos = [ids[t] for t in _EOS[family]]
    text_config(raw).update(bos_token_id=ids.get("[BOS]"), eos_token_id=eos)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids.get("[BOS]"), "eos_token_id": eos})
    )
    planned = planned_tensors(raw, scheme_of(raw))
    weight_map: dict[str, str] = {}
    total = 0
    shards = list(_shards(planned))
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = ShardWriter(
            path / name, [part for _, parts in shard for part in parts], metadata={"format": "pt"}
        )
        try:
            for spec, parts in shard:
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + len(weight_map))
                for part in parts:
                    is_shape = part[0].endswith(".weight_shape")  # the [N, K] of an INT4 weight
                    t = (
                        torch.tensor(list(spec.shape), dtype=torch.int32)
                        if is_shape
                        else random_tensor(part, g, device)
                    )
                    writer.write(part[0], t)
                    weight_map[part[0]] = name
                    total += t.numel() * t.element_size()
        finally:
            writer.file.close()
        writer.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return {
        "bytes": total,
        "tensors": len(weight_map),
        "shards": len(shards),
        "s": time.perf_counter() - start,
    }


def make_random_geometry(
    kind: str, path: str | Path, *, num_layers: int, device: str | torch.device = "cpu", seed: int = 0
) -> dict[str, Any]:
    """Write `kind`'s published geometry truncated to `num_layers` at `path` (which must not exist),
    whole or not at all (beside it, then renamed: `kumo serve` takes a config.json to mean ready)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    published = json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text())
    raw = truncated_config(published, num_layers)
    family: Family = "kimi" if kind.startswith("kimi") else "glm"
    report = write_whole(
        target, lambda staging: write_random_geometry(raw, staging, family=family, device=device, seed=seed)
    )
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m backend.tools.random_geometry",
        description="Write a random checkpoint of a published geometry, truncated to a few layers.",
    )
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("path", type=Path)
    ap.add_argument("--layers", type=int, required=True, help="the first N layers of the published depth")
    ap.add_argument("--device", default="cpu", help="where the values are drawn (cuda: seconds, not minutes)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    r = make_random_geometry(a.kind, a.path, num_layers=a.layers, device=a.device, seed=a.seed)
    print(f"wrote {a.kind}, {a.layers} layers, to {a.path}: {r['bytes'] / 1e9:.2f} GB in {r['tensors']} tensors, "
          f"{r['shards']} shards, {r['s']:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
