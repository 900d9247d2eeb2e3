"""The `@triton.jit` device functions more than one op uses (ops import them from here, never from
each other), in four parts, and one rule:
- Programmatic Dependent Launch on the decode path (`pdl_args`, `pdl_wait`, ...): the rules every
  PDL kernel follows are written once, at that section;
- INT4 decode dot products on the CUDA cores (the W4A16 GEMV `kernels/w4a16_gemv.py`, the fused
  MoE's sparse-decode GEMV `kernels/fused_moe.py`), described below, and INT4 tile unpacking for the
  tensor-core GEMMs (W4A16, W4A8, the fused MoE's tiles, `kernels/int4_dequant.py`);
- the fused MoE's tile rows, epilogues and split-K GEMV finish (INT4 and FP8, `kernels/moe_routing.py`
  drives them);
- prefill query tiles (`QueryTiles`, built by `query_tiles`, read by `query_tile`) for MLA, GQA and
  the DSA indexer.

The page-table bound every paged read keeps: a kernel walks at most `Mp * S` tokens of a sequence, Mp
the page table's width (a runtime argument `num_cols`, never specialised; the DSA scores' `W`). A
sequence longer than its row, a wrong reservation that no planner makes, then reads its own row's pages
only, never the next row's or past the table (the CPU references raise on such a length). The bound is
one integer minimum before the token loop. Such a row is not flagged: flagging it inside the kernels
held 4-17 more registers through the DSA, GQA and MLA loops on sm90 (the DSA scores' and FP8 GQA
decode's occupancy fell). Within the table, a read past a row's own pages is a tag fault: a column
past them expects `PAST_TAG`, which no page carries (eager steps' tables pad with it, the graphs
stage it: `backend.engine.decode_graphs`).

INT4 decode dot products: one activation row against a K tile of packed checkpoint words, two
instructions per weight.

Shape letters: BN weight rows of the tile, BK its K range, BK8 = BK/8 words per row, C = BK/32 chunks
of four words (32 k, inside one scale group: the callers need G >= 32).

Why it is fast (sm_90a SASS per nibble: one LOP3, one FFMA; `tests/kernels/sm90_compile_int4.py`):
- An fp32 bit pattern below 2^24 is that integer times 2^-149 (exponent field 0 is denormal, field 1
  continues it exactly), so `w & (0xF << 4j)` read as fp32 *is* `nibble_j · 2^(4j - 149)` for nibbles
  0..5; nibbles 6 and 7 come from `w >> 8` (one shift per word). FFMA takes denormals at full rate,
  and nothing here is compiled with flush-to-zero.
- The activation is "lifted" instead: `y_j = x_j · 2^(77 - 4j')` (j' the nibble's place in its word
  or in `w >> 8`), so every product is `nibble · x · 2^-72` exactly, and the -8 zero point of a word
  is one subtraction `xs = 8 · 2^-72 · sum_j x_j`, folded into the chain's first FFMA. The range:
  |x| < 2^51 strictly (at 2^51 a lifted value is inf, and `q·y − xs` is inf − inf: the whole output
  row is NaN); below, accuracy fades from |x| ~ 2^-54 down, sooner for smaller group scales (the
  products go denormal). An LLM's activation row lies far inside it.
- Tiles are K-major `[BK8, BN]`: Triton gives each thread four consecutive words (one 16-byte load
  per row) of BN/16 rows, so a thread's lifted activations serve all of its rows, and the chunk
  sums land in the layout of the scale loads (no shared-memory round trip in the loop).
- The activation comes lifted (`LIFTED`: `lift_rows`, or the gate/up kernel's epilogue for the MoE
  down GEMV; nine 16-byte loads per chunk, one FFMA chain per word), or raw (32 two-byte loads, a
  convert and a multiply per k, no launch before; one chain per chunk, a third fewer registers).
- `group_dots`: one word tile against several rows (the MoE's pairs of one expert): its LOP3s
  serve them all, one FFMA per row and nibble.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = [
    "LIFTED_ROW",
    "LIFT_SCALE",
    "MAGIC_2_23",
    "PDL_MIN_CAPABILITY",
    "QueryTiles",
    "group_dots",
    "grouped_tile",
    "int4_chunk_dots",
    "int4_tile_dot",
    "lift_rows",
    "lifted_width",
    "load_int4_tile",
    "moe_block_rows",
    "moe_gemv_finish",
    "moe_pair_expert",
    "moe_tile_epilogue",
    "pdl_args",
    "pdl_enter",
    "pdl_launch_dependents",
    "pdl_wait",
    "prefetch_l2",
    "query_tile",
    "query_tiles",
    "set_pdl",
    "split_k_finish",
    "unpack_tile",
    "x_planes",
]

# Programmatic Dependent Launch (PDL). A decode step at concurrency 1 is ~470 small kernels (issue 24),
# each paying a fixed cost before its first useful byte: its launch, its programs' ramp-up, the DRAM
# latency of its first loads, on top of the tail of the kernel before it. A kernel launched with PDL
# (Triton's `launch_pdl=True`: the launch attribute "programmatic stream serialization", sm_90+) may
# start while the kernel before it in the stream still runs, so that cost overlaps the other's tail.
# The rules every PDL kernel here keeps:
# 1. It calls `pdl_wait` (PTX griddepcontrol.wait: returns once the kernels it depends on have
#    completed and their writes are visible) before it reads anything a kernel may have written
#    (activations, the router's ids and weights, KV lines, page tags and tables, sequence lengths,
#    split-K counters) and before it writes or atomically updates anything (an earlier kernel may still read
#    or write that buffer).
# 2. Before the wait it reads only data constant for the whole graph: weights and their scales, a
#    norm's weight, a router's bias, written at load time and never by a kernel of a step. The W4A16
#    and FP8 GEMVs load their first weight tile there; the fused MoE cannot (its experts are the
#    router's output). "Written long enough ago" is not enough: see rule 4. (Eagerly, as in a test,
#    a weight written by the kernel just before is in memory once that kernel's programs have all
#    exited, which is when a launch after a kernel without the trigger starts; only the wait promises it.)
# 3. Every program waits, unconditionally, before any early return. The kernel then completes only
#    after the one before it did, so completion stays ordered down the stream.
# 4. It calls `pdl_launch_dependents` (griddepcontrol.launch_dependents) first: the next PDL kernel
#    is scheduled once every program of this one has started, and waits in rule 1. So a kernel may be
#    running while two or more kernels before it have not completed.
# 5. Only a kernel that contains the wait is launched with the attribute. Anything else (torch and
#    cuBLAS kernels, copies, NCCL, the Triton kernels off the GLM-5 / Kimi decode path: GQA attention,
#    W4A8, the INT4 dequantizing pass, `lift_rows`) is launched normally and starts after everything
#    before it completed, so the two kinds mix freely.
# 6. The wait is inline PTX: not under TRITON_INTERPRET=1 (the CPU CI) nor before sm_90. A PDL kernel
#    takes `PDL: tl.constexpr` and its launcher passes `**pdl_args(device)`, true for both the
#    constexpr and `launch_pdl` only on a CUDA device of compute capability >= 9 while the process's
#    switch is on (`set_pdl`; `kumo backend --no-pdl`, `kumo bench engine decode-c1 --no-pdl`).
# CUDA graphs: stream capture (CUDA >= 12.3) records a PDL launch as a programmatic edge, so a replay
# keeps the overlap, and the setting the graph was captured with: set the switch before an engine is
# built. Profiles: a kernel that starts early counts its wait in its time, so under PDL the sum of
# kernel times overstates the device time (compare steps' wall time). Checked by
# `tests/kernels/sm90_compile_pdl.py` (every PDL kernel's PTX and SASS: the wait, no store before it,
# loads before it only in the kernels of rule 2), `tests/kernels/test_pdl.py` (a captured graph's
# programmatic edges) and `tests/backend/engine/test_pdl_decode_cuda.py` (decode on = off, bit for bit).

PDL_MIN_CAPABILITY = 9  # griddepcontrol: Hopper and later
PDL_ENABLED = True  # the process's switch (`set_pdl`)


def set_pdl(enabled: bool) -> None:
    """Turn PDL on (the default) or off for every launch from now on (the A/B of its effect); a CUDA
    graph keeps the setting it was captured with."""
    global PDL_ENABLED
    PDL_ENABLED = enabled


@functools.cache
def _can_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= PDL_MIN_CAPABILITY


def pdl_args(device: torch.device) -> dict[str, bool]:
    """A PDL kernel's launch arguments on `device`: its `PDL` constexpr and Triton's `launch_pdl`, both
    true on CUDA at compute capability >= 9 while `set_pdl` leaves PDL on (rule 6 above)."""
    on = PDL_ENABLED and _can_pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Rule 4: the next PDL kernel may be scheduled once every program has passed here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Rule 1: every kernel this one depends on has completed, its writes visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first line when it reads nothing before the wait: rules 4 then 1."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the line (128 bytes) holding each of `ptrs` where `mask`: PTX prefetch.global.L2, no
    register held and nothing waited for (rule 2: a GEMV's first weight tile before its wait, where a
    load into registers would cost the whole kernel occupancy). Inline PTX: GPU only."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; } // dummy $0",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# INT4 decode dot products

LIFT_SCALE: tl.constexpr = tl.constexpr(2.0**72)  # the dots come out in units of 2^-72
# fp32 per chunk of 32 k in a lifted row: plane j = 0..7 of its 4 words (4 each), then their 4 xs
LIFTED_ROW: tl.constexpr = tl.constexpr(36)


@triton.jit
def _lift_exp(J: tl.constexpr):
    """2^(77 - 4j') for nibble J, j' its place in the word (0..5) or in the word >> 8 (6, 7 -> 4, 5)."""
    if J < 6:
        return 2.0 ** (77 - 4 * J)
    else:
        return 2.0 ** (77 - 4 * (J - 2))


@triton.jit
def _nibble(J: tl.constexpr, w, wh):
    """Nibble J of words w (wh = w >> 8) as fp32 `nibble · 2^(4j' - 149)`: one LOP3."""
    if J < 6:
        return (w & (0xF << (4 * J))).to(tl.float32, bitcast=True)
    else:
        return (wh & (0xF << (4 * (J - 2)))).to(tl.float32, bitcast=True)


@triton.jit
def _load_k(ptrs, ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def x_planes(x_row, r, r_ok, stride_xk, LIFTED: tl.constexpr, EVEN_K: tl.constexpr):
    """Activation for words r [BK8]: (8 planes y_j [BK8], xs [BK8]) fp32 (see the module docstring).
    LIFTED: x_row is a lifted row ([K/32, 36] fp32); else the raw row (K elements)."""
    if LIFTED:
        xb = x_row + (r // 4) * LIFTED_ROW + r % 4
        ys = (
            _load_k(xb, r_ok, EVEN_K), _load_k(xb + 4, r_ok, EVEN_K), _load_k(xb + 8, r_ok, EVEN_K),
            _load_k(xb + 12, r_ok, EVEN_K), _load_k(xb + 16, r_ok, EVEN_K), _load_k(xb + 20, r_ok, EVEN_K),
            _load_k(xb + 24, r_ok, EVEN_K), _load_k(xb + 28, r_ok, EVEN_K),
        )  # fmt: skip
        return ys, _load_k(xb + 32, r_ok, EVEN_K)
    else:
        xk = x_row + r * 8 * stride_xk
        x0 = _load_k(xk, r_ok, EVEN_K)
        x1 = _load_k(xk + stride_xk, r_ok, EVEN_K)
        x2 = _load_k(xk + 2 * stride_xk, r_ok, EVEN_K)
        x3 = _load_k(xk + 3 * stride_xk, r_ok, EVEN_K)
        x4 = _load_k(xk + 4 * stride_xk, r_ok, EVEN_K)
        x5 = _load_k(xk + 5 * stride_xk, r_ok, EVEN_K)
        x6 = _load_k(xk + 6 * stride_xk, r_ok, EVEN_K)
        x7 = _load_k(xk + 7 * stride_xk, r_ok, EVEN_K)
        xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        ys = (
            x0 * _lift_exp(0), x1 * _lift_exp(1), x2 * _lift_exp(2), x3 * _lift_exp(3),
            x4 * _lift_exp(4), x5 * _lift_exp(5), x6 * _lift_exp(6), x7 * _lift_exp(7),
        )  # fmt: skip
        return ys, xs * 2.0**-69


@triton.jit
def _word_dots(wp, ys, xs):
    """`_chunk_dots` with one FFMA chain per word (vector loads of lifted x serve them; more registers)."""
    BK8: tl.constexpr = wp.shape[0]
    BN: tl.constexpr = wp.shape[1]
    wh = wp >> 8  # nibbles 6, 7 at bits 16..23
    d = _nibble(0, wp, wh) * ys[0][:, None] - xs[:, None]
    for j in tl.static_range(1, 8):
        q = _nibble(j, wp, wh)
        d += q * ys[j][:, None]
    return tl.sum(tl.reshape(d, (BK8 // 4, 4, BN)), axis=1)


@triton.jit
def _quarters(v):
    """[BK8] or [BK8, BN] with each chunk's 4 words in one thread -> its 4 word slices [C] / [C, BN]
    as a tuple (reshape, permute and split: register renaming, no data moves)."""
    C: tl.constexpr = v.shape[0] // 4
    if len(v.shape) == 1:
        v4 = tl.permute(tl.reshape(v, (C, 2, 2)), (0, 2, 1))  # word 2a + b at [c, b, a]
    else:
        v4 = tl.permute(tl.reshape(v, (C, 2, 2, v.shape[1])), (0, 3, 2, 1))  # at [c, n, b, a]
    a0, a1 = tl.split(v4)
    w0, w1 = tl.split(a0)
    w2, w3 = tl.split(a1)
    return w0, w1, w2, w3


@triton.jit
def _chain_dots(wp, ys, xs):
    """`_chunk_dots` with one FFMA chain per chunk: the 4 words and their activations split apart in
    registers (a quarter of the accumulators, no word sum; scalar loads of x, as the raw path has)."""
    BK8: tl.constexpr = wp.shape[0]
    words = _quarters(wp)
    d = -tl.sum(tl.reshape(xs, (BK8 // 4, 4)), axis=1)[:, None]
    for i in tl.static_range(4):
        w = words[i]
        wh = w >> 8
        for j in tl.static_range(8):
            q = _nibble(j, w, wh)
            d += q * _quarters(ys[j])[i][:, None]
    return d


@triton.jit
def _chunk_dots(wp, ys, xs, LIFTED: tl.constexpr):
    """wp [BK8, BN] int32 words, (ys, xs) from `x_planes` -> [C, BN] fp32: per chunk of 4 words and
    row, `sum (nibble - 8) · x` in units of 2^-72 (before the group scale)."""
    if LIFTED:
        return _word_dots(wp, ys, xs)
    else:
        return _chain_dots(wp, ys, xs)


@triton.jit
def load_int4_tile(w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
               GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):  # fmt: skip
    """K tile t of weight rows `rows` [BN]: words [BK8, BN] int32 and fp32 scales [C, BN]; words past
    K (or rows past N) load as zero, as do their scales."""
    BK8: tl.constexpr = BLOCK_K // 8
    C: tl.constexpr = BLOCK_K // 32
    r = t * BK8 + tl.arange(0, BK8)
    c = t * C + tl.arange(0, C)
    wptrs = w_ptr + rows[None, :] * stride_wn + r[:, None] * stride_wk
    sptrs = s_ptr + rows[None, :] * stride_sn + (c * 32 // GROUP_SIZE)[:, None] * stride_sg
    if EVEN_K and EVEN_N:
        return tl.load(wptrs), tl.load(sptrs).to(tl.float32)
    else:
        wp = tl.load(wptrs, mask=rows_ok[None, :] & (r < K8)[:, None], other=0)
        sc = tl.load(sptrs, mask=rows_ok[None, :] & (c < KG * (GROUP_SIZE // 32))[:, None], other=0.0)
        return wp, sc.to(tl.float32)


@triton.jit
def int4_tile_dot(w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg, ys, xs,
                   GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LIFTED: tl.constexpr, EVEN_K: tl.constexpr,
                   EVEN_N: tl.constexpr):  # fmt: skip
    """K tile t of weight rows `rows` [BN] against the activation planes: [C, BN] fp32, group scales
    applied (units of 2^-72)."""
    wp, sc = load_int4_tile(
        w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
        GROUP_SIZE, BLOCK_K, EVEN_K, EVEN_N,
    )  # fmt: skip
    return int4_chunk_dots(wp, sc, ys, xs, LIFTED)


@triton.jit
def int4_chunk_dots(wp, sc, ys, xs, LIFTED: tl.constexpr):
    """Words wp [BK8, BN] with their scales sc [C, BN] against the activation planes: [C, BN] fp32,
    group scales applied (units of 2^-72); for callers that load the words themselves."""
    return _chunk_dots(wp, ys, xs, LIFTED) * sc


@triton.jit
def group_dots(wp, sc, x_rows, r, r_ok, EVEN_K: tl.constexpr):
    """`_word_dots` of one word tile wp [BK8, BN] (scales sc [C, BN]) against several lifted rows
    (`x_rows`, a tuple of row pointers): each nibble's LOP3 serves every row, one FFMA per row.
    Returns the tuple of their [C, BN] sums, group scales applied."""
    BK8: tl.constexpr = wp.shape[0]
    BN: tl.constexpr = wp.shape[1]
    wh = wp >> 8
    q = _nibble(0, wp, wh)
    ds = ()
    for i in tl.static_range(len(x_rows)):
        xb = x_rows[i] + (r // 4) * LIFTED_ROW + r % 4
        ds = ds + (q * _load_k(xb, r_ok, EVEN_K)[:, None] - _load_k(xb + 32, r_ok, EVEN_K)[:, None],)
    for j in tl.static_range(1, 8):
        q = _nibble(j, wp, wh)
        nxt = ()
        for i in tl.static_range(len(x_rows)):
            xb = x_rows[i] + (r // 4) * LIFTED_ROW + r % 4 + 4 * j
            nxt = nxt + (ds[i] + q * _load_k(xb, r_ok, EVEN_K)[:, None],)
        ds = nxt
    out = ()
    for i in tl.static_range(len(x_rows)):
        out = out + (tl.sum(tl.reshape(ds[i], (BK8 // 4, 4, BN)), axis=1) * sc,)
    return out


@triton.jit
def _lift_kernel(x_ptr, out_ptr, K, num_chunks, stride_xm, stride_xk, stride_om, BLOCK_C: tl.constexpr):
    """x [M, K] -> out [M, num_chunks, 36] fp32 lifted rows; grid (M, cdiv(num_chunks, BLOCK_C))."""
    m = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = c[:, None] * 4 + tl.arange(0, 4)[None, :]  # [BLOCK_C, 4] words
    ys, xs = x_planes(x_ptr + m * stride_xm, r, r < K // 8, stride_xk, False, False)
    out = out_ptr + m * stride_om + r // 4 * LIFTED_ROW + r % 4
    c_ok = r < num_chunks * 4
    for j in tl.static_range(8):
        tl.store(out + 4 * j, ys[j], mask=c_ok)
    tl.store(out + 32, xs, mask=c_ok)


def lifted_width(K: int) -> int:
    """fp32 per lifted row of K (a multiple of 32) activations."""
    return K // 32 * LIFTED_ROW.value


def lift_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, lifted_width(K)] fp32, the `LIFTED` activation format (one small launch)."""
    M, K = x.shape
    out = torch.empty((M, lifted_width(K)), dtype=torch.float32, device=x.device)
    chunks = K // 32
    _lift_kernel[(M, triton.cdiv(chunks, 64))](x, out, K, chunks, *x.stride(), out.stride(0), BLOCK_C=64)
    return out


# INT4 tensor-core tiles (W4A16 / W4A8 GEMMs, the fused MoE's tiles): unpack and tile order

MAGIC_2_23 = 0x4B000000  # bits of 2^23: OR a nibble into the low mantissa bits to get 2^23 + nibble


@triton.jit
def _nib(wp, sc, magic_2_23, J: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble J of every word, `(q - 8) · s` in DTYPE: SHF, LOP3 (AND+OR), FADD, FMUL, convert."""
    q = (wp >> (4 * J)) & 0xF
    return (((q | magic_2_23).to(tl.float32, bitcast=True) - 8388616.0) * sc).to(DTYPE)


@triton.jit
def unpack_tile(wp, sc, magic_2_23, DTYPE: tl.constexpr):
    """[BN, BK8] words and per-word scales -> [BN, 8·BK8] weights, k = 8r + j.

    Each nibble plane uses compile-time shifts; the interleave tree puts the eight k of a word side
    by side in one thread (16-byte shared-memory stores of the K-major tensor-core operand).
    """
    e0 = tl.interleave(
        tl.interleave(_nib(wp, sc, magic_2_23, 0, DTYPE), _nib(wp, sc, magic_2_23, 4, DTYPE)),
        tl.interleave(_nib(wp, sc, magic_2_23, 2, DTYPE), _nib(wp, sc, magic_2_23, 6, DTYPE)),
    )  # even k
    e1 = tl.interleave(
        tl.interleave(_nib(wp, sc, magic_2_23, 1, DTYPE), _nib(wp, sc, magic_2_23, 5, DTYPE)),
        tl.interleave(_nib(wp, sc, magic_2_23, 3, DTYPE), _nib(wp, sc, magic_2_23, 7, DTYPE)),
    )  # odd k
    return tl.interleave(e0, e1)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped order: GROUP_M row-tiles walk N together, so their
    weight tiles are reused from L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows
    return pid_m, pid_n


# split-K GEMMs (W4A16, the FP8 weight-only GEMM): partial sums, fixed-order finish


@triton.jit
def split_k_finish(
    acc,  # [BM, BN] fp32 partial (or full) sum of this program
    out_ptr,
    ws_ptr,
    cnt_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_om,
    stride_on,
    tile_id,
    pid_k,
    num_splits,  # the grid's K axis: run time in the GEMV (one compiled kernel for every split), constexpr in the tiles
):
    """Store the tile, or park a split-K partial; the last of num_splits programs sums the partials."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if num_splits == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # ws: [num_splits, M, N] fp32
        tl.store(ws + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            total = tl.zeros_like(acc)
            for s in range(num_splits):  # fixed order: deterministic whichever program is last
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)


# fused MoE (INT4 and FP8): tile rows, epilogues, the GEMV's split-K finish


@triton.jit
def _silu(g):
    """`g · sigmoid(g)` from `exp(-|g|)`: no overflow for large |g| (fp32)."""
    e = tl.exp(-tl.abs(g))
    return g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def moe_block_rows(pid, N, num_pairs, sorted_ids_ptr, block_expert_ids_ptr, num_padded_ptr, out_ptr, stride_om, stride_on,
                GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Tile kernels: program pid's (expert block, N tile) -> (expert, pair [BM], m_ok, offs_n [BN], n_ok,
    out_ptrs [BM, BN], out_mask). expert < 0: nothing to compute (a block past the used ones, or the
    pairs routed to another rank: their act rows are never read, their y rows are zeroed here)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n  # the N tiles of one block run side by side: its A rows stay in L2
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    m_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    out_mask = m_ok[:, None] & n_ok[None, :]
    expert = tl.load(block_expert_ids_ptr + pid_m)
    expert = tl.where(pid_m * BLOCK_M >= tl.load(num_padded_ptr), -2, expert)  # past the used blocks
    if not GATE_UP:  # noqa: SIM102 (a constexpr: gate/up compiles no store)
        if expert == -1:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=out_mask)
    return expert, pair, m_ok, offs_n, n_ok, out_ptrs, out_mask


@triton.jit
def moe_tile_epilogue(acc, acc_up, topk_w_ptr, pair, m_ok, out_ptrs, out_mask,
                   GATE_UP: tl.constexpr, MUL_WEIGHT: tl.constexpr):  # fmt: skip
    """acc / acc_up [BM, BN] fp32 -> out: silu(gate) * up for GATE_UP, the routing weight for MUL_WEIGHT."""
    if GATE_UP:
        acc = _silu(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def moe_pair_expert(pair, num_experts, topk_ids_ptr):
    """GEMV programs: (expert clamped into [0, E), is_local) of `pair`; ids outside [0, E) are another
    rank's, whose programs run no K loop and take no part in the reductions (`moe_gemv_finish`)."""
    expert = tl.load(topk_ids_ptr + pair)
    is_local = (expert >= 0) & (expert < num_experts)
    return tl.where(is_local, expert, 0).to(tl.int64), is_local  # ids may be int32 or int64


@triton.jit
def _store_row(v, row_ptr, offs_n, n_ok, LIFT_OUT: tl.constexpr):
    """v [BN] fp32 -> row n of out, in its dtype; LIFT_OUT: as a lifted row (`kernels/triton_lib.py`:
    v·2^(77-4j') at chunk n//32, plane j = n%8, word (n%32)//8, and each word's xs), BN % 32 == 0."""
    if LIFT_OUT:
        j = offs_n % 8
        lift = ((204 - 4 * tl.where(j < 6, j, j - 2)) << 23).to(tl.float32, bitcast=True)  # 2^(77-4j')
        tl.store(row_ptr + (offs_n // 32) * 36 + j * 4 + (offs_n % 32) // 8, v * lift, mask=n_ok)
        BN: tl.constexpr = v.shape[0]
        word = offs_n // 8
        xs = tl.sum(tl.reshape(v, (BN // 8, 8)), axis=1) * 2.0**-69  # [BN/8]; rows past N are 0
        word = tl.max(tl.reshape(word, (BN // 8, 8)), axis=1)
        w_ok = tl.max(tl.reshape(n_ok.to(tl.int32), (BN // 8, 8)), axis=1) > 0
        tl.store(row_ptr + (word // 4) * 36 + 32 + word % 4, xs, mask=w_ok)
    else:
        tl.store(row_ptr + offs_n, v.to(row_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _row_value(
    acc, acc_up, row, offs_n, n_ok, out_ptr, stride_om, add_ptr, GATE_UP: tl.constexpr, ADD: tl.constexpr
):
    """A finished row: silu(gate)·up (GATE_UP), else the sum itself; ADD: the sum rounded to out's
    dtype plus add's row, as torch's `out + add` of the two (the store rounds once more)."""
    if GATE_UP:
        return _silu(acc) * acc_up
    elif ADD:
        more = tl.load(add_ptr + row.to(tl.int64) * stride_om + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        return acc.to(out_ptr.dtype.element_ty).to(tl.float32) + more
    else:
        return acc


@triton.jit
def moe_gemv_finish(acc, acc_up, pair, is_local, offs_n, n_ok, N, out_ptr, stride_om, ws_ptr, cnt_ptr, topk_w_ptr,
                 add_ptr, topk_ids_ptr, num_experts,
                 GATE_UP: tl.constexpr, LIFT_OUT: tl.constexpr, TOP_K: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    """GEMV programs' end (grid (P, N tiles, S splits of K)), from acc / acc_up [BN] fp32, this program's sums.

    GATE_UP: act row `pair` = silu(gate)·up of the whole K; down: out row `pair // TOP_K` = the sum
    over the token's local slots (`topk_ids` [P] in [0, E)) of routing weight · acc. Several programs
    make one row (K splits; for down also the local slots): each parks its partial in the fp32
    workspace (`[P, S, 2N]`, gate | up; `[P, S, N]`) and the last to arrive (an atomic counter per
    output tile that resets itself) adds them in (slot, split) order: deterministic, and no torch op
    after the kernel. A pair of another rank (`is_local` false) takes no part: its act row is never
    written (down skips it) and its down programs park nothing and count nothing, so a rank none of
    whose pairs is local pays no workspace traffic or atomics (expert parallel: most ranks at M = 1);
    a token with no local slot gets its row from its first slot's first split, zeros (+ add).
    ADD (down): the row plus add's [M, N] row (out's strides; the MoE's shared experts), added after the
    sum is rounded to out's dtype: the bytes of torch's `routed + shared`, one launch fewer.
    """
    num_splits = tl.num_programs(2)
    if GATE_UP:
        if is_local:
            row_ptr = out_ptr + pair.to(tl.int64) * stride_om
            if num_splits == 1:
                _store_row(_silu(acc) * acc_up, row_ptr, offs_n, n_ok, LIFT_OUT)
            else:
                # pair-major: a row's partials adjoin
                part = ws_ptr + offs_n + (pair * num_splits + tl.program_id(2)) * 2 * N
                tl.store(part, acc, mask=n_ok)
                tl.store(part + N, acc_up, mask=n_ok)
                tl.debug_barrier()
                tile = pair * tl.num_programs(1) + tl.program_id(1)
                if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == num_splits - 1:
                    first = ws_ptr + offs_n + pair * num_splits * 2 * N
                    acc = tl.zeros_like(acc)
                    acc_up = tl.zeros_like(acc)
                    for q in range(num_splits):  # fixed order whichever program came last
                        acc += tl.load(first + q * 2 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
                        acc_up += tl.load(first + q * 2 * N + N, mask=n_ok, other=0.0, cache_modifier=".cg")
                    _store_row(_silu(acc) * acc_up, row_ptr, offs_n, n_ok, LIFT_OUT)
                    tl.atomic_xchg(cnt_ptr + tile, 0)
    else:
        row = pair // TOP_K
        row_ptr = out_ptr + row.to(tl.int64) * stride_om
        slot_is_local = ()  # the token's slots on this rank (the ids are the router's, in L2)
        num_local = 0
        for s in tl.static_range(TOP_K):
            e = tl.load(topk_ids_ptr + row * TOP_K + s)
            slot_is_local = slot_is_local + ((e >= 0) & (e < num_experts),)
            num_local += slot_is_local[s].to(tl.int32)
        arrivals = num_local * num_splits
        if is_local:
            acc = acc * tl.load(topk_w_ptr + pair).to(tl.float32)
            if arrivals == 1:
                v = _row_value(acc, acc_up, row, offs_n, n_ok, out_ptr, stride_om, add_ptr, False, ADD)
                _store_row(v, row_ptr, offs_n, n_ok, LIFT_OUT)
            else:
                part = ws_ptr + offs_n + (pair * num_splits + tl.program_id(2)) * N  # pair-major
                tl.store(part, acc, mask=n_ok)
                tl.debug_barrier()
                tile = row * tl.num_programs(1) + tl.program_id(1)
                if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == arrivals - 1:
                    first = ws_ptr + offs_n + row * TOP_K * num_splits * N
                    acc = tl.zeros_like(acc)
                    for s in tl.static_range(TOP_K):  # fixed order whichever program came last
                        if slot_is_local[s]:
                            slot = first + s * num_splits * N
                            for q in range(num_splits):
                                acc += tl.load(slot + q * N, mask=n_ok, other=0.0, cache_modifier=".cg")
                    v = _row_value(acc, acc_up, row, offs_n, n_ok, out_ptr, stride_om, add_ptr, False, ADD)
                    _store_row(v, row_ptr, offs_n, n_ok, LIFT_OUT)
                    tl.atomic_xchg(cnt_ptr + tile, 0)
        elif (num_local == 0) & (pair % TOP_K == 0) & (tl.program_id(2) == 0):  # nothing routed here
            zero = tl.zeros_like(acc)
            v = _row_value(zero, acc_up, row, offs_n, n_ok, out_ptr, stride_om, add_ptr, False, ADD)
            _store_row(v, row_ptr, offs_n, n_ok, LIFT_OUT)


# prefill query tiles (MLA, GQA, the DSA indexer)


@dataclass(frozen=True, slots=True)
class QueryTiles:
    """The prefill grid: program tile i covers queries `tile_q0[i] ..+ block_q` of sequence
    `tile_seq[i]` (>= B: an idle tile). Built on the device, so no host sync (see `mla_prefill`)."""

    query_start: torch.Tensor  # [B+1] int32
    tile_seq: torch.Tensor  # [NT] int32
    tile_q0: torch.Tensor  # [NT] int32
    block_q: int


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The grid's tile count, known on the host: an upper bound (each sequence's last tile may be
    partial), idle tiles past the real ones."""
    return num_tokens if block_q == 1 else min(num_tokens, triton.cdiv(num_tokens, block_q) + num_seqs)


@triton.jit
def _query_tiles_kernel(
    query_start_ptr,  # [B+1] int32
    tile_seq_ptr,  # [NT] int32 out
    tile_q0_ptr,  # [NT] int32 out
    num_seqs,
    num_tiles,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: sequence by sequence, its tiles in order (tile j of sequence b starts at query
    q_beg + j·BLOCK_Q), then the idle tiles (sequence B, first query 0). Each address written once."""
    start = 0
    for b in range(num_seqs):
        q_beg = tl.load(query_start_ptr + b)
        n = (tl.load(query_start_ptr + b + 1) - q_beg + BLOCK_Q - 1) // BLOCK_Q
        for j0 in range(0, n, BLOCK_T):
            j = j0 + tl.arange(0, BLOCK_T)
            keep = (j < n) & (start + j < num_tiles)
            tl.store(tile_seq_ptr + start + j, tl.full([BLOCK_T], 0, tl.int32) + b, mask=keep)
            tl.store(tile_q0_ptr + start + j, q_beg + j * BLOCK_Q, mask=keep)
        start += n
    for t0 in range(start, num_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        keep = t < num_tiles
        tl.store(tile_seq_ptr + t, tl.full([BLOCK_T], 0, tl.int32) + num_seqs, mask=keep)
        # as the torch builder: a query per tile keeps tile t at query t (the DSA indexer maps score
        # rows to queries by it), wider tiles' idle first query is 0 (never read)
        tl.store(tile_q0_ptr + t, t if BLOCK_Q == 1 else tl.zeros([BLOCK_T], tl.int32), mask=keep)


# the most sequences `query_tiles` builds in one launch: its program walks them one after another
# (about a µs each on an H100), where the torch builder's launches (3 at block_q = 1, 19 above) run
# in parallel over them; a verify or prefill of a few sequences (a nano model's c = 1 step: 19 of its
# ~280 launches) is where the launches cost most
ONE_LAUNCH_MAX_SEQS = 8


def query_tiles_triton(query_start: torch.Tensor, num_tokens: int, block_q: int) -> QueryTiles:
    """`query_tiles` in one launch (the torch path is 3 launches at block_q = 1, 19 above): the same
    tiles; an idle tile's first query is its index at block_q = 1, else 0 (no kernel reads it)."""
    qs32 = query_start.to(torch.int32).contiguous()
    B = qs32.shape[0] - 1
    NT = num_query_tiles(num_tokens, B, block_q)
    tile_seq = torch.empty(NT, dtype=torch.int32, device=qs32.device)
    tile_q0 = torch.empty(NT, dtype=torch.int32, device=qs32.device)
    if NT:
        _query_tiles_kernel[(1,)](qs32, tile_seq, tile_q0, B, NT, BLOCK_Q=block_q, BLOCK_T=256)
    return QueryTiles(qs32, tile_seq, tile_q0, block_q)


def query_tiles(query_start: torch.Tensor, num_tokens: int, block_q: int) -> QueryTiles:
    """Tiles of `block_q` consecutive queries of one sequence, on query_start's device (one
    launch on CUDA for up to `ONE_LAUNCH_MAX_SEQS` sequences: `query_tiles_triton`)."""
    if query_start.is_cuda and query_start.shape[0] - 1 <= ONE_LAUNCH_MAX_SEQS:
        return query_tiles_triton(query_start, num_tokens, block_q)
    if block_q == 1:  # a tile per query (decode): tile t is query t, of the sequence whose range holds it
        qs32 = query_start.to(torch.int32)
        t32 = torch.arange(num_tokens, dtype=torch.int32, device=qs32.device)  # [NT = T]
        seq32 = torch.searchsorted(qs32[1:].contiguous(), t32, right=True, out_int32=True)
        return QueryTiles(qs32.contiguous(), seq32, t32, 1)
    qs = query_start.long()
    B = qs.shape[0] - 1
    num_tiles = (qs[1:] - qs[:-1] + block_q - 1) // block_q  # [B]
    ends = num_tiles.cumsum(0)  # [B]
    t = torch.arange(num_query_tiles(num_tokens, B, block_q), device=qs.device)  # [NT]
    seq = torch.searchsorted(ends, t, right=True)  # [NT] in [0, B]; B = idle
    own = seq.clamp(max=B - 1)
    q0 = qs[own] + (t - ends[own] + num_tiles[own]) * block_q
    return QueryTiles(
        query_start.to(torch.int32).contiguous(), seq.to(torch.int32), q0.to(torch.int32), block_q
    )


def memo_query_tiles(
    memo: dict[Any, Any] | None, query_start: torch.Tensor, num_tokens: int, block_q: int
) -> QueryTiles:
    """`query_tiles`, made once per step where the caller gives the step's memo
    (`PagedBatch.memo`): every layer of a forward, and a speculative step's depth 0 over the same
    rows, reads the same tiles (19 launches each time at block_q > 1: 76 of a 3-draft greedy step's
    366 on the H100, 2026-12-07)."""
    if memo is None:
        return query_tiles(query_start, num_tokens, block_q)
    key = ("query tiles", num_tokens, block_q)
    if key not in memo:
        memo[key] = query_tiles(query_start, num_tokens, block_q)
    tiles: QueryTiles = memo[key]
    return tiles


@triton.jit
def query_tile(
    tile_seq_ptr,  # [NT] int32 sequence of each tile, >= B = idle
    tile_q0_ptr,  # [NT] int32 first query row of each tile
    query_start_ptr,  # [B+1] int32
    seq_lens_ptr,  # [B] int32
    tile,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Prefill tile `tile` of a `QueryTiles` grid: (sequence b, tile_ok, first query row q0, its
    query count, the sequence's length L, the position of query q0, whether the tile holds the
    sequence's last query). An idle tile (the grid is an upper bound) gets b = 0 and no query."""
    b = tl.load(tile_seq_ptr + tile)
    tile_ok = b < num_seqs
    b = tl.where(tile_ok, b, 0)
    q_beg = tl.load(query_start_ptr + b)
    q_end = tl.load(query_start_ptr + b + 1)
    q0 = tl.where(tile_ok, tl.load(tile_q0_ptr + tile), q_beg)
    num_q = tl.where(tile_ok, tl.minimum(q_end - q0, BLOCK_Q), 0)
    L = tl.load(seq_lens_ptr + b)
    first_pos = L - (q_end - q_beg) + (q0 - q_beg)
    is_last = tile_ok & (q0 + num_q == q_end)
    return b, tile_ok, q0, num_q, L, first_pos, is_last
