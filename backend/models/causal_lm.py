"""What every text architecture shares: embedding, decoder layers, final norm, lm_head, weight loading.

Parameter names mirror the Hugging Face checkpoint names (`model.layers.3.self_attn.q_a_proj.weight`),
so most tensors load by name. The exceptions are handled here: per-expert tensors
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) fill slices of the fused expert parameters, MTP layers
(index ≥ num_hidden_layers) load into `mtp.{i}` when the model is built with them (speculative
decoding, backend/models/mtp.py) and are skipped otherwise, the K2.5 `language_model.` prefix is stripped (anything
outside it, the vision tower, is not this model's), and a tied lm_head reuses the embedding.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from backend.engine.forward_batch import CacheSpec, ForwardBatch
from backend.errors import CheckpointError
from backend.models.layers.linear import Linear, Shard, _copy
from backend.models.layers.moe import DenseMLP, Experts, MoE
from backend.models.layers.norm import RMSNorm
from backend.models.layers.parallel import (
    DcpGroup,
    Parallel,
    VocabParallelEmbedding,
    gather_vocab,
    vocab_range,
)
from backend.models.layers.rotary import Rotary
from backend.models.layers.step import Step
from backend.models.model_config import ModelConfig
from backend.models.mtp import MtpLayer

# `.weight`, or a quantized checkpoint's `.weight_packed` / `.weight_scale` / `.weight_scale_inv` / …
_EXPERT = re.compile(
    r"^((?:model\.layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight\w*)$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# an MTP layer's copies of the embedding and lm_head: the model's own are used
_MTP_SHARED = re.compile(r"^(embed_tokens|shared_head\.head)\.")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: nn.Module, mlp: nn.Module, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is `x + residual` (x alone when residual is None: the first layer);
        returns (mlp_out, h), the next layer's input being `h + mlp_out`: each residual add runs
        inside the norm after it, one launch for both."""
        if residual is None:
            h = x
            normed = self.input_layernorm(x)
        else:
            normed, h = self.input_layernorm.add_forward(x, residual)
        attn_out = self.self_attn(normed, step)
        normed, h = self.post_attention_layernorm.add_forward(attn_out, h)  # h + attn_out, then its norm
        mlp_out: torch.Tensor = self.mlp(normed)  # attn, mlp: any nn.Module
        return mlp_out, h


