"""A greedy verify's tail: each row's argmax with its token guard's ids banned, then each sequence's
accepted drafts. The op's public entry `verify_accept(args)` (two Triton launches on CUDA,
`kernels/verify_accept_triton.py`, where the torch reference is ten: the guard's four, the argmax,
the acceptance's four and the last accepted row), the torch reference `verify_accept_ref` elsewhere.

A uniform verify (backend/engine/speculative/greedy.py) runs B sequences of L = k + 1 rows: sequence
b's rows b·L … b·L + k, its input ids `[newest, d_1 … d_k]`. Per row i, t_i = the argmax of its
logits with the ids `guards[b, i]` set to -inf (-1 pads: bans nothing); ties go to the smallest id,
as `torch.argmax` breaks them, and a row whose every id is -inf answers 0 as it does. a_b = the
number of leading drafts equal to the target before them (d_{i+1} == t_i), and the last accepted
row is `query_start[b] + a_b`.

The kernel leaves the logits as they are; the reference masks them in place (what the sampled
step, which reads the masked logits after, does with `mask_guarded`). Non-finite logits: the kernel
ranks a NaN as +inf and sets a banned id to -inf whatever it held, where torch's argmax takes the
first NaN over any number and the reference's -inf added to a banned +inf makes one (so it answers
that banned id); a row with a NaN, or a banned +inf, may read differently. A finite row never.

Shapes: B sequences, L rows each (N = B·L), V vocabulary, S banned ids a row at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class VerifyAcceptArgs:
    logits: torch.Tensor  # [N, V] float32 or bf16, unit stride in V
    guards: torch.Tensor  # [B, L, S] int64 each row's banned ids, -1 padded, unit stride in S
    input_ids: torch.Tensor  # [N] int64 the verify's ids: row b·L + i + 1 holds d_{i+1}
    query_start: torch.Tensor  # [B + 1] int32 (b·L for a uniform verify)


@dataclass(frozen=True, slots=True)
class VerifyAccept:
    targets: torch.Tensor  # [B, L] int64 t_0 … t_k
    accepted: torch.Tensor  # [B] int64 a
    last: torch.Tensor  # [B] int64 query_start[b] + a: the row of the last accepted position


def verify_accept(args: VerifyAcceptArgs) -> VerifyAccept:
    """The op. Triton on CUDA (triton is the gpu extra: imported only there), the reference elsewhere."""
    if args.logits.is_cuda:
        from kernels.verify_accept_triton import verify_accept_triton

        return VerifyAccept(*verify_accept_triton(args.logits, args.guards, args.input_ids, args.query_start))
    return verify_accept_ref(args)


def verify_accept_ref(args: VerifyAcceptArgs) -> VerifyAccept:
    B, L, _ = args.guards.shape
    targets = mask_guarded(args.logits, args.guards).argmax(dim=-1).view(B, L)  # [B, L]
    accepted = accepted_count(targets, args.input_ids.view(B, L)[:, 1:])  # [B]
    return VerifyAccept(targets, accepted, args.query_start[:B] + accepted)


def accepted_count(targets: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[B] int64: how many leading drafts `[B, k]` equal the target's tokens `[B, k + 1]` before
    them (backend/engine/speculative/accept.py `accept_greedy`, on the device)."""
    k = drafts.shape[1]
    return (targets[:, :k] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)


def mask_guarded(logits: torch.Tensor, guards: torch.Tensor) -> torch.Tensor:
    """`logits [B·L, V]` of a uniform verify with -inf at each row's banned ids, in place, without a
    sync. `guards [B, L, S]`: each row's banned ids, -1 padded."""
    B, L, S = guards.shape
    V = logits.shape[1]
    # -inf added at a banned id, 0 at any other entry (padding lands on column 0): a column with
    # several entries gets -inf if any bans it, else keeps its value (x + 0 = x; a -0.0 becomes 0.0,
    # the same to argmax and softmax). Four launches.
    penalty = torch.where(guards >= 0, float("-inf"), 0.0)  # [B, L, S] float32
    logits.view(B, L, V).scatter_add_(2, guards.clamp(min=0), penalty.to(logits.dtype))
    return logits
