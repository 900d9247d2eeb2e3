"""`kumo quantize`: convert a BF16/FP32 checkpoint folder to INT4 or FP8, one shard at a time.

    kumo quantize --src DIR --dst DIR --weights int4-g32|int4-g128|fp8-channel|fp8-block
                  [--all-linear] [--kv-calibrate FILE | --kv-scales]
    (also: kumo quantize SRC DST --scheme int4|fp8|fp8-block [--group-size 32|128])

The source is BF16/FP32, or DeepSeek-style FP8 with 128×128 `weight_scale_inv` (Kimi K2 Instruct,
DeepSeek-V3), dequantized to BF16 on the way; an INT4 or per-channel FP8 source is refused.
Each source shard is read one tensor at a time and its converted tensors written to the shard of
the same name before the next shard is opened, so peak memory is about one shard. Written beside
the shards: config.json with the `quantization_config` block, the shard index, every other file of
the source (tokenizer, chat template, generation config) unchanged, and `quantize_report.json`
(bytes per tensor class before and after, total, ratio). KV-cache scales need forward passes, so
`--kv-calibrate` / `--kv-scales` load the source model once after the conversion.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open
from tqdm import tqdm

from backend.errors import CheckpointError
from backend.models.checkpoint import INDEX_FILE, shard_files
from backend.quant import kv_scales
from backend.quant.scheme import (
    DeepSeekFp8Config,
    KvCacheScheme,
    Method,
    QuantScheme,
    config_dict,
    parse_config,
)
from backend.quant.walker import quantize_tensor, quantized_shapes
from backend.tools.shard_writer import NAMES, ShardWriter
from backend.tools.tensor_inventory import tensor_class
from kernels.formats.fp8 import FP8, dequantize_fp8_block

REPORT_FILE = "quantize_report.json"
WEIGHTS: dict[str, tuple[Method, int]] = {
    "int4-g32": ("int4", 32),
    "int4-g128": ("int4", 128),
    "fp8-channel": ("fp8-channel", 32),
    "fp8-block": ("fp8-block", 32),
}


class ClassSize(msgspec.Struct):
    source_bytes: int = 0
    dest_bytes: int = 0
    num_tensors: int = 0
    num_quantized: int = 0


class SizeReport(msgspec.Struct, kw_only=True):
    """`quantize_report.json`: sizes per tensor class (see backend/tools/tensor_inventory.py `tensor_class`)."""

    weights: str
    all_linear: bool
    source_bytes: int
    dest_bytes: int
    ratio: float  # dest / source
    classes: dict[str, ClassSize]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_quantizable(name: str, shape: tuple[int, ...], dtype: torch.dtype, scheme: QuantScheme) -> bool:
    """A Linear's 2-D `.weight` the scheme targets (embeddings and norms are not Linears)."""
    module, _, leaf = name.rpartition(".")
    return (
        leaf == "weight"
        and len(shape) == 2
        and dtype.is_floating_point
        and "embed_tokens" not in module
        and scheme.applies_to(module, "Linear")
    )


class FP8Source:
    """A DeepSeek-style FP8 source (Kimi K2 Instruct, DeepSeek-V3): its `weight` e4m3 tensors are
    dequantized with their `weight_scale_inv` to BF16 before conversion. The scale may sit in
    another shard; that shard is opened for the one tensor."""

    def __init__(self, folder: Path, block: tuple[int, int]) -> None:
        index = folder / INDEX_FILE
        files = shard_files(folder)
        self.weight_map: dict[str, str] = (
            json.loads(index.read_text())["weight_map"] if index.exists() else {}
        )
        if not self.weight_map:
            with safe_open(str(files[0]), framework="pt") as f:
                self.weight_map = {k: files[0].name for k in f.keys()}  # noqa: SIM118
        self.folder, self.block = folder, block

    def has_scale(self, name: str) -> bool:
        return name.removesuffix(".weight") + ".weight_scale_inv" in self.weight_map

    def scale_for(self, name: str) -> torch.Tensor:
        """The `weight_scale_inv` of a weight that `has_scale`."""
        key = name.removesuffix(".weight") + ".weight_scale_inv"
        with safe_open(str(self.folder / self.weight_map[key]), framework="pt") as f:
            scale: torch.Tensor = f.get_tensor(key)
        return scale


