"""The benchmark's model geometry: published per-layer shapes at a truncated depth, and a KV pool
sized as the full deployment would have it.

`Geometry` holds the config the truncated model is built from (the published text config of
`models/configs/<kind>/`, with `num_hidden_layers` cut to `num_layers`, one dense layer first and
MoE layers after, no MTP layer) and the config `kumo plan` is run on (the full published one).

KV sizing follows `backend.tools.plan.make_plan` on the full model at tensor parallelism 8 on 141 GB
H200s, in the variant's weight format and KV dtype: `kv_tokens` is how many tokens each GPU's pool
holds for all 78 (GLM 5.2) or 61 (Kimi K2.6) layers; the truncated model gets the same number of
tokens per layer, so its pages run out at the concurrency where the full deployment's would.

`--tiny` swaps in `backend.tools.random_checkpoint.small_config` (same architecture, small sizes) and a
GPU of `TINY_GPU_MEM` bytes, so the whole pipeline runs on a CPU in seconds.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

from backend.models.model_config import ModelConfig
from backend.tools.plan import GB, Plan, make_plan
from backend.tools.random_checkpoint import PUBLISHED_CONFIGS, small_config

Kind = Literal["glm-5.2", "kimi-k2.6"]
# "fp8" / "int4": the routed experts only (as Kimi K2 Thinking ships INT4), the rest BF16; "-all": every
# Linear but the routers and lm_head (as DeepSeek's FP8 checkpoints are, and GLM 5.2's INT4 at 421 GB about is)
WeightFormat = Literal["bf16", "fp8", "int4", "int4-all", "fp8-all"]
KvDtype = Literal["bf16", "fp8"]
KINDS: tuple[Kind, ...] = ("glm-5.2", "kimi-k2.6")
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("bf16", "fp8", "int4", "int4-all", "fp8-all")
H200_MEM = 141 * GB
FULL_TP = 8
TINY_GPU_MEM = 48 * 2**20
TINY_VOCAB = 512
INT4_GROUP = 32


def plan_weights(fmt: WeightFormat, fp8_method: str) -> tuple[str, bool]:
    """Our format name → (`kumo plan --weights`, `--all-linear`)."""
    return {
        "bf16": ("bf16", False),
        "fp8": (fp8_method, False),
        "int4": (f"int4-g{INT4_GROUP}", False),
        "int4-all": (f"int4-g{INT4_GROUP}", True),
        "fp8-all": (fp8_method, True),
    }[fmt]


@dataclass(frozen=True, slots=True)
class KvSizing:
    """The full model's per-GPU KV pool (from `kumo plan`) as pages of the truncated model."""

    kv_tokens: int  # tokens each layer can hold = the full model's kv_tokens per GPU
    num_pages: int
    page_size: int
    plan_weights_per_gpu: int  # full model, per GPU, bytes
    plan_kv_pool_bytes: int  # full model, per GPU, all layers
    plan_kv_bytes_per_token: int  # full model, per GPU, all layers
    plan_weights: str  # the format `kumo plan` was run with (bf16 weights: see `Geometry.kv_sizing`)
    plan_kv_dtype: str
    gpu_mem: int
    tp: int

    def max_concurrency(self, tokens_per_request: int) -> int:
        """Requests of `tokens_per_request` that fit the pool at once (whole pages each)."""
        pages = -(-tokens_per_request // self.page_size)
        return self.num_pages // pages


@dataclass(frozen=True, slots=True)
class Geometry:
    kind: Kind
    num_layers: int
    is_tiny: bool
    text: dict[str, Any]  # the truncated text config the model is built from
    full: dict[str, Any]  # the published config `kumo plan` is run on (tiny: the small one)
    rank_of: int = 1  # > 1: rank 0's slice of `rank_of` ranks is built (benchmarks/engine/rank_of.py)
    dcp: int = 1  # ranks sharing one MLA latent cache by token (the pool's pages hold page_size·dcp tokens)

    @property
    def plan_tp(self) -> int:
        """The GPUs the KV pool is planned for: the deployment's 8, or `rank_of`."""
        return self.rank_of if self.rank_of > 1 else FULL_TP

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.text)

    @property
    def full_num_layers(self) -> int:
        return int(_text(self.full)["num_hidden_layers"])

    def kv_sizing(
        self, fmt: WeightFormat, kv_dtype: KvDtype, *, page_size: int = 16, fp8_method: str = "fp8-block"
    ) -> KvSizing:
        """The full model's per-GPU pool in this format. Where the full model in this format does not
        fit 8 H200s at all (BF16 for both; FP8 for Kimi K2.6's 1T parameters), the variant gets the
        pool of the first format that does, FP8 then INT4 experts; `plan_weights` records which."""
        weights, all_linear = plan_weights(fmt, fp8_method)
        gpu_mem = TINY_GPU_MEM if self.is_tiny else H200_MEM
        plan = self._plan(weights, all_linear, kv_dtype, gpu_mem, page_size)
        for fallback in (fp8_method, f"int4-g{INT4_GROUP}"):
            if plan.kv_tokens <= 0:
                plan = self._plan(fallback, False, kv_dtype, gpu_mem, page_size)
        if plan.kv_tokens <= 0:
            raise ValueError(f"kumo plan leaves no KV pool for {self.kind} {weights} on {self.plan_tp} GPUs")
        return KvSizing(
            kv_tokens=plan.kv_tokens,
            num_pages=plan.kv_tokens // (page_size * self.dcp),
            page_size=page_size * self.dcp,  # an engine page: page_size tokens on each DCP rank
            plan_weights_per_gpu=plan.weights_per_gpu,
            plan_kv_pool_bytes=plan.kv_pool_bytes,
            plan_kv_bytes_per_token=plan.kv_bytes_per_token,
            plan_weights=plan.weights,
            plan_kv_dtype=kv_dtype,
            gpu_mem=gpu_mem,
            tp=self.plan_tp,
        )

    def _plan(self, weights: str, all_linear: bool, kv_dtype: KvDtype, gpu_mem: int, page_size: int) -> Plan:
        full = json.dumps(self.full, sort_keys=True)
        return _plan(
            full, self.kind, weights, all_linear, kv_dtype, gpu_mem, page_size, self.plan_tp, self.dcp
        )

    def describe(self) -> dict[str, Any]:
        t = self.text
        keys = (
            "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "n_shared_experts", "vocab_size", "index_n_heads", "index_head_dim",
            "index_topk",
        )  # fmt: skip
        return {
            "kind": self.kind,
            "architecture": t["architectures"][0],
            "num_layers": self.num_layers,
            "full_num_layers": self.full_num_layers,
            "dense_layers": int(t["first_k_dense_replace"]),
            "is_tiny": self.is_tiny,
            "rank_of": self.rank_of,
            "dcp": self.dcp,
            "routing": "random router weights: expert choice is near uniform (no trained load imbalance)",
            **{k: t[k] for k in keys if k in t},
        }


