"""FP8 KV-cache scales: calibrated, stored beside the weights, read back at load — never a silent 1.0.

Calibration runs prompts through the unquantized model with a cache in the model's dtype and takes,
per layer and per cached tensor, the largest |value| written: scale = amax / 448 (e4m3's max), so
the calibration set's extreme lands exactly on the top of the FP8 range (value = stored × scale).
One scale per cached tensor: MLA's 576-wide latent gets one (vLLM uses it for both "K" and "V"),
the DSA indexer's keys their own, GQA's K and V one each. A model built with MTP layers
(speculative decoding) runs them over the calibration prompts as speculation's propose step does, so
their cache slots (layers `num_hidden_layers + i`, stored under those layer numbers) are measured too.

Storage uses vLLM's names, in `kv_scales.safetensors` listed in the shard index:
    MLA latent      model.layers.{L}.self_attn.k_scale and .v_scale (the same value)
    DSA index keys  model.layers.{L}.self_attn.indexer.k_scale
    GQA K / V       model.layers.{L}.self_attn.k_scale / .v_scale
(with the checkpoint's weight prefix, `language_model.` for K2.5). Reading also takes scales from
any shard the index lists them in (where vLLM and llm-compressor put them) and an older
checkpoint's single `kv_scale`; a scale that is not one positive finite number is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from backend.engine.forward_batch import ForwardBatch
from backend.engine.prompt_runner import PromptRunner
from backend.errors import CheckpointError
from backend.models.checkpoint import INDEX_FILE, SINGLE_FILE
from kernels.formats.fp8 import FP8_MAX

KV_SCALE_FILE = "kv_scales.safetensors"
_SCALE = re.compile(r"\.(k_scale|v_scale|kv_scale)$")
log = logging.getLogger(__name__)

# Built-in calibration text: prose, code, numbers, JSON, CJK and a chat turn, so that the latent's
# range is seen on the kinds of input a server gets. Used only when a checkpoint ships no scales.
BUILTIN_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in fixed-size blocks.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(20)])",
    "Q: What is 37 * 43 + 19? A: 37 * 43 = 1591, and 1591 + 19 = 1610. The answer is 1610.",
    '{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius", "days": [1, 2, 3]}}',
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "<|user|>Summarise the causes of the French Revolution in three bullet points.<|assistant|>",
)


def without_kv_scales(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream minus KV-cache scales (the model has no parameter for them)."""
    return ((n, t) for n, t in weights if not _SCALE.search(n))


def scale_names(layer: int, cache_name: str, prefix: str = "") -> tuple[str, ...]:
    attn = f"{prefix}model.layers.{layer}.self_attn"
    return {
        "latent": (f"{attn}.k_scale", f"{attn}.v_scale"),
        "index_k": (f"{attn}.indexer.k_scale",),
        "k": (f"{attn}.k_scale",),
        "v": (f"{attn}.v_scale",),
    }[cache_name]


class _TargetThenDrafts(nn.Module):
    """The model's forward, then each of its MTP layers over the same positions, as speculative
    decoding's propose step runs them (backend/engine/speculative/propose.py): at position p the target's
    hidden state and token p + 1 (after the prompt: the target's greedy token), writing the layer's
    KV into its own cache slot, so that calibration measures the MTP layers' KV too."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.ids: list[int] = []  # the prompt being run

    def cache_specs(self) -> Any:
        return self.model.cache_specs()  # type: ignore[operator]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        model: Any = self.model
        logits, hidden = model.forward_spec(batch)  # [N, V], [T, H]
        positions = batch.positions.tolist()
        after = [self.ids[p + 1] if p + 1 < len(self.ids) else -1 for p in positions]
        if after[-1] < 0:  # the prompt's last position: the target's own next token follows it
            row = int((batch.logits_indices == len(positions) - 1).nonzero()[0])
            after[-1] = int(logits[row].argmax())
        drafting = dataclasses.replace(batch, input_ids=torch.tensor(after, device=batch.input_ids.device))
        for depth in range(model.num_mtp_layers):  # depth i runs MTP layer i
            model.forward_mtp(drafting, hidden, depth)
        out: torch.Tensor = logits
        return out


@torch.no_grad()
def calibrate(
    model: nn.Module, prompts: list[list[int]], *, model_dtype: torch.dtype
) -> list[dict[str, float]]:
    """Per layer, per cached tensor: amax over every prompt's cache / 448. The MTP layers a model
    was built with (speculative decoding) are run too, and get their own scales."""
    drafts = _TargetThenDrafts(model) if getattr(model, "num_mtp_layers", 0) else None
    runner = PromptRunner(drafts or model, model_dtype=model_dtype)
    amax: list[dict[str, float]] | None = None
    for ids in filter(None, prompts):  # an empty prompt writes nothing to measure
        if drafts is not None:
            drafts.ids = ids
        runner.logits(ids)
        seen = runner.cache_amax(len(ids))
        amax = (
            seen
            if amax is None
            else [{k: max(a[k], s[k]) for k in a} for a, s in zip(amax, seen, strict=True)]
        )
    if amax is None:
        raise ValueError("calibration needs at least one prompt with tokens")
    return [{k: max(v, 1e-12) / FP8_MAX for k, v in layer.items()} for layer in amax]


def builtin_prompt_ids(path: str | Path, vocab_size: int) -> list[list[int]]:
    """BUILTIN_PROMPTS in the checkpoint's tokenizer; a checkpoint without one gets seeded random ids."""
    from backend.text.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(path)
    except CheckpointError:
        g = torch.Generator().manual_seed(0)
        log.warning("%s has no tokenizer: calibrating KV scales on seeded random token ids", path)
        return [torch.randint(0, vocab_size, (48,), generator=g).tolist() for _ in BUILTIN_PROMPTS]
    return [[i for i in tok.encode(p) if i < vocab_size] for p in BUILTIN_PROMPTS]


