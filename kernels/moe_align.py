"""Token→expert alignment for the fused MoE's tensor-core tiles: (token, slot) pairs grouped by expert
into BM-padded blocks, in one single-program Triton launch.

Shape letters: M tokens, k slots, P = M·k pairs (pair p = token·k + slot), E local experts (bucket E
holds the pairs whose expert is on another rank), NB = next power of two >= E + 1 bins, BM block rows.

Why a kernel: the torch formulation (`moe_align_ref`: stable sort, two searchsorted, cumsum, index
arithmetic, a scatter) is ~30 launches; replayed in a CUDA graph each costs ~2 µs on the H200 for
almost no work, so it took 64-139 µs whatever the batch (66 µs for 8 pairs). One program does it all:
1. a histogram of buckets (`tl.histogram`, chunks of BLOCK_P pairs) -> counts [NB], padded to BM,
   cumsum -> each bucket's first slot;
2. block b's expert = the number of buckets ending at or before b·BM (a [BLOCK_B, NB] comparison);
3. every slot set to P (padding), then a barrier;
4. per chunk: `tl.sort` of `bucket·BLOCK_P + index` (so equal buckets keep pair order: the result is
   the stable sort's), and each pair's slot = its bucket's running slot + its rank among the chunk's
   pairs of that bucket.
Exactly `moe_align_ref`'s output (the tests compare them bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["align_chunk", "moe_align", "moe_align_ref", "num_align_blocks"]


@triton.jit
def _buckets(ids_ptr, p0, P, num_experts, BLOCK_P: tl.constexpr):
    """Pairs p0..p0+BLOCK_P: (bucket [BLOCK_P] int32, in range), bucket E for another rank's expert."""
    offs = p0 + tl.arange(0, BLOCK_P)
    ok = offs < P
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    return tl.where((e >= 0) & (e < num_experts), e, num_experts).to(tl.int32), ok