def make_geometry(
    kind: Kind, num_layers: int | None, *, tiny: bool = False, rank_of: int = 1, dcp: int = 1
) -> Geometry:
    """The truncated geometry of `kind`: one dense layer, then `num_layers - 1` MoE layers. With
    `rank_of` N > 1: rank 0's slice of N ranks, at the full depth and its own dense layers unless
    `num_layers` truncates it; `dcp` of them sharing one MLA latent cache by token."""
    published = json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text())
    if num_layers is None:
        num_layers = int(_text(published)["num_hidden_layers"])
    if num_layers < 2:
        raise ValueError("at least 2 layers: one dense, one MoE")
    full = {k: v for k, v in published.items() if not k.startswith("_")}
    if tiny:  # the small text model alone (a small vision tower would still outweigh it)
        small = small_config(published, vocab_size=TINY_VOCAB, bos=None, eos=[0])
        full = dict(_text(small), architectures=_text(small).get("architectures", small["architectures"]))
    text = copy.deepcopy(_text(full))
    text.pop("quantization_config", None)
    text.pop("mlp_layer_types", None)
    text.pop("indexer_types", None)
    text.pop("index_topk_pattern", None)
    if "architectures" not in text:
        text["architectures"] = full["architectures"]
    full_depth = int(text["num_hidden_layers"])
    dense = text.get("first_k_dense_replace", 1) if rank_of > 1 and num_layers >= full_depth else 1
    text |= {"num_hidden_layers": num_layers, "first_k_dense_replace": dense, "num_nextn_predict_layers": 0}
    if tiny:  # keep the full plan honest for the small model too: plan on its whole depth
        _text(full)["num_hidden_layers"] = max(int(_text(full)["num_hidden_layers"]), num_layers)
    return Geometry(
        kind=kind, num_layers=num_layers, is_tiny=tiny, text=text, full=full, rank_of=rank_of, dcp=dcp
    )


@functools.lru_cache(maxsize=64)
def _plan(
    full: str,
    kind: str,
    weights: str,
    all_linear: bool,
    kv_dtype: KvDtype,
    gpu_mem: int,
    page_size: int,
    tp: int,
    dcp: int = 1,
) -> Plan:
    """`make_plan` of a config (as JSON text, so it can key the cache: a plan walks every tensor)."""
    return make_plan(
        json.loads(full),
        model=kind,
        gpu_mem=gpu_mem,
        tp=tp,
        weights=weights,  # type: ignore[arg-type]
        all_linear=all_linear,
        kv_dtype=kv_dtype,
        page_size=page_size,
        dcp=dcp,
    )


def _text(config: dict[str, Any]) -> dict[str, Any]:
    text: dict[str, Any] = config.get("text_config", config)
    return text
