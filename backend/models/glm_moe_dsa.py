"""GLM-5 / 5.2 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's MLA and MoE plus DeepSeek Sparse Attention.

A layer whose `indexer_types` entry is "full" runs the indexer: its own projections (`wq_b` from the
q LoRA activation, `wk` + LayerNorm from the hidden state, per-head `weights_proj` in float32),
interleaved RoPE on the first rope dims, keys cached in pages ("index_k"), and it picks the top
`index_topk` visible tokens per query. A "shared" layer reuses the last full layer's choice. MLA
attention then reads only the chosen tokens. The indexer is small and replicated on every rank; under
DCP its key cache is sharded by token like the latent cache (backend/models/layers/context_parallel.py).
Its key's LayerNorm rides on MLA's LoRA norms' launch, its key and query rotations on MLA's rope
launch, its key line on the latent's kv_write launch: a full layer launches those three where it
launched nine (three norms, four rotations, two writes). Its indexer's `wq_b` and MLA's `q_b_proj`
read the same normed q LoRA activation: once the model is fused (backend/models/layers/fused.py) they
are one product (`fused_q_b_proj`, one GEMV where a scoring step ran two), and a step that scores
nothing reads q_b_proj's rows of it alone (a row-prefix view: no wq_b bytes, no extra launch).

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
from backend.models.layers.fused import FusedLinear, fuse_group, project
from backend.models.layers.linear import Linear, Shard
from backend.models.layers.rotary import Rotary
from backend.models.layers.step import Step
from backend.models.model_config import ModelConfig
from kernels.dsa_indexer import DsaIndexerArgs, dsa_indexer
from kernels.op_args import RowNorm

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

    def key_norm(self, wk_x: torch.Tensor) -> RowNorm:
        """wk(x) [T, Di] (the attention computes it with its other Linears reading x) → its LayerNorm,
        run in the attention's LoRA norms' launch."""
        n = self.k_norm
        return RowNorm(wk_x, n.weight, n.eps, n.bias, is_layer_norm=True)

    def rope_pairs(
        self, k_normed: torch.Tensor, wq_b_q: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The (x, None) pairs the attention's rope launch rotates for the indexer: the normed key
        [T, 1, Di], and `wq_b(q_resid)` [T, Hi·Di] as the query [T, Hi, Di] when the step scores
        (the attention computes it with q_b_proj: `DSAAttention.q_resid_readers`)."""
        T = k_normed.shape[0]
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = [(k_normed.view(T, 1, self.Di), None)]
        if wq_b_q is not None:
            pairs.append((wq_b_q.view(T, self.Hi, self.Di), None))
        return pairs

    def is_scoring(self, step: Step) -> bool:
        """False when no sequence of the step is longer than K: every visible token is kept, nothing
        scored (the keys are still cached, for later, longer steps)."""
        return step.table_tokens > self.topk

    def choose(self, x: torch.Tensor, q: torch.Tensor | None, step: Step) -> torch.Tensor | None:
        """x [T, H], the rotated query [T, Hi, Di] (None: the step does not score) → chosen token
        indices [T, K] (-1 = none); None: every visible token."""
        if q is None:
            return None
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
        self.fused_q_b_proj: FusedLinear | None = None  # `fuse_projections`: q_resid_readers as one product

    def x_readers(self) -> list[str]:
        """MLA's, then the indexer's `wk` (its `weights_proj` reads x too, but in float32, and only
        when a step scores: it is not fused)."""
        return [*super().x_readers(), *(["indexer.wk"] if self.is_full else [])]

    def q_resid_readers(self) -> list[str]:
        """A full layer's Linears reading the normed q LoRA activation: q_b_proj (this rank's heads),
        then the indexer's wq_b (replicated), asked only when the step scores."""
        return ["q_b_proj", "indexer.wq_b"]

    def fuse_projections(self) -> int:
        fused = super().fuse_projections()
        return fused + (self.is_full and fuse_group(self, self.q_resid_readers(), "fused_q_b_proj"))

    def cache_specs(self) -> list[CacheSpec]:
        specs = super().cache_specs()
        return [*specs, CacheSpec("index_k", (self.indexer.Di,))] if self.is_full else specs

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if not self.is_full:  # a shared layer reuses the choice (None: dense, for every layer of the step)
            return self.attend(self.absorbed_query(x, step), step, step.topk_indices)
        # MLA's absorbed query with the indexer's key and query riding on its launches: one for the
        # three norms, one for the four rotations (three when the step scores nothing), one for the
        # two cache lines
        q_a, kv_a, wk_x = self.project_x(x)
        q_resid, latent, (k_normed,) = self.lora_norms(q_a, kv_a, self.indexer.key_norm(wk_x))
        assert q_resid is not None
        T = x.shape[0]
        # q_b_proj's q [T, Hl·(N + Dr)], and the indexer's wq_b [T, Hi·Di] when the step scores: one
        # product once fused; a step scoring nothing reads only q_b_proj's rows of it
        num_parts = None if self.indexer.is_scoring(step) else 1
        q_b, *wq_b = project(self, self.q_resid_readers(), self.fused_q_b_proj, q_resid, num_parts)
        q = q_b.view(T, self.num_local_heads, -1)
        q_abs, pairs = self.rope_pairs(q, kv_a, latent)
        rotated = self.rotary[0].rotate_many(
            [*pairs, *self.indexer.rope_pairs(k_normed, wq_b[0] if wq_b else None)], step.cos, step.sin
        )
        # the indexer's key [T, 1, Di], and its query [T, Hi, Di] when the step scores
        k_idx, q_idx = rotated[len(pairs)], rotated[len(pairs) + 1 :]
        # later, longer steps score these keys
        step.write(self.layer_idx, "latent", latent, also=("index_k", k_idx.view(T, self.indexer.Di)))
        self.absorb(q, q_abs)
        step.topk_indices = self.indexer.choose(x, q_idx[0] if q_idx else None, step)
        return self.attend(q_abs, step, step.topk_indices)


class GlmMoeDsaForCausalLM(CausalLM):
    @property
    def dense_context(self) -> int:
        """The longest context attended in full (the indexer keeps every key): a step whose
        sequences are no longer runs dense MLA and scores nothing (the decode graphs' narrow width)."""
        return self.config.index_topk

    def make_attention(self, layer_idx: int) -> nn.Module:
        return DSAAttention(self.config, layer_idx, self.shard, self.rotary, dtype=self.dtype)
