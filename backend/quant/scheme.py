"""Which Linears are quantized, and how: the `quantization_config` block of config.json.

Two on-disk dialects are read and written:
- compressed-tensors (`quant_method: compressed-tensors`), as Kimi K2 Thinking ships it: config
  groups with `targets` (class names such as `Linear`, or `re:`-prefixed regexes over module
  names), one `ignore` list, weight args (`num_bits`, `type`, `strategy`, `group_size`, …). Used
  for INT4 (`pack-quantized`) and per-channel FP8 (`float-quantized`).
- DeepSeek-V3's own FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`), whose quantized
  Linears carry `weight_scale_inv`.

Matching follows compressed-tensors: a `re:` target matches with `re.match` on the module name,
any other target matches the name exactly or the module's class name; ignore wins.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Method = Literal["int4", "fp8-channel", "fp8-block"]
GroupSize = Annotated[int, Meta(ge=8, le=4096, multiple_of=8)]

# Kimi K2 Thinking's list (routed experts only), plus the router: Kumo's router is a plain Linear,
# where Moonshot's remote code has a custom class the `Linear` target never matched.
ROUTER = r"re:.*mlp\.gate$"
# K2.5/K2.6 nest it under `language_model.`; an MTP layer's `shared_head.head` is an lm_head too
LM_HEAD = r"re:(.*\.)?(lm_head|shared_head\.head)$"
NOT_TEXT = ("re:.*vision_tower.*", "re:.*mm_projector.*")
ROUTED_EXPERTS_IGNORE = (
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ROUTER,
    LM_HEAD,
    *NOT_TEXT,
)
ALL_LINEAR_IGNORE = ("lm_head", ROUTER, LM_HEAD, *NOT_TEXT)
# Read as matrices by the model rather than called (MLA's weight absorption views kv_b_proj as
# W_UK / W_UV), so they run dense: dequantized once after loading, as vLLM does.
READ_AS_MATRIX = ("kv_b_proj",)


class _Block(msgspec.Struct, omit_defaults=False, kw_only=True):
    """config.json blocks: unknown keys kept out of the way (real files carry more), defaults written."""


class WeightArgs(_Block):
    num_bits: int
    type: Literal["int", "float"]
    strategy: Literal["group", "channel", "block", "tensor"]
    symmetric: bool = True
    group_size: int | None = None
    block_structure: list[int] | None = None
    dynamic: bool = False
    observer: str | None = "minmax"
    observer_kwargs: dict[str, Any] = {}
    actorder: str | None = None


class ConfigGroup(_Block):
    targets: list[str]
    weights: WeightArgs
    input_activations: dict[str, Any] | None = None
    output_activations: dict[str, Any] | None = None
    format: str | None = None


class KvCacheScheme(_Block):
    num_bits: int = 8
    type: Literal["float"] = "float"
    strategy: Literal["tensor"] = "tensor"
    dynamic: bool = False
    symmetric: bool = True


class CompressedTensorsConfig(_Block, tag="compressed-tensors", tag_field="quant_method"):
    config_groups: dict[str, ConfigGroup]
    format: str
    ignore: list[str] = []
    kv_cache_scheme: KvCacheScheme | None = None
    quantization_status: str = "compressed"


class DeepSeekFp8Config(_Block, tag="fp8", tag_field="quant_method"):
    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic"] = "dynamic"
    weight_block_size: list[int] = msgspec.field(default_factory=lambda: [128, 128])
    modules_to_not_convert: list[str] | None = None


QuantizationConfig = CompressedTensorsConfig | DeepSeekFp8Config


class QuantScheme(msgspec.Struct, frozen=True, kw_only=True):
    """What `kumo quantize` writes and the loader builds: one method for every targeted Linear."""

    method: Method
    group_size: GroupSize = 32
    block: tuple[int, int] = (128, 128)
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ROUTED_EXPERTS_IGNORE
    kv_cache_fp8: bool = False
    # fp8-block: DeepSeek's files name the block scales `weight_scale_inv`, compressed-tensors'
    # (strategy block, as llm-compressor's FP8_BLOCK writes them) `weight_scale`; same meaning
    block_scale_name: Literal["weight_scale_inv", "weight_scale"] = "weight_scale_inv"

    @classmethod
    def build(
        cls, method: Method, *, group_size: int = 32, all_linear: bool = False, kv_cache_fp8: bool = False
    ) -> QuantScheme:
        ignore = ALL_LINEAR_IGNORE if all_linear else ROUTED_EXPERTS_IGNORE
        return cls(method=method, group_size=group_size, ignore=ignore, kv_cache_fp8=kv_cache_fp8)

    def applies_to(self, module_name: str, class_name: str = "Linear") -> bool:
        if any(_matches(t, module_name, class_name) for t in self.ignore):
            return False
        return any(_matches(t, module_name, class_name) for t in self.targets)

    def to_config(self) -> QuantizationConfig:
        if self.method == "fp8-block":
            return DeepSeekFp8Config(
                weight_block_size=list(self.block), modules_to_not_convert=list(self.ignore)
            )
        if self.method == "int4":
            weights = WeightArgs(num_bits=4, type="int", strategy="group", group_size=self.group_size)
            fmt = "pack-quantized"
        else:
            weights = WeightArgs(num_bits=8, type="float", strategy="channel")
            fmt = "float-quantized"
        return CompressedTensorsConfig(
            config_groups={"group_0": ConfigGroup(targets=list(self.targets), weights=weights, format=fmt)},
            format=fmt,
            ignore=list(self.ignore),
            kv_cache_scheme=KvCacheScheme() if self.kv_cache_fp8 else None,
        )


def _matches(target: str, module_name: str, class_name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module_name) is not None
    return target in (module_name, class_name)


def parse_config(raw: dict[str, Any]) -> QuantizationConfig:
    """The `quantization_config` dict of a config.json -> a typed block (msgspec names bad fields)."""
    config: QuantizationConfig = msgspec.convert(raw, QuantizationConfig, strict=False)
    return config


def scheme_from_config(config: QuantizationConfig) -> QuantScheme:
    """A checkpoint's block -> the scheme the loader builds modules from.

    Kumo serves one weight method per checkpoint; a compressed-tensors file with several groups of
    different methods is refused rather than half-loaded.
    """
    if isinstance(config, DeepSeekFp8Config):
        ignore = tuple(config.modules_to_not_convert or ALL_LINEAR_IGNORE)
        b0, b1 = config.weight_block_size
        return QuantScheme(method="fp8-block", block=(b0, b1), ignore=ignore)
    groups = list(config.config_groups.values())
    methods = {_method(g.weights) for g in groups}
    if len(methods) != 1:
        raise ValueError(f"one weight method per checkpoint, found {sorted(methods)}")
    w = groups[0].weights
    targets = tuple(t for g in groups for t in g.targets)
    method = methods.pop()
    return QuantScheme(
        method=method,
        group_size=w.group_size or 32,
        block=tuple(w.block_structure or (128, 128)),  # type: ignore[arg-type]
        targets=targets,
        ignore=tuple(config.ignore),
        kv_cache_fp8=config.kv_cache_scheme is not None,
        block_scale_name="weight_scale" if method == "fp8-block" else "weight_scale_inv",
    )


def _method(w: WeightArgs) -> Method:
    if w.actorder == "group":  # GPTQ activation order: a `weight_g_idx` permutes the groups
        raise ValueError("actorder 'group' (weight_g_idx) is not supported; use a checkpoint without it")
    if w.type == "int" and w.num_bits == 4 and w.strategy == "group" and w.symmetric:
        if w.group_size is None:
            raise ValueError("INT4 weights with strategy group need a group_size")
        return "int4"
    if w.type == "float" and w.num_bits == 8 and w.strategy == "channel":
        return "fp8-channel"
    if w.type == "float" and w.num_bits == 8 and w.strategy == "block":
        return "fp8-block"
    raise ValueError(f"unsupported weight quantization {msgspec.json.encode(w).decode()}")


def config_dict(scheme: QuantScheme) -> dict[str, Any]:
    """The block as config.json should carry it."""
    block: dict[str, Any] = msgspec.to_builtins(scheme.to_config())
    return block


# Per-tensor names, shared by the loader, the walker and `kumo quantize`.
TENSOR_NAMES: dict[Method, tuple[str, ...]] = {
    "int4": ("weight_packed", "weight_scale", "weight_shape"),
    "fp8-channel": ("weight", "weight_scale"),
    "fp8-block": ("weight", "weight_scale_inv"),
}
