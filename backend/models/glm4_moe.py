"""The GQA family: GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`).

Grouped-query attention with biased q/k/v projections, optional per-head RMSNorm of q and k before
RoPE (`use_qk_norm`), and partial NeoX RoPE on the first `partial_rotary_factor · head_dim` dims.
The cache keeps K and V per KV head. Query heads split over ranks; each rank keeps the KV heads its
query heads read (sharded when there are enough, replicated otherwise). MoE as in DeepSeek-V3.

Shape letters: T tokens, Hl local query heads, Kl local KV heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.engine.forward_batch import CacheSpec
from backend.models.causal_lm import CausalLM
from backend.models.layers.linear import Linear, Shard
from backend.models.layers.norm import RMSNorm
from backend.models.layers.rotary import Rotary
from backend.models.layers.step import Step
from backend.models.model_config import ModelConfig
from kernels.paged_attention import PagedAttentionArgs, paged_attention


class GQAAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, shard: Shard, rotary: Rotary, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx, self.rotary = layer_idx, [rotary]  # a list: shared, not a submodule
        D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q0, q1 = shard.split(Hq, "attention heads")
        group = Hq // Hkv
        kv0, kv1 = q0 // group, -(-q1 // group)
        self.D, self.num_local_heads, self.num_local_kv_heads = D, q1 - q0, kv1 - kv0
        bias = c.attention_bias
        self.q_proj = Linear(c.hidden_size, Hq * D, dtype=dtype, bias=bias, out_range=(q0 * D, q1 * D))
        self.k_proj = Linear(c.hidden_size, Hkv * D, dtype=dtype, bias=bias, out_range=(kv0 * D, kv1 * D))
        self.v_proj = Linear(c.hidden_size, Hkv * D, dtype=dtype, bias=bias, out_range=(kv0 * D, kv1 * D))
        self.o_proj = Linear(Hq * D, c.hidden_size, dtype=dtype, in_range=(q0 * D, q1 * D), shard=shard)
        self.use_qk_norm = c.use_qk_norm
        if c.use_qk_norm:
            self.q_norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(D, c.rms_norm_eps, dtype=dtype)
        self.softmax_scale = c.softmax_scale

    def cache_specs(self) -> list[CacheSpec]:
        shape = (self.num_local_kv_heads, self.D)
        return [CacheSpec("k", shape), CacheSpec("v", shape)]

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_local_heads, self.D)
        k = self.k_proj(x).view(T, self.num_local_kv_heads, self.D)
        v = self.v_proj(x).view(T, self.num_local_kv_heads, self.D)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary = self.rotary[0]
        q, k = rotary.rotate_many([(q, None), (k, None)], step.cos, step.sin)  # one launch on CUDA
        step.write(self.layer_idx, "k", k, also=("v", v))  # one launch for both caches
        kv = step.batch.kv_cache
        k_cache, v_cache = kv.layers[self.layer_idx]["k"], kv.layers[self.layer_idx]["v"]
        k_scale, v_scale = kv.scales[self.layer_idx]["k"], kv.scales[self.layer_idx]["v"]
        args = PagedAttentionArgs(q, k_cache, v_cache, k_scale, v_scale, self.softmax_scale, step.pages)
        o = paged_attention(args)  # [T, Hl, D]
        return self.o_proj(o.reshape(T, -1))


class Glm4MoeForCausalLM(CausalLM):
    def make_attention(self, layer_idx: int) -> nn.Module:
        return GQAAttention(self.config, layer_idx, self.shard, self.rotary, dtype=self.dtype)