class Backbone(nn.Module):
    def __init__(
        self, config: ModelConfig, layers: list[DecoderLayer], shard: Shard, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class CausalLM(nn.Module):
    """Base of the architecture classes; a subclass supplies `make_attention(layer_idx)`.

    `rank` of `world_size` (tp) ranks, routed experts over `ep` groups (0: ep = tp), the MLA latent
    cache sharded by token over groups of `dcp` ranks (backend/models/layers/parallel.py). `num_mtp_layers`
    of the checkpoint's MTP layers are built and loaded (speculative decoding; 0: none)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        ep: int = 0,
        dcp: int = 1,
        num_mtp_layers: int = 0,
    ) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.parallel = Parallel(rank, world_size, ep, dcp)
        if dcp > 1 and not config.kv_lora_rank:
            raise CheckpointError("decode context parallelism (dcp > 1) shards the MLA latent cache only")
        self.shard = self.parallel.shard
        self.dcp = DcpGroup.create(self.parallel)
        self.rotary = Rotary(config.rope)
        layers = []
        for i in range(config.num_hidden_layers):
            mlp: nn.Module
            if config.mlp_layer_types[i] == "sparse":
                mlp = MoE(config, self.parallel, dtype=dtype)
            else:
                mlp = DenseMLP(
                    config.hidden_size, config.intermediate_size, config.hidden_act, self.shard, dtype=dtype
                )
            layers.append(DecoderLayer(config, self.make_attention(i), mlp, dtype=dtype))
        self.model = Backbone(config, layers, self.shard, dtype=dtype)
        vocab = vocab_range(self.shard, config.vocab_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, out_range=vocab)
        if num_mtp_layers > config.num_nextn_predict_layers:
            raise CheckpointError(
                f"{num_mtp_layers} MTP layers asked for; the checkpoint has "
                f"{config.num_nextn_predict_layers} (num_nextn_predict_layers)"
            )
        self.mtp = nn.ModuleList(self._make_mtp(i) for i in range(num_mtp_layers))

    def _make_mtp(self, i: int) -> nn.Module:
        c = self.config
        mlp: nn.Module
        if c.num_routed_experts:  # every published MTP layer is a MoE layer
            mlp = MoE(c, self.parallel, dtype=self.dtype)
        else:
            mlp = DenseMLP(c.hidden_size, c.intermediate_size, c.hidden_act, self.shard, dtype=self.dtype)
        return MtpLayer(c, self.make_attention(c.num_hidden_layers + i), mlp, dtype=self.dtype)

    def make_attention(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def cache_specs(self) -> list[list[CacheSpec]]:
        return [attn.cache_specs() for attn in self.attentions()]

    def attentions(self) -> list[Any]:
        """Each layer's attention module (MLA, DSA or GQA: all have `cache_specs()`), the MTP
        layers' after the decoder layers' (their cache slots follow the model's)."""
        return [layer.self_attn for layer in [*self.layers, *self.mtp]]

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    @property
    def layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits `[len(batch.logits_indices), vocab]` (the whole vocabulary on every rank)."""
        x = self._decode_layers(batch)
        return self._logits(self.model.norm(x if batch.logits_are_rows else x[batch.logits_indices]))

    @torch.no_grad()
    def forward_spec(
        self, batch: ForwardBatch, step: Step | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits, and every row's hidden state after the final norm `[T, H]` (what the
        MTP layers read). `step`: `batch`'s, when the caller built it (`build_step`) to share it."""
        x = self.model.norm(self._decode_layers(batch, step))  # [T, H]
        return self._logits(x if batch.logits_are_rows else x[batch.logits_indices]), x

    @torch.no_grad()
    def forward_mtp(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        depth: int,
        step: Step | None = None,
        *,
        past_position_zero: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft depth `depth` (0-based): `batch.input_ids` are the tokens after the positions whose
        hidden states `hidden [T, H]` are given. Returns (the draft logits of `batch.logits_indices`
        in the model's dtype, the MTP hidden states [T, H] the next depth reads): a draft is their
        argmax, which widening them to float32 (exact) would not change: one launch fewer a depth,
        three of a whole greedy step's at k = 3. `step`: the
        layers' facts of `batch`'s positions and pages when the caller has them (a whole step's depth
        0 shares its verify's: the same rows; `build_step`), else built here. `past_position_zero`:
        the caller knows no row is at position 0 (a verify's rows follow a token), so depth 0 skips
        the mask (two launches)."""
        layer: Any = self.mtp[depth % len(self.mtp)]
        table = self.model.embed_tokens
        step = step if step is not None else self.build_step(batch)
        if depth == 0 and not past_position_zero:  # a depth d > 0 runs past its depth-0 row
            embeds = table(batch.input_ids).masked_fill((batch.positions == 0)[:, None], 0.0)  # as vLLM's
            mlp_out, residual = layer.draft(embeds, hidden.to(embeds.dtype), step)
        elif table.shard.world_size == 1:  # the lookup inside the input norms' launch
            mlp_out, residual = layer.draft(
                table.weight, hidden.to(table.weight.dtype), step, ids=batch.input_ids
            )
        else:  # a vocabulary split over the ranks: the lookup's all-reduce first
            embeds = table(batch.input_ids)  # [T, H]
            mlp_out, residual = layer.draft(embeds, hidden.to(embeds.dtype), step)
        # g = residual + mlp_out and its head norm in one launch (every row: g is the next depth's input)
        normed, g = layer.shared_head.norm.add_forward(mlp_out, residual)  # [T, H] each
        logits = self.lm_head(normed if batch.logits_are_rows else normed[batch.logits_indices])
        return gather_vocab(logits, self.shard, self.config.vocab_size), g

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos, sin `[T, Dr]` of `positions [T]`, in the activations' dtype."""
        return self.rotary.cos_sin(positions, self.model.embed_tokens.weight.dtype)

    def prepare_cos_sin(self, num_positions: int) -> None:
        """`cos_sin` of positions below `num_positions` from a table made now (one launch a forward)."""
        weight = self.model.embed_tokens.weight
        self.rotary.prepare_table(num_positions, weight.dtype, weight.device)

    def build_step(
        self,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        expected_tags: torch.Tensor | None = None,
    ) -> Step:
        """The facts every layer of a forward over `batch` reads (backend/models/layers/step.py):
        forwards over the same positions and pages may share one. `cos_sin` (`cos_sin` of
        `batch.positions`) and `expected_tags` (`[T]`, the tag each new token's page carries) when
        the caller has them, e.g. sliced from one computation for several draft depths; else
        computed here."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(batch.positions)
        return Step.build(batch, cos, sin, self.dcp, expected_tags)

    def _decode_layers(self, batch: ForwardBatch, step: Step | None = None) -> torch.Tensor:
        """The hidden states after the last decoder layer, before the final norm `[T, H]`."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        if batch.image_embeds is not None:
            x[batch.image_embeds.token_indices] = batch.image_embeds.embeds.to(x.dtype)
        step = step if step is not None else self.build_step(batch)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, step)
        hidden: torch.Tensor = x if residual is None else residual + x
        return hidden

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(self.lm_head(x), self.shard, self.config.vocab_size).float()

    # ---- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (each rank keeps its slices); raise CheckpointError naming any gap."""
        targets = self.state_dict(keep_vars=True)
        needed = Counter({name: 1 for name in targets})
        expert_parts: dict[str, set[tuple[int, str]]] = defaultdict(set)
        for module_name, module in self.named_modules():
            if hasattr(module, "parts_per_param"):  # Experts, or backend.quant's QuantExperts
                for param, parts in module.parts_per_param().items():
                    needed[f"{module_name}.{param}"] = parts
        loaded: Counter[str] = Counter()
        prefix = self.config.weight_prefix
        for raw_name, tensor in weights:
            if prefix:
                if not raw_name.startswith(prefix):
                    continue  # the vision tower and projector of a multimodal checkpoint
                raw_name = raw_name[len(prefix) :]
            # transformers 5 writes a K2.5 text model back as `language_model.model.blocks.N`
            name = (
                "model.layers." + raw_name[len("model.blocks.") :]
                if raw_name.startswith("model.blocks.")
                else raw_name
            )
            mapped = self._mtp_name(name)
            if mapped is None or _IGNORED.search(mapped):
                continue
            name = mapped
            if expert := _EXPERT.match(name):
                path, e, proj, part = expert.group(1), int(expert.group(2)), expert.group(3), expert.group(4)
                experts = self._module(path, raw_name)
                if hasattr(experts, "load_expert_part"):
                    # quantized experts (backend/quant/experts.py) take every part, FP8 `.weight` included,
                    # and say which buffer the tensor filled
                    buffer, n = experts.load_expert_part(e, proj, part, tensor)
                    loaded[f"{path}.{buffer}"] += n
                elif part == "weight":
                    n = experts.load_expert(e, proj, tensor)
                    loaded[f"{path}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"] += n
                else:
                    raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint")
                expert_parts[path].add((e, proj))
                continue
            path, attr = name.rsplit(".", 1)
            module = self._module(path, raw_name)
            if hasattr(module, "load_param"):
                loaded[name] += module.load_param(attr, tensor) or 1
            elif name in targets:
                _copy(targets[name], tensor, name)
                loaded[name] += 1
            else:
                raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint")
        if loaded["lm_head.weight"] == 0 and self.config.tie_word_embeddings:
            _copy(self.lm_head.weight, self.model.embed_tokens.weight, "lm_head.weight (tied)")
            loaded["lm_head.weight"] = 1
        for name in targets:
            if loaded[name] < needed[name]:
                raise CheckpointError(
                    f"checkpoint is missing tensor {prefix}"
                    f"{self._checkpoint_name(self._describe_missing(name, expert_parts))}"
                )

    def wants_tensor(self, raw_name: str) -> bool:
        """False for checkpoint tensors this rank never keeps (other ranks' experts, MTP, vision), so
        the loader need not read them: with expert parallelism most of a checkpoint is skipped."""
        prefix = self.config.weight_prefix
        if prefix and not raw_name.startswith(prefix):
            return False
        name = self._mtp_name(raw_name[len(prefix) :])
        if name is None:
            return False
        if expert := _EXPERT.match(name):
            experts = self.get_submodule(expert.group(1))
            # Experts or its quantized swap, both with int fields e0, e1 that nn.Module types Tensor | Module
            return cast(int, experts.e0) <= int(expert.group(2)) < cast(int, experts.e1)
        return True

    def _mtp_name(self, name: str) -> str | None:
        """`name`, or an MTP layer's tensor under its `mtp.{i}.` name; None for a tensor not loaded
        (an MTP layer not built, or its copy of the embedding or lm_head)."""
        layer = _LAYER.match(name)
        if layer is None or int(layer.group(1)) < self.config.num_hidden_layers:
            return name
        i, rest = int(layer.group(1)) - self.config.num_hidden_layers, name[layer.end() :]
        if i >= len(self.mtp) or _MTP_SHARED.match(rest):
            return None
        return f"mtp.{i}.{rest}"

    def _checkpoint_name(self, name: str) -> str:
        """`mtp.{i}.…` back to the checkpoint's `model.layers.{num_hidden_layers + i}.…`."""
        if not name.startswith("mtp."):
            return name
        i, rest = name[len("mtp.") :].split(".", 1)
        return f"model.layers.{self.config.num_hidden_layers + int(i)}.{rest}"

    def _module(self, path: str, raw_name: str) -> Any:
        """The submodule at `path` (duck-typed: its loading hooks vary by module kind)."""
        try:
            return self.get_submodule(path)
        except AttributeError as exc:
            raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint") from exc

    def _describe_missing(self, name: str, expert_parts: dict[str, set[tuple[int, str]]]) -> str:
        path, param = name.rsplit(".", 1)
        module: Any = self.get_submodule(path)
        if not hasattr(module, "parts_per_param"):
            return name
        projs = ("down_proj",) if param.startswith("down") else ("gate_proj", "up_proj")
        suffix = ".weight" if isinstance(module, Experts) else f" (for {param})"
        for e in range(module.e0, module.e1):
            for proj in projs:
                if (e, proj) not in expert_parts[path]:
                    return f"{path}.{e}.{proj}{suffix}"
        return name

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This (single-rank) model's tensors under their published checkpoint names, experts split."""
        for name, tensor in self.state_dict().items():
            module = self.get_submodule(name.rsplit(".", 1)[0])
            name = self._checkpoint_name(name)
            path, param = name.rsplit(".", 1)
            if isinstance(module, Experts):
                I = module.intermediate
                for e in range(tensor.shape[0]):
                    if param == "gate_up_proj":
                        yield f"{path}.{e}.gate_proj.weight", tensor[e, :I]
                        yield f"{path}.{e}.up_proj.weight", tensor[e, I:]
                    else:
                        yield f"{path}.{e}.down_proj.weight", tensor[e]
            elif name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            else:
                yield name, tensor
