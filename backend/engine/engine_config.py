"""The engine's settings: one frozen object, built once (from the command line by the serving layer)
and passed down to the block manager, scheduler and model runner.

Limits are `Annotated[..., Meta(...)]` aliases, validated by `EngineConfig.build` through msgspec.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.backend import MAX_DRAFT_TOKENS

PageSize = Annotated[int, Meta(ge=1, le=1024)]
NumPages = Annotated[int, Meta(ge=1, le=1 << 24)]
TokenBudget = Annotated[int, Meta(ge=1, le=1 << 20)]
NumSeqs = Annotated[int, Meta(ge=1, le=1 << 14)]
ContextWindow = Annotated[int, Meta(ge=1, le=1 << 24)]
TenantShare = Annotated[float, Meta(gt=0.0, le=1.0)]
KVDtype = Literal["auto", "bfloat16", "float8_e4m3fn"]
# How INT4 Linears run prefill-sized products on CUDA (`backend.quant.linear.Int4Linear`): W4A16 (the
# default), W4A8 (FP8 tensor cores, exact INT4 weights, activations per token in FP8:
# kernels/w4a8_gemm.py) or expand-fp8 (weights re-quantized to per-channel FP8 in scratch, then
# `torch._scaled_mm`: kernels/w4a8_expand.py)
Int4Prefill = Literal["w4a16", "w4a8", "expand-fp8"]


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the engine shares one page pool among requests.

    `max_num_batched_tokens` is the per-step token budget (decodes first, then prefill chunks);
    it must leave room for every running decode, so it is at least `max_num_seqs`.
    `context_window` overrides the checkpoint's window for this served model (None: the model's).
    `seed` seeds the generators of requests that do not bring their own seed (None: from the
    operating system's entropy, so a restarted server does not replay the same samples).
    `check_page_tags` False skips the KV page-tag check in every op (no tag is read, no mismatch is
    flagged): only for measuring what the check costs (`kumo bench engine integrity`), never to serve.
    `int4_prefill` picks how INT4 Linears run prefill products on CUDA (`backend.quant.linear`):
    "w4a16" (the default until the H200 numbers decide), "w4a8" or "expand-fp8" (FP8 tensor cores);
    the model is set up for it before the engine gets it (`backend.models.loader.prepare_model`).
    `cuda_graphs` replays pure-decode steps from CUDA graphs (on a CUDA device only; the CPU never
    captures), one per batch size in `cuda_graph_batch_sizes` (None: `default_graph_batch_sizes`);
    sizes above `max_num_seqs` are dropped.
    `tenant_share` is the most of the page pool and of `max_num_seqs` one tenant (a prefix-cache
    salt) may hold while another tenant, under its own share, waits (1.0: no cap).
    `num_speculative_tokens` K > 0 drafts K tokens per step with the model's MTP layers
    (`--speculative mtp:K`, backend/engine/speculative/decoder.py) while at most `speculative_max_seqs`
    sequences run; past that, steps run without drafts (verifying them stops paying at high batch).
    Below it, with `speculative_adaptive`, each step drafts the k in 0 … K that its load and the
    measured acceptance make pay (backend/engine/speculative/policy.py: a forward's cost is flat up to
    `speculative_saturation_rows` rows, then linear; one MTP forward costs `speculative_draft_cost`
    target forwards; None: measured from the steps' times, starting from 1 / the model's decoder
    layers); without it, always K.
    """

    page_size: PageSize = 16
    num_pages: NumPages = 1024
    kv_dtype: KVDtype = "auto"
    max_num_batched_tokens: TokenBudget = 2048
    max_num_seqs: NumSeqs = 64
    context_window: ContextWindow | None = None
    enable_prefix_cache: bool = True
    check_page_tags: bool = True
    int4_prefill: Int4Prefill = "w4a16"
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[NumSeqs, ...] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    tenant_share: TenantShare = 0.5
    num_speculative_tokens: Annotated[int, Meta(ge=0, le=MAX_DRAFT_TOKENS)] = 0
    speculative_max_seqs: NumSeqs = 16
    speculative_adaptive: bool = True
    speculative_saturation_rows: TokenBudget = 64
    speculative_draft_cost: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    # verify and draft steps from CUDA graphs (backend/engine/speculative/verify_graphs.py). Their replays
    # pass on the H200 since the graphs own the index tensors they read (test_speculative_cuda.py,
    # 2026-12-04; before, a replay read tensors freed after capture and hit a device-side index assert).
    # Eager, a nano model's speculative step took 17-24 ms against 0.9 ms for a plain graphed step.
    speculative_graphs: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so running decodes always fit a step"
            )

    def graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes captured, ascending, all <= max_num_seqs (largest is max_num_seqs
        when the defaults apply, so every decode step fits one)."""
        sizes = self.cuda_graph_batch_sizes or default_graph_batch_sizes(self.max_num_seqs)
        return sorted({s for s in sizes if s <= self.max_num_seqs})

    @classmethod
    def build(cls, **values: Any) -> EngineConfig:
        """Validate every limit (msgspec raises `ValidationError` naming the field)."""
        return msgspec.convert(values, cls)

    def torch_kv_dtype(self, model_dtype: Any) -> Any:
        """The torch dtype of the cache: `auto` is the model's own dtype."""
        import torch

        if self.kv_dtype == "auto":
            return model_dtype
        return getattr(torch, self.kv_dtype)


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including `max_num_seqs`."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]
