"""How the ranks of one model split it, and the collectives that put the pieces back together.

`Parallel(rank, tp, ep, dcp)` is the whole layout; the model classes take it apart:

- attention: MLA heads split over the tp ranks (q_b_proj / q_proj and kv_b_proj by heads, o_proj
  row-parallel; q_a_proj, kv_a_proj_with_mqa and GLM-5's DSA indexer replicated); GLM-4.5 GQA by KV
  heads (query heads split, a KV head replicated on the ranks whose query heads read it when there
  are fewer KV heads than ranks). The MLA latent cache is replicated, or with `dcp > 1` sharded by
  token over groups of dcp consecutive ranks (backend/models/layers/context_parallel.py).
- dense MLP and shared experts: gate/up column-parallel, down row-parallel.
- routed experts: expert parallel. The ranks form `ep` groups of tp/ep consecutive ranks; group g
  holds experts [g·E/ep, (g+1)·E/ep), each of them split by its intermediate dims over the group's
  tp/ep ranks (ep = tp, the default: E/tp whole experts per rank; ep = 1: every expert
  tensor-parallel).
- embedding and lm_head: vocab parallel, ⌈V/tp⌉ rows per rank (the last rank's range is shorter
  when tp does not divide V, and padded to ⌈V/tp⌉ for the gather).

Expert dispatch and combine: the hidden states entering an MoE block are replicated on every rank
(attention's o_proj all-reduce leaves them so), and the router is replicated, so the dispatch moves
no bytes: every rank routes all T tokens and runs its local experts on the tokens routed to them.
The combine is ONE all-reduce of [T, H] per MoE layer, which also carries the shared experts'
row-parallel partial sum (`Shard.deferred`). An all-to-all dispatch (DeepEP-style) would send each
token's [H] row to the ranks of its k experts and back, k·T·H against the all-reduce's
2(N−1)/N·T·H per rank; it pays off only when attention is data parallel (tokens not replicated),
which this layout is not, in decode and prefill alike.

Bytes one rank sends per decode step, Kimi K2.6 at tp = 8 (H = 7168, V = 163,840, 61 layers of
which 60 MoE, 64 heads, latent 512 + 64; bf16 activations, ring collectives: an all-reduce of n
bytes sends 2·(7/8)·n, an all-gather or reduce-scatter (7/8)·n of the gathered size):

    collective (per step)                        n at c=1        c=1 sent     n at c=64     c=64 sent
    embedding all-reduce       (1×)              14.3 KB          25 KB        918 KB        1.6 MB
    attention o_proj all-reduce (61×)            14.3 KB         1.5 MB        918 KB       98.0 MB
    MoE / dense-MLP combine    (61×)             14.3 KB         1.5 MB        918 KB       98.0 MB
    lm_head logits all-gather  (1×, bf16)         328 KB         287 KB       21.0 MB       18.4 MB
    total                                                        3.4 MB                     216 MB

With dcp = 8 each MLA layer adds an all-gather of the queries over the group's heads (64 × 576 ×
2 B per token), an all-gather of the log-sum-exps (64 × 4 B) and a reduce-scatter of the fp32
partial outputs (64 × 512 × 4 B): 179 KB sent per rank per layer at c=1, 11.5 MB at c=64 (61
layers: 10.9 MB and 700 MB per step; bf16 partials would halve the reduce-scatter's share).
On one rank no collective runs. Every collective here is a tensor collective into a buffer of a
fixed shape (all-reduce, `all_gather_flat`, `reduce_scatter_flat`; no object collectives), so a
decode step's are captured in its CUDA graph (NCCL kernels, or `--rank-of`'s local ops;
backend/engine/ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backend.errors import CheckpointError
from backend.models.layers.linear import Range, Shard, _copy


@dataclass(frozen=True, slots=True)
class Parallel:
    """This rank's place in a tp-rank model: `ep` expert groups, DCP groups of `dcp` ranks."""

    rank: int = 0
    tp: int = 1
    ep: int = 0  # 0: = tp
    dcp: int = 1

    def __post_init__(self) -> None:
        if self.ep == 0:
            object.__setattr__(self, "ep", self.tp)
        for name in ("ep", "dcp"):
            size = getattr(self, name)
            if size < 1 or self.tp % size:
                raise CheckpointError(f"{name} ({size}) must divide tp ({self.tp})")
        if not 0 <= self.rank < self.tp:
            raise CheckpointError(f"rank {self.rank} is not one of tp = {self.tp} ranks")

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.tp)

    @property
    def expert_shard(self) -> Shard:
        """Which expert range: this rank's expert group among `ep`."""
        width = self.tp // self.ep
        return Shard(self.rank // width, self.ep)

    @property
    def expert_width_shard(self) -> Shard:
        """Which intermediate range of each local expert: this rank within its expert group."""
        width = self.tp // self.ep
        return Shard(self.rank % width, width)


@dataclass(frozen=True, slots=True)
class DcpGroup:
    """The ranks that share one MLA latent cache by token: this rank is `rank` of `size`."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = field(default=None, compare=False)  # None: the default group

    @classmethod
    def create(cls, parallel: Parallel) -> DcpGroup | None:
        """None without DCP. Otherwise every rank must call this together (it makes the process
        groups when the DCP groups are smaller than the tp ranks)."""
        if parallel.dcp == 1:
            return None
        group = None
        if parallel.dcp < parallel.tp:
            for first in range(0, parallel.tp, parallel.dcp):
                made = dist.new_group(list(range(first, first + parallel.dcp)))
                if first <= parallel.rank < first + parallel.dcp:
                    group = made
        return cls(parallel.rank % parallel.dcp, parallel.dcp, group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, ...] on each rank → [size, n, ...] in rank order."""
        out = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        all_gather_flat(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, n, ...] → the sum over ranks of x[self.rank], [n, ...]."""
        out = x.new_empty(x.shape[1:])
        reduce_scatter_flat(out, x.reshape(-1, *x.shape[2:]).contiguous(), group=self.group)
        return out


def vocab_range(shard: Shard, vocab: int) -> Range:
    """This rank's rows of a vocab-parallel table: ⌈V/N⌉ per rank, the last range shorter (or empty)."""
    chunk = -(-vocab // shard.world_size)
    return min(shard.rank * chunk, vocab), min((shard.rank + 1) * chunk, vocab)


class VocabParallelEmbedding(nn.Module):
    """Rows `vocab_range` of the `[V, H]` table; a lookup is local where the id falls in this rank's
    rows, zero elsewhere, and the all-reduce sums the one non-zero row per token (exact)."""

    def __init__(self, vocab: int, hidden: int, shard: Shard, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard, self.vocab = shard, vocab
        self.v0, self.v1 = vocab_range(shard, vocab)
        self.weight = nn.Parameter(torch.empty(self.v1 - self.v0, hidden, dtype=dtype), requires_grad=False)

    def load_param(self, name: str, full: torch.Tensor) -> None:
        if name != "weight":
            raise CheckpointError(f"unexpected tensor {name!r} for an embedding")
        _copy(self.weight, full[self.v0 : self.v1], "embed_tokens.weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] → [T, H]."""
        if self.shard.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.v0
        mine = (local >= 0) & (local < self.v1 - self.v0)  # [T]
        if self.weight.shape[0]:
            x = F.embedding(torch.where(mine, local, 0), self.weight)
        else:  # more ranks than rows: this rank holds none
            x = self.weight.new_zeros(ids.shape[0], self.weight.shape[1])
        return self.shard.all_reduce(x.masked_fill(~mine[:, None], 0))


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """`out` [N·n, ...] ← every rank's `x` [n, ...] in rank order. torch 2.13 names it
    `all_gather_single` (gloo has it there, for the CPU tests); torch 2.11, the H200's, only
    `all_gather_into_tensor` (NCCL, and `--rank-of`'s local group)."""
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single(out, x, group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """`out` [n, ...] ← the sum over ranks of this rank's slice of `x` [N·n, ...] (as `all_gather_flat`:
    `reduce_scatter_single` from torch 2.13, `reduce_scatter_tensor` before)."""
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(out, x, group=group)
    else:
        dist.reduce_scatter_tensor(out, x, group=group)


def gather_vocab(local: torch.Tensor, shard: Shard, vocab: int) -> torch.Tensor:
    """Vocab-parallel logits `[T, v1 − v0]` (this rank's `vocab_range`) → full `[T, V]` on every
    rank: one all-gather of the ranges padded to ⌈V/N⌉ columns."""
    N = shard.world_size
    if N == 1:
        return local
    chunk = -(-vocab // N)
    T = local.shape[0]
    padded = F.pad(local, (0, chunk - local.shape[1])).contiguous()  # [T, chunk]
    out = local.new_empty(N * T, chunk)
    all_gather_flat(out, padded)
    return out.view(N, T, chunk).transpose(0, 1).reshape(T, N * chunk)[:, :vocab]
