"""A random-weight model of a `Geometry`, built directly on the target device in one weight format.

No checkpoint touches the disk: the model is built on the meta device, the targeted Linears and
routed experts are swapped for empty quantized modules (`backend.quant.walker`, as the loader does),
storage is given on the device, and every tensor is filled in place there:

    float weights      N(0, 0.02)            norms 1, biases 0 (router selection bias too)
    INT4 weight_packed uniform int32 bits    every nibble uniform in [-8, 7]; weight_scale 0.02 / 4.6
    FP8 weight         N(0, 1) as e4m3       per-channel / block scales 0.02

so every format has weights of about the same spread, and the router (float32, N(0, 0.02) over
N(0, 1)-normed inputs) picks experts near uniformly. MLA's kv_b_proj is then made dense, as after
a checkpoint load (`dequantize_after_load`), and the Linears reading the same input fused as the
loader fuses them (`fuse_projections`, unless told not to).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from backend.models import ARCHITECTURES
from backend.models.layers import fused
from backend.quant.scheme import QuantScheme
from backend.quant.walker import dequantize_after_load, prepare_for_checkpoint
from benchmarks.engine.geometry import INT4_GROUP, Geometry, WeightFormat
from kernels.formats.fp8 import FP8

INIT_STD = 0.02
INT4_STD = 4.6  # std of a uniform integer in [-8, 7]


def scheme_for(fmt: WeightFormat, fp8_method: str = "fp8-block") -> QuantScheme | None:
    if fmt == "bf16":
        return None
    if fmt in ("fp8", "fp8-all"):
        return QuantScheme.build(fp8_method, all_linear=fmt == "fp8-all")  # type: ignore[arg-type]
    return QuantScheme.build("int4", group_size=INT4_GROUP, all_linear=fmt == "int4-all")


def build_random_model(
    geometry: Geometry,
    fmt: WeightFormat,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    fp8_method: str = "fp8-block",
    num_mtp_layers: int = 0,
    rank: int = 0,
    ep: int = 0,
    fuse_projections: bool = True,
) -> nn.Module:
    """The truncated model of `geometry` in `fmt`, random, on `device`, in eval mode; with
    `num_mtp_layers` random MTP layers (speculative decoding's cost, not its acceptance); with
    `geometry.rank_of` N > 1 rank `rank`'s slice of N ranks, experts over `ep` groups (0: N) and the
    latent cache over `geometry.dcp` ranks (the process group must exist: `rank_of` or `tp_group`)."""
    config = geometry.model_config
    if num_mtp_layers:
        config = dataclasses.replace(config, num_nextn_predict_layers=num_mtp_layers)
    cls = ARCHITECTURES[config.architecture]
    scheme = scheme_for(fmt, fp8_method)
    with torch.device("meta"):  # the swapped-in quantized modules too: no host allocation at all
        model = cls(  # type: ignore[call-arg]
            config, dtype=dtype, rank=rank, world_size=geometry.rank_of, ep=ep, dcp=geometry.dcp,
            num_mtp_layers=num_mtp_layers,
        )  # fmt: skip
        if scheme is not None:
            prepare_for_checkpoint(model, scheme)
    model.to_empty(device=device)
    with torch.device(device):  # the rotary table is a computed buffer: the meta build has none
        model.rotary = type(model.rotary)(config.rope)  # type: ignore[operator]
        for attn in model.attentions():  # type: ignore[operator]
            attn.rotary = [model.rotary]
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random(model, gen)
    dequantize_after_load(model)
    if fuse_projections:
        fused.fuse_projections(model)
    return model.eval()


@torch.no_grad()
def fill_random(model: nn.Module, gen: torch.Generator) -> None:
    for name, t in model.state_dict(keep_vars=True).items():
        leaf = name.rpartition(".")[2]
        if leaf == "weight_shape":
            continue  # set below from the module
        if leaf == "bias" or leaf == "e_score_correction_bias":
            t.zero_()
        elif "norm" in name:
            t.fill_(1.0)
        elif t.dtype == torch.int32:  # INT4 planes: 8 uniform nibbles per int32
            t.random_(-(2**31), 2**31 - 1, generator=gen)
        elif t.dtype == FP8:
            _fill_fp8(t, gen)
        elif "scale" in leaf:  # INT4 bf16 group scales, FP8 fp32 channel / block scales
            t.fill_(INIT_STD / INT4_STD if t.dtype == torch.bfloat16 else INIT_STD)
        elif t.is_floating_point():
            t.normal_(0.0, INIT_STD, generator=gen)
        else:
            raise ValueError(f"no random fill for {name} ({t.dtype})")
    for m in model.modules():
        if hasattr(m, "weight_shape"):
            m.weight_shape.copy_(torch.tensor([m.out_features, m.in_features], dtype=torch.int32))


def _fill_fp8(t: torch.Tensor, gen: torch.Generator) -> None:
    """N(0, 1) rounded to e4m3, one leading-dim slice at a time (no full-size float temporary)."""
    for part in t.view(-1, t.shape[-1]).split(4096):
        part.copy_(torch.randn(part.shape, generator=gen, device=t.device, dtype=torch.bfloat16))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (what a checkpoint load would hold)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def planned_weight_bytes(geometry: Geometry, fmt: WeightFormat, fp8_method: str = "fp8-block") -> int:
    """`weight_bytes` of the model `build_random_model` would make, computed on the meta device."""
    config = geometry.model_config
    scheme = scheme_for(fmt, fp8_method)
    with torch.device("meta"):
        model = ARCHITECTURES[config.architecture](config, dtype=torch.bfloat16)
        if scheme is not None:
            prepare_for_checkpoint(model, scheme)
    total = weight_bytes(model)
    for name, m in model.named_modules():  # kv_b_proj is held dense after the load
        if (
            name.endswith("kv_b_proj")
            and not hasattr(m, "weight")
            or name.endswith("kv_b_proj")
            and m.weight.dtype != torch.bfloat16
        ):
            total += m.in_local * m.out_local * 2 - sum(
                t.numel() * t.element_size() for t in m.state_dict().values()
            )
    return total
