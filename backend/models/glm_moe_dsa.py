"""GLM-5 / 5.2 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's MLA and MoE plus DeepSeek Sparse Attention.

A layer whose `indexer_types` entry is "full" runs the indexer: its own projections (`wq_b` from the
q LoRA activation, `wk` + LayerNorm from the hidden state, per-head `weights_proj` in float32),
interleaved RoPE on the first rope dims, keys cached in pages ("index_k"), and it picks the top
`index_topk` visible tokens per query. A "shared" layer reuses the last full layer's choice. MLA
attention then reads only the chosen tokens. The indexer is small and replicated on every rank; under
DCP its key cache is sharded by token like the latent cache (backend/models/layers/context_parallel.py).

A step whose sequences are all at most `index_topk` tokens long (`Step.table_tokens`, known on the
host) keeps every visible key, as the reference's top-k does: its layers cache their indexer keys
but score nothing and select nothing, and MLA runs dense (the same keys; the sum in another order:
the sparse kernel's slices and tiles differ, so the outputs agree to rounding, not to the bit). The
top-k alone was 0.37 ms of a 3.9 ms decode step at concurrency 1 and ~2k tokens (H200, 2026-12-04).
The decode graphs capture a narrow page table for these steps (`GlmMoeDsaForCausalLM.dense_context`).

Shape letters: T tokens, Hi indexer heads, Di indexer head dim, Q q_lora_rank, K index_topk.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.engine.forward_batch import CacheSpec
from backend.errors import CheckpointError
from backend.models.causal_lm import CausalLM
from backend.models.deepseek_v3 import MLAAttention
from backend.models.layers.context_parallel import dcp_indexer_topk
from backend.models.layers.linear import Linear, Shard
from backend.models.layers.rotary import Rotary
from backend.models.layers.step import Step
from backend.models.model_config import ModelConfig
from kernels.dsa_indexer import DsaIndexerArgs, dsa_indexer

INDEXER_NORM_EPS = 1e-6  # the reference LayerNorm's eps; not in config.json


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        if config.q_lora_rank is None:
            raise CheckpointError("the DSA indexer needs q_lora_rank in config.json")
        self.layer_idx = layer_idx
        self.Hi, self.Di, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.Hi * self.Di, dtype=dtype)
        self.wk = Linear(config.hidden_size, self.Di, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.Di, eps=INDEXER_NORM_EPS, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, self.Hi, dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, wk_x: torch.Tensor, step: Step, rotary: Rotary
    ) -> torch.Tensor | None:
        """x [T, H], q_resid [T, Q], wk_x = wk(x) [T, Di] (the attention computes it with its other
        Linears reading x) → chosen token indices [T, K] (-1 = none); None: every visible token (no
        sequence of the step is longer than K)."""
        T = x.shape[0]
        k = rotary.rotate(self.k_norm(wk_x).view(T, 1, self.Di), step.cos, step.sin).view(T, self.Di)
        step.write(self.layer_idx, "index_k", k)  # later, longer steps score these keys
        if step.table_tokens <= self.topk:
            return None
        q = rotary.rotate(self.wq_b(q_resid).view(T, self.Hi, self.Di), step.cos, step.sin)  # [T, Hi, Di]
        # [T, Hi] float32, the reference's weights before `* Hi**-0.5`: the float32 layer widens x
        # itself (an INT4 one in its decode GEMV's loads: no cast launch)
        weights = self.weights_proj(x)
        kv = step.batch.kv_cache
        if step.dcp is not None:  # each rank scores its key shard; the shards' top-k merged
            return dcp_indexer_topk(
                q, weights, step.batch, self.layer_idx, self.score_scale, self.topk, step.dcp
            )
        k_cache, k_scale = kv.layers[self.layer_idx]["index_k"], kv.scales[self.layer_idx]["index_k"]
        return dsa_indexer(
            DsaIndexerArgs(q, weights, k_cache, k_scale, self.score_scale, self.topk, step.pages)
        )

    @property
    def score_scale(self) -> float:
        """The op's `softmax_scale`: the reference's Di^-0.5, times the `Hi^-0.5` it puts on the head
        weights, which relu lets through (`w · relu(s·q·k) · c = w · relu(c·s·q·k)` for c > 0): the
        scoring kernel folds it into its per-head weight, and the step loses one launch a layer
        (2^-6 for GLM-5's 32 heads of 128: the kernel's weight rounds once, not twice)."""
        return float((self.Di * self.Hi) ** -0.5)


class DSAAttention(MLAAttention):
    def __init__(
        self, config: ModelConfig, layer_idx: int, shard: Shard, rotary: Rotary, *, dtype: torch.dtype
    ) -> None:
        super().__init__(config, layer_idx, shard, rotary, dtype=dtype)
        # an MTP layer (past the last decoder layer) has no earlier layer to share a choice with
        self.is_full = layer_idx >= config.num_hidden_layers or config.indexer_types[layer_idx] == "full"
        if self.is_full:
            self.indexer = Indexer(config, layer_idx, dtype=dtype)
        elif "full" not in config.indexer_types[:layer_idx]:
            raise CheckpointError(f"layer {layer_idx} shares top-k but no earlier layer runs the indexer")

    def x_readers(self) -> list[str]:
        """MLA's, then the indexer's `wk` (its `weights_proj` reads x too, but in float32, and only
        when a step scores: it is not fused)."""
        return [*super().x_readers(), *(["indexer.wk"] if self.is_full else [])]

    def cache_specs(self) -> list[CacheSpec]:
        specs = super().cache_specs()
        return [*specs, CacheSpec("index_k", (self.indexer.Di,))] if self.is_full else specs

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        q, q_resid, more = self.absorbed_query(x, step)
        if self.is_full:  # a shared layer reuses the choice (None: dense, for every layer of the step)
            assert q_resid is not None
            step.topk_indices = self.indexer(x, q_resid, more[0], step, self.rotary[0])
        return self.attend(q, step, step.topk_indices)


class GlmMoeDsaForCausalLM(CausalLM):
    @property
    def dense_context(self) -> int:
        """The longest context attended in full (the indexer keeps every key): a step whose
        sequences are no longer runs dense MLA and scores nothing (the decode graphs' narrow width)."""
        return self.config.index_topk

    def make_attention(self, layer_idx: int) -> nn.Module:
        return DSAAttention(self.config, layer_idx, self.shard, self.rotary, dtype=self.dtype)