def _plan(
    f: object, scheme: QuantScheme, fp8_source: FP8Source | None
) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], dict[str, str]]:
    """Every output tensor of a shard (name, dtype, shape) in order, from the source header alone;
    and what becomes of each source tensor ("copy", "dequantize", "quantize", "skip")."""
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    fate: dict[str, str] = {}
    for name in f.keys():  # type: ignore[attr-defined]  # noqa: SIM118 - safe_open is not a mapping
        piece = f.get_slice(name)  # type: ignore[attr-defined]
        dtype, shape = NAMES[piece.get_dtype()], tuple(piece.get_shape())
        if fp8_source is not None and name.endswith(".weight_scale_inv"):
            fate[name] = "skip"  # consumed with its weight
            continue
        if fp8_source is not None and dtype == FP8 and fp8_source.has_scale(name):
            dtype, fate[name] = torch.bfloat16, "dequantize"
        if is_quantizable(name, shape, dtype, scheme):
            module = name.rpartition(".")[0]
            plan += [(f"{module}.{leaf}", dt, sh) for leaf, dt, sh in quantized_shapes(scheme, *shape)]
            fate[name] = "quantize" if name not in fate else "dequantize+quantize"
        else:
            plan.append((name, dtype, shape))
            fate.setdefault(name, "copy")
    return plan, fate


def convert_shard(
    src: Path,
    dst: Path,
    scheme: QuantScheme,
    classes: dict[str, ClassSize],
    bar: tqdm,
    fp8_source: FP8Source | None = None,
) -> list[str]:
    """Convert one shard, writing each output tensor as soon as it exists; return their names."""
    with safe_open(str(src), framework="pt") as f:
        plan, fate = _plan(f, scheme, fp8_source)
        writer = ShardWriter(dst / src.name, plan, metadata={"format": "pt"})
        try:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                row = classes.setdefault(tensor_class(name), ClassSize())
                row.source_bytes += _nbytes(t)
                bar.update(1)
                if fate[name] == "skip":
                    continue
                row.num_tensors += 1
                steps = fate[name].split("+")
                if "dequantize" in steps:
                    assert fp8_source is not None  # _plan dequantizes only an FP8 source's weights
                    t = dequantize_fp8_block(t, fp8_source.scale_for(name), fp8_source.block, torch.bfloat16)
                if "quantize" in steps:
                    module = name.rpartition(".")[0]
                    for leaf, q in quantize_tensor(scheme, t).items():
                        writer.write(f"{module}.{leaf}", q)
                        row.dest_bytes += _nbytes(q)
                    row.num_quantized += 1
                else:
                    writer.write(name, t)
                    row.dest_bytes += _nbytes(t)
                del t
        finally:
            writer.file.close()
        writer.close()
    return [name for name, _, _ in plan]


def _fp8_source(folder: Path, raw: dict[str, Any]) -> FP8Source | None:
    """None for a BF16/FP32 source; an FP8Source for DeepSeek FP8; refuse anything else."""
    block = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    if not block:
        return None
    config = parse_config(block)
    if isinstance(config, DeepSeekFp8Config):
        b0, b1 = config.weight_block_size
        return FP8Source(folder, (b0, b1))
    raise CheckpointError(
        f"{folder} is already {config.format}; convert from its BF16 or FP8-block checkpoint"
    )


