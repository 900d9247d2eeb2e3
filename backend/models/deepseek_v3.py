"""The MLA family: DeepSeek-V3 and Kimi K2 / K2 Thinking (model_type deepseek_v3 / kimi_k2), and the
text model of Kimi K2.5 / K2.6.

Multi-head latent attention (engine-anchors §1d): q through its LoRA (q_a_proj → RMSNorm → q_b_proj),
one latent per token `kv_a_proj_with_mqa(x) = [c (R) | k_pe (Dr)]`, `c` RMS-normed, RoPE on the rope
dims only (interleaved pairs). The cache keeps `[c | rotated k_pe]` (R + Dr = 576 for Kimi). Queries
are absorbed into latent space (`q_nope · W_UK`), attention runs MQA over the latent lines, and the
latent output goes back through `W_UV` before o_proj; W_UK / W_UV are views of kv_b_proj.
The Linears reading the layer's input (`x_readers`: q_a_proj or q_proj, kv_a_proj_with_mqa) are one
`fused_qkv_a_proj` product once the loaded model is fused (backend/models/layers/fused.py).
On CUDA the layer's small ops before attention are three launches (issue 24): the q_a and kv_a
RMSNorms one (`kernels/row_norms.py`), the q_pe and k_pe rotations one (`kernels/rope.py`), the latent
write one; the DSA layer (glm_moe_dsa.py) adds its indexer's norm, rotations and key line to them.
Heads split over ranks (tensor parallel); the latent cache is replicated on every rank, or sharded
by token over a DCP group (backend/models/layers/context_parallel.py).

Shape letters: T tokens, Hl local heads, N qk_nope_head_dim, Dr qk_rope_head_dim, V v_head_dim,
R kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.engine.forward_batch import CacheSpec
from backend.models.causal_lm import CausalLM
from backend.models.layers.context_parallel import dcp_mla_attention
from backend.models.layers.fused import FusedLinear, fuse_group, project
from backend.models.layers.linear import Linear, Shard
from backend.models.layers.norm import RMSNorm
from backend.models.layers.rotary import Rotary
from backend.models.layers.step import Step
from backend.models.model_config import ModelConfig
from kernels.mla_attention import MlaAttentionArgs, mla_attention
from kernels.op_args import RowNorm
from kernels.row_norms import RowNormsArgs, row_norms

# transformers and the original DeepSeek code build q_a_layernorm / kv_a_layernorm with their
# default eps, not config.rms_norm_eps
LORA_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, shard: Shard, rotary: Rotary, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx, self.rotary = layer_idx, [rotary]  # a list: shared, not a submodule
        self.h0, self.h1 = shard.split(c.num_attention_heads, "attention heads")
        self.num_local_heads = self.h1 - self.h0
        self.N, self.Dr, self.V, self.R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        qk = self.N + self.Dr
        heads = (self.h0 * qk, self.h1 * qk)
        self.q_lora_rank = c.q_lora_rank
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, c.num_attention_heads * qk, dtype=dtype, out_range=heads)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, dtype=dtype, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(c.q_lora_rank, c.num_attention_heads * qk, dtype=dtype, out_range=heads)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.R + self.Dr, dtype=dtype, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.R, LORA_NORM_EPS, dtype=dtype)
        kv = self.N + self.V
        self.kv_b_proj = Linear(
            self.R, c.num_attention_heads * kv, dtype=dtype, out_range=(self.h0 * kv, self.h1 * kv)
        )
        self.o_proj = Linear(
            c.num_attention_heads * self.V,
            c.hidden_size,
            dtype=dtype,
            bias=c.attention_bias,
            in_range=(self.h0 * self.V, self.h1 * self.V),
            shard=shard,
        )
        self.softmax_scale = c.softmax_scale
        self.fused_qkv_a_proj: FusedLinear | None = None  # `fuse_projections`: x_readers as one product
        self.fp8_dot = False  # `set_mla_fp8_dot`: an FP8 cache read by e4m3 dots (`kumo eval`'s A/B only)

    def x_readers(self) -> list[str]:
        """The Linears reading the layer's input x, in `project_x`'s order (q's first Linear, then the
        latent's)."""
        return ["q_proj" if self.q_lora_rank is None else "q_a_proj", "kv_a_proj_with_mqa"]

    def fuse_projections(self) -> int:
        return fuse_group(self, self.x_readers(), "fused_qkv_a_proj")

    def project_x(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, H] → each of `x_readers`' outputs, in order (views of one product once fused)."""
        return project(self, self.x_readers(), self.fused_qkv_a_proj, x)

    def cache_specs(self) -> list[CacheSpec]:
        return [CacheSpec("latent", (self.R + self.Dr,))]

    def lora_norms(
        self, q_a: torch.Tensor, kv_a: torch.Tensor, *more: RowNorm
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        """q's first Linear's output [T, Q] (q_a_proj; q_proj's without a q LoRA) and the latent
        projection [T, R + Dr] → (the normed q LoRA activation [T, Q] or None, a new latent line
        [T, R + Dr] holding the normed c (its rope half still to fill), the outputs of `more`: norms of
        the same rows riding on the launch, the DSA indexer's key). One launch on CUDA."""
        T = kv_a.shape[0]
        latent = torch.empty(T, self.R + self.Dr, dtype=kv_a.dtype, device=kv_a.device)  # [T, R + Dr]
        kv_norm = self.kv_a_layernorm
        norms = [RowNorm(kv_a[:, : self.R], kv_norm.weight, kv_norm.eps, out=latent[:, : self.R]), *more]
        if self.q_lora_rank is not None:
            norms.insert(0, RowNorm(q_a, self.q_a_layernorm.weight, self.q_a_layernorm.eps))
        normed = row_norms(RowNormsArgs(tuple(norms)))
        if self.q_lora_rank is None:
            return None, latent, normed[1:]
        return normed[0], latent, normed[2:]

    def query(self, q_a: torch.Tensor, q_resid: torch.Tensor | None) -> torch.Tensor:
        """q [T, Hl, N + Dr]: q_b_proj of the normed LoRA activation, or q_proj's output as it is."""
        q = q_a if q_resid is None else self.q_b_proj(q_resid)
        return q.view(q.shape[0], self.num_local_heads, -1)

    def rope_pairs(
        self, q: torch.Tensor, kv_a: torch.Tensor, latent: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """(a new absorbed query [T, Hl, R + Dr], the (x, out) pairs `Rotary.rotate_many` rotates into
        its last Dr dims and into the latent's): the rotations write their halves, no concatenation."""
        T = q.shape[0]
        q_abs = torch.empty(T, self.num_local_heads, self.R + self.Dr, dtype=q.dtype, device=q.device)
        k_pe = kv_a[:, None, self.R :]  # [T, 1, Dr]
        return q_abs, [(k_pe, latent[:, None, self.R :]), (q[..., self.N :], q_abs[..., self.R :])]

    def absorb(self, q: torch.Tensor, q_abs: torch.Tensor) -> None:
        """q_nope [T, Hl, N] · W_UK into q_abs's first R dims."""
        w_uk = self.w_kv()[:, : self.N]  # [Hl, N, R]
        # bmm over the views: cuBLAS takes their strides and the transpose as they are (an einsum may
        # copy a non-contiguous weight operand on every call), the output's too (ldc = Hl·(R + Dr))
        q_nope = q[..., : self.N]
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_abs[..., : self.R].transpose(0, 1))  # [Hl, T, R]

    def absorbed_query(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Write this step's latents; return the absorbed q [T, Hl, R + Dr]. The norms are one launch,
        the rotations another (`DSAAttention.forward` adds its indexer's to each)."""
        q_a, kv_a = self.project_x(x)
        q_resid, latent, _ = self.lora_norms(q_a, kv_a)
        q = self.query(q_a, q_resid)
        q_abs, pairs = self.rope_pairs(q, kv_a, latent)
        self.rotary[0].rotate_many(pairs, step.cos, step.sin)
        step.write(self.layer_idx, "latent", latent)
        self.absorb(q, q_abs)
        return q_abs

    def w_kv(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_local_heads, self.N + self.V, self.R)  # [Hl, N+V, R]

    def attend(self, q: torch.Tensor, step: Step, topk_indices: torch.Tensor | None) -> torch.Tensor:
        """Absorbed q [T, Hl, R + Dr] → attention output [T, H] after W_UV and o_proj."""
        kv = step.batch.kv_cache
        cache, scale = kv.layers[self.layer_idx]["latent"], kv.scales[self.layer_idx]["latent"]
        if step.dcp is not None:  # the latent cache sharded by token over the DCP group
            o_latent = dcp_mla_attention(
                q, step.batch, self.layer_idx, self.R, self.softmax_scale, topk_indices, step.dcp
            )
        else:
            args = MlaAttentionArgs(
                q, cache, scale, self.R, self.softmax_scale, step.pages, topk_indices, fp8_dot=self.fp8_dot
            )
            o_latent = mla_attention(args)  # [T, Hl, R]
        w_uv = self.w_kv()[:, self.N :]  # [Hl, V, R]
        T = q.shape[0]
        # written through its transposed view, as q_abs is (at decode, T = 1, cuBLAS takes that strided out as it is), so
        # o_proj reads [T, Hl·V] as a view, not a copy of the transposed product
        o = torch.empty(T, self.num_local_heads, self.V, dtype=o_latent.dtype, device=o_latent.device)
        torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))  # [Hl, T, V]
        return self.o_proj(o.view(T, -1))

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        return self.attend(self.absorbed_query(x, step), step, None)


def set_mla_fp8_dot(model: nn.Module, on: bool) -> int:
    """Every MLA layer of `model` reads an FP8 latent cache by e4m3 dots (`kernels.mla_tiles.FP8_DOT_TILES`,
    q and the softmax weights rounded to e4m3) in decode and prefill alike, or not; returns how many
    layers that is (0: no MLA). The DCP path (a sharded cache) keeps its own kernels."""
    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    for m in layers:
        m.fp8_dot = on
    return len(layers)


class DeepseekV3ForCausalLM(CausalLM):
    def make_attention(self, layer_idx: int) -> nn.Module:
        return MLAAttention(self.config, layer_idx, self.shard, self.rotary, dtype=self.dtype)
