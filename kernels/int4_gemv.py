"""INT4 decode dot products on the CUDA cores, shared by the W4A16 GEMV (`kernels/w4a16_gemm.py`) and
the fused MoE's sparse-decode GEMV (`kernels/fused_moe.py`): one activation row against a K tile of
packed checkpoint words, two instructions per weight.

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
- `_group_dots`: one word tile against several rows (the MoE's pairs of one expert): its LOP3s
  serve them all, one FFMA per row and nibble.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["LIFT_SCALE", "LIFTED_ROW", "lift_rows", "lifted_width"]

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
def _x_planes(x_row, r, r_ok, stride_xk, LIFTED: tl.constexpr, EVEN_K: tl.constexpr):
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
    """wp [BK8, BN] int32 words, (ys, xs) from `_x_planes` -> [C, BN] fp32: per chunk of 4 words and
    row, `sum (nibble - 8) · x` in units of 2^-72 (before the group scale)."""
    if LIFTED:
        return _word_dots(wp, ys, xs)
    else:
        return _chain_dots(wp, ys, xs)


@triton.jit
def _load_tile(w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
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
def _int4_tile_dot(w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg, ys, xs,
                   GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LIFTED: tl.constexpr, EVEN_K: tl.constexpr,
                   EVEN_N: tl.constexpr):  # fmt: skip
    """K tile t of weight rows `rows` [BN] against the activation planes: [C, BN] fp32, group scales
    applied (units of 2^-72)."""
    wp, sc = _load_tile(
        w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
        GROUP_SIZE, BLOCK_K, EVEN_K, EVEN_N,
    )  # fmt: skip
    return _chunk_dots(wp, ys, xs, LIFTED) * sc


@triton.jit
def _group_dots(wp, sc, x_rows, r, r_ok, EVEN_K: tl.constexpr):
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
    ys, xs = _x_planes(x_ptr + m * stride_xm, r, r < K // 8, stride_xk, False, False)
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