def quantize_checkpoint(
    src: Path, dst: Path, scheme: QuantScheme, *, weights: str, all_linear: bool
) -> SizeReport:
    if dst.resolve() == src.resolve():  # each shard would be truncated while it is being read
        raise CheckpointError(f"{dst} is its own source: give kumo quantize another destination folder")
    raw = json.loads((src / "config.json").read_text())
    fp8_source = _fp8_source(src, raw)
    raw.get("text_config", {}).pop("quantization_config", None)
    dst.mkdir(parents=True, exist_ok=True)
    files = shard_files(src)
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    classes: dict[str, ClassSize] = {}
    weight_map: dict[str, str] = {}
    with tqdm(total=total, desc="quantize", unit="tensor", file=sys.stderr) as bar:
        for file in files:
            written = convert_shard(file, dst, scheme, classes, bar, fp8_source)
            weight_map.update({name: file.name for name in written})
    for item in src.iterdir():  # tokenizer, templates, generation config: unchanged
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name not in (INDEX_FILE, "config.json", REPORT_FILE)
        ):
            shutil.copy2(item, dst / item.name)
    raw["quantization_config"] = config_dict(scheme)
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    dest_total = sum(c.dest_bytes for c in classes.values())
    index = {"metadata": {"total_size": dest_total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_FILE).write_text(json.dumps(index, indent=2))
    source_total = sum(c.source_bytes for c in classes.values())
    report = SizeReport(
        weights=weights,
        all_linear=all_linear,
        source_bytes=source_total,
        dest_bytes=dest_total,
        ratio=dest_total / source_total,
        classes=dict(sorted(classes.items())),
    )
    (dst / REPORT_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return report


def read_prompts(path: Path) -> list[str]:
    """Calibration texts: a JSONL line's `text`, else the line itself; blank lines skipped."""
    texts = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            row = None
        text = row["text"] if isinstance(row, dict) and isinstance(row.get("text"), str) else line
        if text.strip():
            texts.append(text)
    return texts


def num_shipped_mtp_layers(src: Path) -> int:
    """`num_nextn_predict_layers` when the checkpoint holds those layers' tensors, else 0 (many
    configs, transformers' own among them, declare MTP layers that the weights leave out)."""
    from safetensors import safe_open

    from backend.models.checkpoint import shard_files
    from backend.models.model_config import ModelConfig

    config = ModelConfig.from_pretrained(src)
    if not config.num_nextn_predict_layers:
        return 0
    first = f"{config.weight_prefix}model.layers.{config.num_hidden_layers}."
    for file in shard_files(src):
        with safe_open(str(file), framework="pt") as f:
            if any(name.startswith(first) for name in f.keys()):  # noqa: SIM118
                return config.num_nextn_predict_layers
    return 0


def calibrate_kv(
    src: Path,
    dst: Path,
    prompts_file: Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> None:
    """Scales from the unquantized source model, stored beside the converted weights; its MTP
    layers' cache slots too (speculative decoding with an FP8 cache), when it ships any."""
    from backend.models.loader import load_model

    loaded = load_model(src, dtype=dtype, device=device, num_mtp_layers=num_shipped_mtp_layers(src))
    vocab = loaded.config.vocab_size
    if prompts_file is None:
        prompts = kv_scales.builtin_prompt_ids(src, vocab)
    else:
        from backend.text.tokenizer import load_tokenizer

        tok = load_tokenizer(src)
        prompts = [[i for i in tok.encode(x) if i < vocab] for x in read_prompts(prompts_file)]
    scales = kv_scales.calibrate(loaded.model, prompts, model_dtype=dtype)
    kv_scales.save(dst, scales, loaded.config.weight_prefix)
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"]["kv_cache_scheme"] = msgspec.to_builtins(KvCacheScheme())
    (dst / "config.json").write_text(json.dumps(raw, indent=2))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="kumo quantize", description="Convert a checkpoint to INT4 or FP8 weights."
    )
    ap.add_argument("paths", nargs="*", type=Path, help="SRC DST (or --src/--dst)")
    ap.add_argument("--src", type=Path)
    ap.add_argument("--dst", type=Path)
    ap.add_argument("--weights", choices=list(WEIGHTS))
    ap.add_argument(
        "--scheme",
        choices=["int4", "fp8", "fp8-block"],
        help="with --group-size: another way to say --weights",
    )
    ap.add_argument("--group-size", type=int, choices=[32, 128], default=32)
    ap.add_argument(
        "--all-linear", action="store_true", help="every Linear but router, embeddings and lm_head"
    )
    ap.add_argument(
        "--kv-calibrate", type=Path, help="prompts (one per line, or JSONL with `text`) for FP8 KV scales"
    )
    ap.add_argument(
        "--kv-scales", action="store_true", help="calibrate FP8 KV scales on the built-in prompts"
    )
    ap.add_argument("--calibrate-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--calibrate-device", default="cpu", help="where the source model runs for KV calibration"
    )
    a = ap.parse_args(argv)
    src, dst = (a.paths + [None, None])[:2] if a.paths else (a.src, a.dst)
    if src is None or dst is None:
        ap.error("give SRC and DST (positional or --src/--dst)")
    weights = (
        a.weights
        or {"int4": f"int4-g{a.group_size}", "fp8": "fp8-channel", "fp8-block": "fp8-block", None: None}[
            a.scheme
        ]
    )
    if weights is None:
        ap.error("give --weights (or --scheme)")
    method, group = WEIGHTS[weights]
    scheme = QuantScheme.build(method, group_size=group, all_linear=a.all_linear)
    try:
        report = quantize_checkpoint(src, dst, scheme, weights=weights, all_linear=a.all_linear)
        if a.kv_calibrate or a.kv_scales:
            calibrate_kv(
                src, dst, a.kv_calibrate, dtype=getattr(torch, a.calibrate_dtype), device=a.calibrate_device
            )
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"kumo quantize: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{src} -> {dst}: {report.source_bytes / 1e9:.3f} GB -> {report.dest_bytes / 1e9:.3f} GB (×{report.ratio:.3f})"
    )
    for name, c in report.classes.items():
        print(
            f"  {name:<16} {c.source_bytes / 1e6:12.2f} MB -> {c.dest_bytes / 1e6:12.2f} MB  ({c.num_quantized}/{c.num_tensors} quantized)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
