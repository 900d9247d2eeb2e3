"""Multi-token-prediction (MTP) layers: DeepSeek-V3's draft head, as GLM-5 ships it.

A checkpoint with `num_nextn_predict_layers = L` stores L of them after the last decoder layer, as
`model.layers.{num_hidden_layers + i}.*`: `enorm` and `hnorm` (RMSNorms), `eh_proj` ([H, 2H], no
bias), one decoder block (attention and MoE or dense MLP, under the usual names) and
`shared_head.norm`. Their `embed_tokens` and `shared_head.head` are copies of the model's embedding
and lm_head: the model's own are used and those copies are not read.

At position j an MTP layer takes the target's hidden state h_j (after the final norm, as vLLM's
DeepSeek MTP takes it) and the embedding of token j + 1, and predicts token j + 2:

    g_j = block(eh_proj([enorm(embed(x_{j+1})) | hnorm(h_j)]))      logits = lm_head(shared_head.norm(g_j))

Chained drafts feed g_j back in place of h_j (depth k uses layer k mod L). Its attention keeps its
own KV in the paged cache, in layer slot `num_hidden_layers + i`, at the same positions (so in the
same pages, under the same tags) as the target's. Shape letters: T tokens, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.models.layers.linear import Linear
from backend.models.layers.norm import RMSNorm
from backend.models.layers.step import Step
from backend.models.model_config import ModelConfig
from kernels.op_args import RowNorm
from kernels.row_norms import RowNormsArgs, row_norms


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class MtpLayer(nn.Module):
    """One MTP layer: its decoder block under a decoder layer's names (`input_layernorm`,
    `self_attn`, `post_attention_layernorm`, `mlp`), plus the input norms and projection, and the
    head's norm."""

    def __init__(self, config: ModelConfig, attn: nn.Module, mlp: nn.Module, *, dtype: torch.dtype) -> None:
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        self.mlp = mlp
        self.enorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * H, H, dtype=dtype)
        self.shared_head = SharedHead(config, dtype=dtype)

    def draft(
        self, embeds: torch.Tensor, hidden: torch.Tensor, step: Step, *, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, H] (of the next tokens), hidden [T, H] → the layer's hidden state [T, H] as its
        two addends (the MLP's output, the residual): the caller adds them in the head norm's launch.
        With `ids [T]`, `embeds` is the embedding table [V, H] and the lookup happens in the norms'
        launch."""
        T, H = hidden.shape[0], embeds.shape[1]
        dtype = torch.promote_types(self.enorm.weight.dtype, embeds.dtype)  # the norms' output dtype
        both = torch.empty(T, 2 * H, dtype=dtype, device=embeds.device)  # [T, 2H]
        # both norms (and the lookup) in one launch, each writing its half: no concatenation
        row_norms(
            RowNormsArgs(
                (
                    RowNorm(embeds, self.enorm.weight, self.enorm.eps, out=both[:, :H], rows=ids),
                    RowNorm(hidden, self.hnorm.weight, self.hnorm.eps, out=both[:, H:]),
                )
            )
        )
        x = self.eh_proj(both)  # [T, H]
        # the decoder block, as DecoderLayer's: the residual add inside the norm after it (one launch)
        normed, x = self.post_attention_layernorm.add_forward(
            self.self_attn(self.input_layernorm(x), step), x
        )
        return self.mlp(normed), x