def save(dst: str | Path, scales: list[dict[str, float]], prefix: str = "") -> None:
    """Write kv_scales.safetensors beside the weights and list its tensors in the shard index."""
    dst = Path(dst)
    tensors = {
        name: torch.tensor(value, dtype=torch.float32)
        for layer, per_name in enumerate(scales)
        for cache_name, value in per_name.items()
        for name in scale_names(layer, cache_name, prefix)
    }
    save_file(tensors, str(dst / KV_SCALE_FILE), metadata={"format": "pt"})
    index = dst / INDEX_FILE
    if index.exists():
        data = json.loads(index.read_text())
    else:  # a single-file checkpoint becomes an indexed one so that both files are listed
        data = {"metadata": {}, "weight_map": {}}
        if (dst / SINGLE_FILE).exists():
            with safe_open(str(dst / SINGLE_FILE), framework="pt") as f:
                data["weight_map"] = {k: SINGLE_FILE for k in f.keys()}  # noqa: SIM118
    # replace an earlier save's entries (names and their bytes in total_size) by this one's
    earlier = [n for n, file in data["weight_map"].items() if file == KV_SCALE_FILE]
    for name in earlier:
        del data["weight_map"][name]
    data["weight_map"].update({name: KV_SCALE_FILE for name in tensors})
    if "total_size" in data["metadata"]:
        data["metadata"]["total_size"] += 4 * (len(tensors) - len(earlier))  # fp32 scalars
    index.write_text(json.dumps(data, indent=2, sort_keys=True))


def _stored(path: Path) -> dict[str, torch.Tensor]:
    """Every KV-cache scale the checkpoint's index lists, in kv_scales.safetensors or any shard
    (vLLM's and llm-compressor's storage), only those shards opened. A kv_scales.safetensors the
    index does not list is left from an earlier run into the same folder, and not read."""
    index = path / INDEX_FILE
    files: dict[str, list[str]] = {}
    if not index.exists():  # a single-file checkpoint; `save` makes it an indexed one
        return {}
    for name, file in json.loads(index.read_text()).get("weight_map", {}).items():
        if _SCALE.search(name):
            files.setdefault(file, []).append(name)
    stored: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with safe_open(str(path / file), framework="pt") as f:
            stored |= {k: f.get_tensor(k) for k in names}
    return stored


def _value(stored: dict[str, torch.Tensor], key: str, where: Path) -> float:
    """One per-tensor scale; an older checkpoint's single `kv_scale` stands for both k and v."""
    legacy = _SCALE.sub(".kv_scale", key) if not key.endswith(".indexer.k_scale") else key
    t = stored.get(key, stored.get(legacy))
    if t is None:
        raise CheckpointError(f"{where} has no {key}")
    if t.numel() != 1:
        raise CheckpointError(
            f"{where}: {key} has shape {tuple(t.shape)}; only per-tensor KV scales are served"
        )
    value = float(t)
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{where}: {key} is {value}, not a positive finite scale")
    return value


def read(path: str | Path, specs: list[list[str]], prefix: str = "") -> list[dict[str, float]] | None:
    """The stored scales for every layer's cached tensors (`specs[l]` = their names), or None when
    the checkpoint carries none."""
    path = Path(path)
    stored = _stored(path)
    if not stored:
        return None
    return [
        {name: _value(stored, scale_names(layer, name, prefix)[0], path) for name in names}
        for layer, names in enumerate(specs)
    ]


def scales_for_serving(
    path: str | Path,
    model: nn.Module,
    *,
    model_dtype: torch.dtype,
    vocab_size: int,
    prefix: str | None = None,
) -> list[dict[str, float]]:
    """FP8 KV scales for serving `path`: the stored ones, else calibrated now with a warning.
    `prefix` (checkpoint names' prefix, `language_model.` for K2.5) defaults to the model config's."""
    if prefix is None:
        prefix = getattr(getattr(model, "config", None), "weight_prefix", "")
    specs = [[s.name for s in layer] for layer in model.cache_specs()]  # type: ignore[operator]
    stored = read(path, specs, prefix)
    if stored is not None:
        return stored
    log.warning(
        "%s ships no FP8 KV-cache scales (%s): calibrating on %d built-in prompts; "
        "run `kumo quantize --kv-calibrate FILE` for scales from your own traffic",
        path,
        KV_SCALE_FILE,
        len(BUILTIN_PROMPTS),
    )
    return calibrate(model, builtin_prompt_ids(path, vocab_size), model_dtype=model_dtype)
