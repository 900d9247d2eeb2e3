"""load_model: a checkpoint folder → the architecture's module with this rank's weights loaded;
prepare_model: a loaded model → what the engine takes (`PreparedModel`), so the engine never needs
to know about quantization."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backend.engine.engine import PreparedModel
from backend.engine.engine_config import EngineConfig
from backend.errors import CheckpointError
from backend.models import ARCHITECTURES
from backend.models.checkpoint import iter_tensors
from backend.models.layers import fused
from backend.models.model_config import ModelConfig
from backend.quant.kv_scales import scales_for_serving, without_kv_scales
from backend.quant.linear import set_int4_prefill
from backend.quant.walker import build_for_checkpoint, dequantize_after_load, read_scheme


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    path: Path


def num_mtp_layers_in(path: str | Path, draft: str | Path | None = None) -> int:
    """The MTP layers a checkpoint ships (`num_nextn_predict_layers`), or a separate draft folder."""
    if draft is None:
        return ModelConfig.from_pretrained(path).num_nextn_predict_layers
    try:
        config = json.loads((Path(draft) / "config.json").read_text())
        return int(config.get("text_config", config)["num_nextn_predict_layers"])  # K2.5: text_config
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{draft}: no config.json giving num_nextn_predict_layers") from exc


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    rank: int = 0,
    world_size: int = 1,
    ep: int = 0,
    dcp: int = 1,
    num_mtp_layers: int = 0,
    draft: str | Path | None = None,
    fuse_projections: bool = True,
) -> LoadedModel:
    """`rank` of `world_size` tensor-parallel ranks; `ep` expert groups (0: = world_size) and `dcp`
    ranks sharing one MLA latent cache by token, as backend/models/layers/parallel.py lays them out. With
    dcp > 1 every rank must call this together (it makes the DCP process groups). `num_mtp_layers`:
    the checkpoint's MTP layers to load too (speculative decoding; backend/models/mtp.py). `draft`: a
    folder shipping them apart from the checkpoint (Kimi K2 ships none): their tensors under the
    names they would have in it (`model.layers.{num_hidden_layers + i}.*`, in the same format), and a
    config.json giving `num_nextn_predict_layers`. `fuse_projections`: once loaded, the Linears that
    read the same input run as one product (backend/models/layers/fused.py; False: as the checkpoint
    names them, e.g. to measure what the fusion saves, or to read a layer's weights by its name)."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if draft is not None:
        config = dataclasses.replace(config, num_nextn_predict_layers=num_mtp_layers_in(path, draft))
    cls = ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise CheckpointError(f"unknown architecture {config.architecture!r}")
    # a quantized checkpoint (config.json's quantization_config): the quantized modules are built in
    # place of the dense ones, and the FP8 KV-cache scales kept out of the weight stream (backend/quant/)
    scheme = read_scheme(path)

    def make() -> nn.Module:
        return cls(
            config,
            dtype=dtype,
            rank=rank,
            world_size=world_size,
            ep=ep,
            dcp=dcp,
            num_mtp_layers=num_mtp_layers,
        )

    if scheme is None:
        with torch.device(device):
            model = make()
    else:
        model = build_for_checkpoint(make, scheme, device)
    # a rank reads only what it keeps (not the other ranks' experts, nor unloaded MTP or vision tensors)
    keep = getattr(model, "wants_tensor", None)
    weights = iter_tensors(path, keep=keep)
    if draft is not None:
        weights = itertools.chain(weights, iter_tensors(draft, keep=keep))
    model.load_weights(without_kv_scales(weights))  # type: ignore[operator]
    if scheme is not None:
        dequantize_after_load(model)
    if fuse_projections:
        fused.fuse_projections(model)
    return LoadedModel(model=model.eval(), config=config, path=path)


def prepare_model(
    loaded: LoadedModel, config: EngineConfig, *, model_dtype: torch.dtype | None = None
) -> PreparedModel:
    """`loaded` made ready for an engine under `config`: its INT4 Linears set to run prefill as
    `config.int4_prefill` says, and with an FP8 cache the per-layer KV scales from the checkpoint
    (calibrated, with a warning, when it ships none): never a silent 1.0. `model_dtype` defaults to
    the dtype of the model's first parameter."""
    weight = next(loaded.model.parameters())
    dtype = model_dtype or weight.dtype
    set_int4_prefill(loaded.model, config.int4_prefill)
    kv_scales = None
    if config.kv_dtype == "float8_e4m3fn":
        kv_scales = scales_for_serving(
            loaded.path, loaded.model, model_dtype=dtype, vocab_size=loaded.config.vocab_size
        )
    return PreparedModel(
        model=loaded.model,  # type: ignore[arg-type]
        vocab_size=loaded.config.vocab_size,
        context_window=loaded.config.max_position_embeddings,
        model_dtype=dtype,
        device=weight.device,
        kv_scales=kv_scales,
    )