# Everything that follows the step's token count is a run-time value or one of two chunk sizes, so
# the warm-up's shapes compile every variant a workload can meet: P and num_blocks unspecialised
# (Triton would otherwise compile a variant per divisibility by 16 of each size and alignment of each
# pointer, a view at an odd offset among them), BLOCK_M a run-time argument (the tile config picks it
# from pairs per expert, so a token count between the warm-up's could pair a BLOCK_M with a chunk
# size no warm-up step did), and BLOCK_P two sizes (`align_chunk`). The H200 warm-up test saw one
# variant compiled after the warm-up (2026-12-04) before these.
@triton.jit(
    do_not_specialize=[
        "ids_ptr",
        "sorted_ids_ptr",
        "block_expert_ids_ptr",
        "num_padded_ptr",
        "P",
        "num_blocks",
        "block_m",
    ]
)
def _moe_align_kernel(
    ids_ptr,  # [P] int32 / int64 local expert ids
    sorted_ids_ptr,  # [num_blocks · BM] int32
    block_expert_ids_ptr,  # [num_blocks] int32
    num_padded_ptr,  # [1] int32
    P,
    num_experts,
    num_blocks,
    block_m,  # rows of a block (BM)
    NUM_BINS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    """Grid (1,): see the module docstring for the four steps."""
    pdl_enter(PDL)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        bucket, ok = _buckets(ids_ptr, p0, P, num_experts, BLOCK_P)
        counts += tl.histogram(bucket, NUM_BINS, mask=ok)
    padded = (counts + block_m - 1) // block_m * block_m
    end = tl.cumsum(padded, 0)  # [NB] one past each bucket's last slot
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for b0 in range(0, num_blocks, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        bucket = tl.sum((end[None, :] <= (blk * block_m)[:, None]).to(tl.int32), 1)  # [BLOCK_B]
        tl.store(
            block_expert_ids_ptr + blk, tl.where(bucket < num_experts, bucket, -1), mask=blk < num_blocks
        )
    for s0 in range(0, num_blocks * block_m, BLOCK_P):
        slots = s0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ids_ptr + slots, tl.full((BLOCK_P,), P, tl.int32), mask=slots < num_blocks * block_m)
    tl.debug_barrier()  # the padding lands before the pair ids
    nxt = end - padded  # [NB] each bucket's next free slot
    rank = tl.arange(0, BLOCK_P)  # position in the chunk's sorted order
    for p0 in range(0, P, BLOCK_P):
        bucket, ok = _buckets(ids_ptr, p0, P, num_experts, BLOCK_P)
        key = tl.sort(tl.where(ok, bucket * BLOCK_P + tl.arange(0, BLOCK_P), NUM_BINS * BLOCK_P))
        live = key < NUM_BINS * BLOCK_P
        sb = tl.minimum(key // BLOCK_P, NUM_BINS - 1)  # [BLOCK_P] bucket in sorted order
        hist = tl.histogram(bucket, NUM_BINS, mask=ok)
        before = tl.cumsum(hist, 0) - hist  # [NB] chunk pairs in smaller buckets
        dest = tl.gather(nxt, sb, 0) + rank - tl.gather(before, sb, 0)
        tl.store(sorted_ids_ptr + dest, p0 + key % BLOCK_P, mask=live)
        nxt += hist


def align_chunk(num_pairs: int) -> int:
    """Pairs per chunk of `_moe_align_kernel` (BLOCK_P): 128 up to 128 pairs (decode), else 1024 (one
    chunk up to 128 tokens of top-8, then several). Two sizes, not the next power of two, so that the
    variants are few and fixed (see the note above the kernel)."""
    return 128 if num_pairs <= 128 else 1024


def num_align_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks `moe_align` returns: enough for every bucket's padding, at most one per pair."""
    return max(1, min(triton.cdiv(num_pairs + (num_experts + 1) * (block_m - 1), block_m), num_pairs))


def moe_align(
    expert_ids: torch.Tensor,  # [M, k] int, local expert ids; outside [0, E) = not on this rank
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert into BM-padded blocks, one launch, no host sync.

    Returns `sorted_ids [num_blocks·BM]` int32 (pair ids `token·k + slot`, each expert's run padded
    with P up to a multiple of BM), `block_expert_ids [num_blocks]` int32 (-1 for the bucket of pairs
    not on this rank and for blocks past the end) and `num_padded [1]` int32 (blocks in use · BM),
    `num_blocks = num_align_blocks(P, E, BM)`. Within an expert, pairs keep token order.
    """
    flat = expert_ids.reshape(-1).contiguous()  # [P]
    P = flat.numel()
    num_blocks = num_align_blocks(P, num_experts, block_m)
    sorted_ids = torch.empty((num_blocks * block_m,), dtype=torch.int32, device=flat.device)
    block_expert_ids = torch.empty((num_blocks,), dtype=torch.int32, device=flat.device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=flat.device)
    _moe_align_kernel[(1,)](
        flat, sorted_ids, block_expert_ids, num_padded, P, num_experts, num_blocks, block_m,
        NUM_BINS=triton.next_power_of_2(num_experts + 1), BLOCK_P=align_chunk(P), BLOCK_B=32,
        **pdl_args(flat.device), num_warps=4,
    )  # fmt: skip
    return sorted_ids, block_expert_ids, num_padded


def moe_align_ref(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in torch ops (stable sort, searchsorted, cumsum): the tests' reference."""
    E, BM = num_experts, block_m
    flat = expert_ids.reshape(-1).to(torch.int64)  # [P]
    P = flat.numel()
    dev = flat.device
    bucket = torch.where((flat >= 0) & (flat < E), flat, E)  # [P], E = not on this rank
    sorted_bucket, order = torch.sort(bucket, stable=True)  # [P]
    bounds = torch.searchsorted(sorted_bucket, torch.arange(E + 2, device=dev))  # [E+2] run starts
    counts = bounds[1:] - bounds[:-1]  # [E+1]
    padded_end = torch.cumsum((counts + BM - 1) // BM * BM, 0)  # [E+1]
    padded_start = padded_end - (counts + BM - 1) // BM * BM
    dest = padded_start[sorted_bucket] + torch.arange(P, device=dev) - bounds[sorted_bucket]  # [P]
    num_blocks = num_align_blocks(P, E, BM)
    sorted_ids = torch.full((num_blocks * BM,), P, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_bucket = torch.searchsorted(padded_end, torch.arange(num_blocks, device=dev) * BM, right=True)
    block_expert_ids = torch.where(block_bucket < E, block_bucket, -1).to(torch.int32)
    return sorted_ids, block_expert_ids, padded_end[-1:].to(torch.int32)
