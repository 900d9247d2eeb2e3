"""`top_positions(scores, k, best_first=False)` (kernels/selection.py) on the GPU: the reference's
chosen SET per row (by score, equal scores to the earlier column, -1 for a chosen -inf), unsorted.

Two paths, one entry (`top_positions_triton`), the first in two kernels:
- radix (CUDA rows of at most RADIX_MAX_COLS columns): `_radix_select_kernel`, one program a row,
  no `torch.topk`. Each score becomes an int32 whose signed order is the float order (-0.0 → +0.0 first,
  as the reference's `+ 0.0`). The k-th largest key t is found 4 bits a round from the top: a round
  bins the row's keys at or above `base` into 16 bins 2^shift keys wide (past the last: bin 15),
  BLOCK columns at a time (two 16-bit counts a word, so 8 reductions a trip, not 16), and moves
  `base` to the highest bin with at least k keys at or above it; after 8 rounds `base` is t, and the
  count above its last window is the number of keys > t. The last pass writes the columns > t and
  the first `k − #(> t)` equal to t, in column order, into the row's k slots (a packed exclusive
  `cumsum` a trip, counts carried between trips). Columns past the last whole BLOCK go TAIL at a
  time (2,176 columns read 2,304, not 4,096). Nine reads of the row (from L2 at decode sizes),
  32-bit keys, no int64 buffer.
- radix, resident (up to RADIX_RESIDENT_ROWS rows of at most RADIX_RESIDENT_COLS columns):
  `_radix_resident_kernel`, the same rounds and write on the row's keys loaded once into registers
  (one trip of the next power of two, up to 16 keys a thread at 16 warps, no spills at 8,192): at
  decode's one row the streamed kernel's 9 to 18 dependent L2 round trips (two a round at 2,176
  columns: a 2,048 trip and its tail) become one. The same output, column for column. By default
  8 bits a round (4 rounds of `tl.histogram`, RESIDENT_DIGIT_BITS). H100 (2026-12-06): 1.00x the
  streamed kernel at 1 x 2,176, 1.12x at 1 x 4,096, 1.25x at 8,192 columns; 8-bit digits 1.05-1.08x
  over 4. Latency-bound (~19 us for one row: a chain of CTA-wide steps, not bytes).
- keys + topk (longer rows, CPU tensors, or after `set_select_method("topk")`): `_selection_keys_kernel` writes the reference's
  int64 keys, `topk` picks the k largest unsorted, and the picks' own keys say which were -inf. The
  same positions in the same order as the reference on the same device.

The bound: under 20,000 columns at up to 20 rows torch's `topk` runs one block per row too
(`sbtopk::gatherTopK`, a radix over the 64-bit keys 2 bits a pass; its multi-block select starts
there, `should_use_multiblock` in ATen's TensorTopK.cu), against 8 passes over 32-bit keys here.
16,384 is the largest power of two under it; past it one program per row would race torch's
whole-GPU select at decode's few rows. `benchmarks/kernels/bench_selection.py` times both paths.

On the H200 (2026-12-05, `bench_selection`, alternating pairs, the same sets on both paths) radix
over keys + topk: 1 row × 2,176 columns 20.4 vs 27.4 µs (1.35×), 1 × 4,096 (2,176 visible) 1.19×,
1 × 16,384 1.04×, 64 × 8,192 2.10×, a 4,096-row prefill chunk × 8,192 1.13×, all at a 2,048-column
block. The same run's other blocks (lab/results/2026-12-05-r9/selection.json, one timing each) pick
the default: decode's few rows want the widest trip (4,096 columns: 1 × 16,384 69.9 µs, 64 × 8,192
39.1 µs, 1 × 4,096 22.9 µs) and a prefill chunk's thousands of rows a narrow one (512: 743 µs against
964 at 2,048, several programs an SM). `set_select_method` chooses the path, before any graph is
captured: the engine-level A/B of the two (`lab/diagnostics/decode_c1_profile.py --select radix|topk`). Both paths are CUDA-graph safe: shapes
from R, L and k only, no host sync.

Shapes: R rows, L columns, k picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_enter

__all__ = [
    "RADIX_MAX_COLS",
    "radix_block",
    "radix_resident",
    "resident_block",
    "set_select_method",
    "top_positions_keys",
    "top_positions_radix",
    "top_positions_triton",
    "uses_radix",
]

RADIX_MAX_COLS = 16384  # rows up to this many columns go to the radix kernel (module docstring)
# where the radix kernel runs: the interpreter (CPU CI) takes ~70 ms a row of it, so there rows take
# keys + topk and the tests call `top_positions_radix` themselves
RADIX_DEVICES = ("cuda",)
RADIX_MAX_BLOCK = 4096  # columns a radix trip holds at most (8 a thread at 16 warps)
RADIX_RESIDENT_COLS = 8192  # rows up to this many columns held in registers (16 a thread at 16 warps)
# the resident path by default up to this many rows: decode at low concurrency, the latency-bound case
# it was written for; at 64+ rows one 16-warp program an SM (103 registers at 8,192) is untimed against
# the streamed trips' several (raise it once `bench_selection --resident` says 64 x 8,192 gains)
RADIX_RESIDENT_ROWS = 16
# bits of the key a resident round settles: 4 (8 rounds of packed 16-bin counts) or 8 (4 rounds of
# `tl.histogram`'s 256 bins). H100, 2026-12-06 (`bench_selection --resident`, 5 alternating pairs a
# case, lab/results/2026-12-06-r15/more/resident.json): 8 bits 19.0 vs 20.5 us at 1 x 2,176 (1.08x),
# 1.08x at 1 x 4,096, 1.06x at 1 x 8,192, 1.05x at 64 x 8,192, the same outputs
RESIDENT_DIGIT_BITS = 8
RADIX_MANY_ROWS = 512  # from this many rows (~4 a multiprocessor) trips of RADIX_ROWS_BLOCK columns
RADIX_ROWS_BLOCK = 512
SELECT_METHODS = ("radix", "topk")
SELECT_METHOD = "radix"  # "topk": every row to keys + topk (`set_select_method`)

# keys below this are -inf scores: -inf's order-preserving bits are 0xFF800000 ^ 0x7FFFFFFF
NEG_INF_KEY_END = (-(2**31) + 0x7FFFFF + 1) << 32


@triton.jit
def _ordered_bits(s):
    """fp32 → int32 whose signed order is the float order (-0.0 taken as +0.0)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(2**31), 0, bits)  # -0.0 → +0.0, as the reference's `+ 0.0`
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _selection_keys_kernel(
    scores_ptr,  # [R, L] fp32
    keys_ptr,  # [R, L] int64
    L,
    stride_s,
    stride_k,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # rows on axis 0: a long prefill chunk may have > 65535
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < L
    s = tl.load(scores_ptr + row * stride_s + cols, mask=mask, other=0.0)
    key = _ordered_bits(s).to(tl.int64) * 4294967296 + (4294967295 - cols.to(tl.int64))
    tl.store(keys_ptr + row * stride_k + cols, key, mask=mask)


@triton.jit
def _row_keys(row_ptr, cols, L):
    """The ordered int32 keys of columns `cols` of one row (past L the least int32) and their mask."""
    mask = cols < L
    s = tl.load(row_ptr + cols, mask=mask, other=0.0)
    return tl.where(mask, _ordered_bits(s), -(2**31)), mask


@triton.jit
def _keys_histogram(keys, mask, base, shift, h_lo, h_hi):
    """h_lo, h_hi [8] plus `keys` [BLOCK] (where `mask`) at or above `base` by bin: bin
    (key − base) >> shift, 15 for all past it; bins 2j count in h_lo[j], 2j + 1 in h_hi[j]."""
    w = tl.arange(0, 8)
    dist = keys.to(tl.uint32, bitcast=True) - base.to(tl.uint32, bitcast=True)  # exact at >= base
    b = tl.minimum(dist >> shift, 15).to(tl.int32)  # [BLOCK] bin
    one = tl.where((keys >= base) & mask, tl.where((b & 1) == 1, 65536, 1), 0)  # its field
    # one word per pair of bins, two 16-bit counts in it (< 2^16 a chunk): 8 reductions, not 16
    packed = tl.sum(tl.where(w[:, None] == (b >> 1)[None, :], one[None, :], 0), axis=1)  # [8]
    return h_lo + (packed & 0xFFFF), h_hi + (packed >> 16)


@triton.jit
def _window_histogram(row_ptr, start, end, L, base, shift, h_lo, h_hi, BLOCK: tl.constexpr):
    """`_keys_histogram` over columns [start, end) of the row, BLOCK a trip."""
    for c0 in range(start, end, BLOCK):
        keys, mask = _row_keys(row_ptr, c0 + tl.arange(0, BLOCK), L)
        h_lo, h_hi = _keys_histogram(keys, mask, base, shift, h_lo, h_hi)
    return h_lo, h_hi


@triton.jit
def _next_base(h_lo, h_hi, k, base, n_above, shift):
    """One round's move (invariant: at least k keys >= base; n_above keys >= the window's end,
    base + 16 << shift): `base` to the highest bin with at least k keys at or above it."""
    c_lo = 2 * tl.arange(0, 8)  # [8] bins 0, 2, .., 14 (bin c starts at base + c << shift)
    c_hi = c_lo + 1  # [8] bins 1, 3, .., 15
    pair = h_lo + h_hi
    n_lo = tl.sum(pair) - tl.cumsum(pair, axis=0) + pair  # [8] keys in bins >= 2j
    n_hi = n_lo - h_lo  # [8] keys in bins >= 2j + 1
    # counts fall with the bin and bin 0 holds by the invariant: the number of bins 1..15
    # with at least k keys at or above them is the highest one
    pick = tl.sum(((n_lo >= k) & (c_lo > 0)).to(tl.int32)) + tl.sum((n_hi >= k).to(tl.int32))
    above = tl.sum(tl.where(c_lo == pick + 1, n_lo, 0) + tl.where(c_hi == pick + 1, n_hi, 0))
    n_above = tl.where(pick == 15, n_above, above)  # bin 15: the window keeps its end
    return base + (pick.to(tl.int64) << shift), n_above


@triton.jit
def _next_base256(keys, mask, k, base, n_above, shift):
    """`_next_base` after a histogram of 256 bins (`tl.histogram`): the keys at or above `base`
    binned by (key − base) >> shift, 255 for all past it; `base` moves to the highest bin with at
    least k keys at or above it, `n_above` to the keys past that bin (bin 255: the window's end)."""
    base32 = base.to(tl.int32)
    dist = keys.to(tl.uint32, bitcast=True) - base32.to(tl.uint32, bitcast=True)  # exact at >= base
    b = tl.minimum(dist >> shift, 255).to(tl.int32)
    h = tl.histogram(b, 256, mask=(keys >= base32) & mask)  # [256]
    bins = tl.arange(0, 256)
    n_ge = tl.sum(h) - tl.cumsum(h, axis=0) + h  # [256] keys in bins >= j
    pick = tl.sum(((n_ge >= k) & (bins > 0)).to(tl.int32))  # counts fall with the bin; bin 0 holds
    above = tl.sum(tl.where(bins == pick + 1, n_ge, 0))
    n_above = tl.where(pick == 255, n_above, above)
    return base + (pick.to(tl.int64) << shift), n_above


@triton.jit
def _write_keys(out_row_ptr, keys, mask, cols, t, need, n_gt, n_eq):
    """Columns `cols` [BLOCK] with their `keys`: write those > t and those == t while fewer than
    `need` came before, at their rank among the chosen (n_gt, n_eq: the ones > t and == t before
    them); returns the counts after them."""
    is_gt = keys > t
    is_eq = (keys == t) & mask
    packed = is_gt.to(tl.int32) + (is_eq.to(tl.int32) << 16)  # two counts < 2^16 a chunk
    before = tl.cumsum(packed, axis=0) - packed  # exclusive
    eq_before = n_eq + (before >> 16)
    take = is_gt | (is_eq & (eq_before < need))
    slot = n_gt + (before & 0xFFFF) + tl.minimum(eq_before, need)  # chosen columns before it
    pos = tl.where(keys == -(2**31) + 0x7FFFFF, -1, cols.to(tl.int64))  # -inf's key: -1
    tl.store(out_row_ptr + slot, pos, mask=take)
    total = tl.sum(packed)
    return n_gt + (total & 0xFFFF), n_eq + (total >> 16)


@triton.jit
def _write_chosen(row_ptr, out_row_ptr, start, end, L, t, need, n_gt, n_eq, BLOCK: tl.constexpr):
    """`_write_keys` over columns [start, end) of the row, BLOCK a trip."""
    for c0 in range(start, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        keys, mask = _row_keys(row_ptr, cols, L)
        n_gt, n_eq = _write_keys(out_row_ptr, keys, mask, cols, t, need, n_gt, n_eq)
    return n_gt, n_eq


@triton.jit
def _radix_select_kernel(
    scores_ptr,  # [R, L] fp32
    out_ptr,  # [R, k] int64 chosen columns, column order, -1 for a chosen -inf
    L,
    k,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,  # columns a trip, up to the last whole block
    TAIL: tl.constexpr,  # columns a trip after it (less padding: 2,176 columns read 2,304, not 4,096)
    PDL: tl.constexpr,  # launched with PDL: it reads nothing before the wait
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # rows on axis 0: a long prefill chunk may have > 65535
    row_ptr = scores_ptr + row * stride_s
    L_main = L // BLOCK * BLOCK
    # invariant: at least k keys >= base; n_above keys >= the window's end, base + 16 << shift
    base = tl.full((), -(2**31), tl.int64)
    n_above = tl.zeros((), tl.int32)
    for r in range(8):
        shift = 28 - 4 * r  # a bin of the window is 2^28 .. 2^0 keys wide
        base32 = base.to(tl.int32)
        h_lo = tl.zeros([8], tl.int32)
        h_hi = tl.zeros([8], tl.int32)
        h_lo, h_hi = _window_histogram(row_ptr, 0, L_main, L, base32, shift, h_lo, h_hi, BLOCK)
        h_lo, h_hi = _window_histogram(row_ptr, L_main, L, L, base32, shift, h_lo, h_hi, TAIL)
        base, n_above = _next_base(h_lo, h_hi, k, base, n_above, shift)
    t = base.to(tl.int32)  # the k-th largest key; n_above keys are > t
    need = k - n_above  # >= 1 columns equal to t, the earliest
    out_row_ptr = out_ptr + row * stride_o
    n_gt = tl.zeros((), tl.int32)
    n_eq = tl.zeros((), tl.int32)
    n_gt, n_eq = _write_chosen(row_ptr, out_row_ptr, 0, L_main, L, t, need, n_gt, n_eq, BLOCK)
    _write_chosen(row_ptr, out_row_ptr, L_main, L, L, t, need, n_gt, n_eq, TAIL)


@triton.jit
def _radix_resident_kernel(
    scores_ptr,  # [R, L] fp32
    out_ptr,  # [R, k] int64 chosen columns, column order, -1 for a chosen -inf
    L,
    k,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,  # >= L: the whole row in one trip, its keys held in registers
    PDL: tl.constexpr,  # launched with PDL: it reads nothing before the wait
    DIGIT_BITS: tl.constexpr = 4,  # bits of the key a round settles: 4 or 8
):
    """`_radix_select_kernel` for rows of at most BLOCK columns: the row read once, the rounds
    and the write on its keys in registers (decode: one L2 round trip, not 9 to 18). DIGIT_BITS 4:
    8 rounds of 16 bins (`_keys_histogram`'s packed reductions); 8: 4 rounds of 256 bins by
    `tl.histogram` (half the rounds, each a chain of CTA-wide steps: the kernel is latency-bound)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keys, mask = _row_keys(scores_ptr + row * stride_s, cols, L)  # [BLOCK], the row's one read
    base = tl.full((), -(2**31), tl.int64)  # the invariant of `_next_base`
    n_above = tl.zeros((), tl.int32)
    if DIGIT_BITS == 8:
        for r in range(4):
            base, n_above = _next_base256(keys, mask, k, base, n_above, 24 - 8 * r)
    else:
        for r in range(8):
            shift = 28 - 4 * r
            h_lo = tl.zeros([8], tl.int32)
            h_hi = tl.zeros([8], tl.int32)
            h_lo, h_hi = _keys_histogram(keys, mask, base.to(tl.int32), shift, h_lo, h_hi)
            base, n_above = _next_base(h_lo, h_hi, k, base, n_above, shift)
    zero = tl.zeros((), tl.int32)
    t = base.to(tl.int32)
    _write_keys(out_ptr + row * stride_o, keys, mask, cols, t, k - n_above, zero, zero)


def _check(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(
            f"scores must be float32 [R, L] with unit-stride rows, got {scores.dtype} {tuple(scores.shape)}"
        )
    if not 0 < k <= scores.shape[1]:
        raise ValueError(f"k must be in [1, {scores.shape[1]}], got {k}")


def top_positions_radix(
    scores: torch.Tensor,
    k: int,
    *,
    block: int | None = None,
    resident: bool | None = None,
    digit_bits: int | None = None,
) -> torch.Tensor:
    """scores [R, L] float32 → [R, k] int64 positions in column order, -1 for -inf: the radix path
    (any L; `top_positions_triton` sends it rows up to RADIX_MAX_COLS). `resident`: the row read
    once into registers (`_radix_resident_kernel`, rows up to RADIX_RESIDENT_COLS; default: for
    fewer than RADIX_MANY_ROWS rows that fit), or streamed every round (`_radix_select_kernel`).
    `block`: columns a trip of the streamed path, a power of two (default: `radix_block(R, L)`);
    the columns past its last whole block go block / 8 at a time. `digit_bits`: the resident
    kernel's bits a round, 4 or 8 (default RESIDENT_DIGIT_BITS)."""
    _check(scores, k)
    R, L = scores.shape
    out = torch.empty((R, k), dtype=torch.int64, device=scores.device)
    if resident is None:
        resident = block is None and radix_resident(R, L)
    if resident and L > RADIX_RESIDENT_COLS:
        raise ValueError(f"resident rows hold at most {RADIX_RESIDENT_COLS} columns, got {L}")
    block = resident_block(L) if resident else block or radix_block(R, L)
    if digit_bits not in (None, 4, 8):
        raise ValueError(f"digit_bits must be 4 or 8, got {digit_bits}")
    if block & (block - 1) or not 16 <= block <= 8192:  # and the packed counts need < 2^16 a chunk
        raise ValueError(f"block must be a power of two in [16, 8192], got {block}")
    if R and resident:
        _radix_resident_kernel[(R,)](
            scores, out, L, k, scores.stride(0), out.stride(0), BLOCK=block,
            DIGIT_BITS=digit_bits or RESIDENT_DIGIT_BITS, **pdl_args(scores.device),
            num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    elif R:
        _radix_select_kernel[(R,)](
            scores, out, L, k, scores.stride(0), out.stride(0), BLOCK=block, TAIL=max(16, block // 8),
            **pdl_args(scores.device), num_warps=min(16, max(1, block // 128)),
        )  # fmt: skip
    return out


def radix_resident(R: int, L: int) -> bool:
    """Whether R rows of L columns take the resident path by default: decode's few rows (up to
    RADIX_RESIDENT_ROWS) that fit registers; more rows, up to a prefill chunk's thousands, keep the
    streamed trips (`radix_block`), several programs a multiprocessor."""
    return R <= RADIX_RESIDENT_ROWS and L <= RADIX_RESIDENT_COLS


def resident_block(L: int) -> int:
    """The resident path's one trip: the least power of two >= L (at least 16)."""
    return max(16, 1 << (L - 1).bit_length())


def radix_block(R: int, L: int) -> int:
    """The default trip width for R rows of L columns: the largest power of two up to L and
    RADIX_MAX_BLOCK (at least 16) for decode's few rows; RADIX_ROWS_BLOCK (or less, for short rows)
    from RADIX_MANY_ROWS rows, where programs a multiprocessor matter more than trips a row."""
    cap = RADIX_ROWS_BLOCK if R >= RADIX_MANY_ROWS else RADIX_MAX_BLOCK
    return min(cap, max(16, 1 << (L.bit_length() - 1)))


def top_positions_keys(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, L] float32 → [R, k] int64 positions, -1 for -inf: the keys + topk path, the
    reference's positions in its order."""
    _check(scores, k)
    R, L = scores.shape
    keys = torch.empty((R, L), dtype=torch.int64, device=scores.device)
    if R:
        block = 1024
        _selection_keys_kernel[(R, triton.cdiv(L, block))](
            scores,
            keys,
            L,
            scores.stride(0),
            keys.stride(0),
            BLOCK=block,
            **pdl_args(scores.device),
            num_warps=4,
        )
    values, chosen = keys.topk(k, dim=-1, sorted=False)
    return torch.where(values < NEG_INF_KEY_END, -1, chosen)


def top_positions_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, L] float32 (-inf: not visible) → [R, k] int64 positions, unsorted, -1 for -inf:
    the reference's set. Radix for CUDA rows up to RADIX_MAX_COLS (unless `set_select_method("topk")`), keys +
    topk otherwise."""
    _check(scores, k)
    L = scores.shape[1]
    if k == L:  # every column chosen: -1 where not visible
        return torch.where(scores == float("-inf"), -1, torch.arange(L, device=scores.device))
    if uses_radix(scores):
        return top_positions_radix(scores, k)
    return top_positions_keys(scores, k)


def set_select_method(method: str) -> None:
    """ "radix" (the default) or "topk": every row to keys + topk, to measure the radix path's effect."""
    global SELECT_METHOD
    if method not in SELECT_METHODS:
        raise ValueError(f"select method must be one of {SELECT_METHODS}, got {method!r}")
    SELECT_METHOD = method


def uses_radix(scores: torch.Tensor) -> bool:
    """Whether `top_positions_triton` takes the radix path for these scores."""
    return (
        SELECT_METHOD == "radix"
        and scores.device.type in RADIX_DEVICES
        and scores.shape[-1] <= RADIX_MAX_COLS
    )
