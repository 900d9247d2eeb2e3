"""MLA over an FP8 latent cache by e4m3 dots (`MlaTiles.fp8_dot`, issue 24): q rounded to e4m3 per
(token, head) row, the softmax weights as e4m3 codes of p * 448, both dots on FP8 tensor cores.

Two references. `fp8_dot_emulation` is the same numerics in torch (q's codes by
`quantize_fp8_rows_ref`, the scores in fp32 from the codes, each slice's weights rounded step by step
against the running max, the sum of the rounded weights, the slices merged by log-sum-exp): the kernel
must match it to fp32 rounding (on the GPU, plus fp8 wgmma's short accumulation of the scores). The
exact op (`mla_decode_ref`) differs by what e4m3 costs, derived: q's rounding is x(1 + δ) with
|δ| ≤ u = 2^-4 (3 mantissa bits), so a score s = Σ q_k c_k moves by Σ q_k δ_k c_k, about u_rms·|s|
with u_rms ≈ 0.03 over a binade (random signs); a weight's own rounding is another factor (1 + δ).
The output is the weights' average of the lines, so its relative error is about the weights' relative
error: on the CPU shapes (scores of ~1 nat spread: randn data, softmax scale (R + Dr)^-0.5) the two
give ~2-3%, bound used u = 6.25%. On Kimi's shapes (`gpu_batch`: q x 2, scale 0.1447: ~7 nats of
spread) q's rounding moves scores by ~0.2 nats, so there the bound is the emulation's own error (what
the numerics cost) plus the kernel's rounding noise, and the `kumo eval` gate decides the rest.

The interpreter runs e4m3 dots exactly (codes widened to fp16) but rounds fp32 -> e4m3 its own way
(`kernels.mla_decode.to_e4m3`), so the kernel rounds in fp32 first there; `test_to_e4m3_*` checks
that against torch's cast on every code, midpoint and random values, and on the GPU the hardware cast.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import triton
import triton.language as tl

from kernels.mla_attention import mla_attention_ref, mla_decode_ref
from kernels.mla_decode import mla_decode, to_e4m3
from kernels.mla_prefill import mla_prefill
from kernels.mla_tiles import FP8_DOT_TILES, MlaTiles
from kernels.w4a8_gemm import quantize_fp8_rows_ref
from tests.kernels.paged_layout import poison_allocator, query_starts
from tests.kernels.sm90_compile import compiled_lines
from tests.kernels.test_mla_decode import (
    DEV,
    FP8,
    gpu_batch,
    make_batch,
    rel_err,
    run_both,
    sparse_topk,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
P_SCALE = 448.0  # the weights' codes are of p * 448 (e4m3's largest finite value)
E4M3_U = 2.0**-4  # e4m3's unit roundoff: 3 mantissa bits, round to nearest


def fp8_dot_emulation(batch: dict, block_n: int, splits: int) -> torch.Tensor:
    """The FP8-dot kernel's numerics in torch for dense decode on `batch` (`make_batch`/`gpu_batch`'s
    dict, every tag matching): [B, H, R] float32."""
    q, cache = batch["q"], batch["latent_cache"]
    B, H, C = q.shape
    S, R = cache.shape[1], batch["kv_lora_rank"]
    codes, q_scale = quantize_fp8_rows_ref(q.reshape(B * H, C))
    codes, q_scale = codes.float().view(B, H, C), q_scale.view(B, H)
    qk = torch.tensor(batch["softmax_scale"] * batch["latent_scale"] * math.log2(math.e), device=q.device)
    out = torch.zeros(B, H, R, device=q.device)
    for b in range(B):
        L = int(batch["seq_lens"][b])
        pages = batch["page_table"][b, : triton.cdiv(L, S)].long()
        lines = cache[pages].reshape(-1, C)[:L].float()  # [L, C] codes
        s = (codes[b] @ lines.T) * (q_scale[b] * qk.float())[:, None]  # [H, L], log2 domain
        per = triton.cdiv(triton.cdiv(L, splits), block_n) * block_n  # the launcher's slice
        outs, lses = [], []
        for start in range(0, L, per):
            seg, v = s[:, start : start + per], lines[start : start + per, :R]
            n, steps = seg.shape[1], triton.cdiv(seg.shape[1], block_n)
            seg = torch.nn.functional.pad(seg, (0, steps * block_n - n), value=float("-inf"))
            seg = seg.view(H, steps, block_n)
            m_run = seg.amax(-1).cummax(-1).values  # [H, steps]: the running max after each step
            p = (torch.exp2(seg - m_run[..., None]) * P_SCALE).to(FP8).float()
            w = (p * torch.exp2(m_run - m_run[:, -1:])[..., None]).view(H, -1)[:, :n]  # rescaled
            l = w.sum(-1)
            outs.append(w @ v / l[:, None])
            lses.append(m_run[:, -1] + torch.log2(l / P_SCALE))
        lse = torch.stack(lses)  # [slices, H]
        weight = torch.exp2(lse - lse.amax(0))
        out[b] = (weight[..., None] * torch.stack(outs)).sum(0) / weight.sum(0)[:, None]
    return out * batch["latent_scale"]


def differences(out: torch.Tensor, ref: torch.Tensor, seq_of_row: list[int]) -> str:
    """Where `out` [T, H, R] leaves `ref`, per sequence (row t of T belongs to `seq_of_row[t]`): the
    relative error, the largest |out| and |ref| (a convex mix of lines cannot pass the lines' own bound:
    more is a weights / sum mismatch), the (row, head) outputs that are all zero where ref's are not (a
    tile or slice never written, or all its tokens masked) and the three worst heads (a row mix-up)."""
    out, ref = out.float(), ref.float()
    seq = torch.tensor(seq_of_row, device=out.device)
    lines = []
    for b in seq.unique().tolist():
        o, r = out[seq == b], ref[seq == b]  # [t, H, R]
        zero = ((o.abs().amax(-1) == 0) & (r.abs().amax(-1) > 0)).nonzero().tolist()
        per_head = (o - r).norm(dim=(0, 2)) / r.norm(dim=(0, 2)).clamp(min=1e-30)
        worst = per_head.topk(min(3, per_head.numel()))
        lines.append(
            f"seq {b}: err {rel_err(o, r):.3g}, max|out| {float(o.abs().max()):.3g} max|ref| "
            f"{float(r.abs().max()):.3g}, {len(zero)} zero (row, head) {zero[:8]}, worst heads "
            f"{worst.indices.tolist()} at {[round(v, 3) for v in worst.values.tolist()]}"
        )
    return "\n".join(lines)


# --- CPU (interpreter) ------------------------------------------------------------------------------


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr, HW: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs), HW))


def test_to_e4m3_rounds_as_torch() -> None:
    """Every e4m3 value, every midpoint between neighbours (ties to even) and just off it, and random
    fp32 values over 2^-13 .. 448 of either sign: the same value as torch's cast (round to nearest even,
    subnormals included); the interpreter's own cast gets thousands of them wrong."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 14
    x = (torch.rand(n, generator=g) * 2 - 1) * torch.exp2(torch.rand(n, generator=g) * 21.8 - 13)
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mids = (values[:-1] + values[1:]) / 2
    special = torch.cat([values, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    x[: 2 * special.numel()] = torch.cat([special, -special])
    y = torch.empty(n, dtype=FP8, device=DEV)
    _round_kernel[(1,)](x.to(DEV), y, N=n, HW=DEV == "cuda")
    assert torch.equal(y.cpu().float(), x.to(FP8).float())


SMALL = MlaTiles(16, 32, 32, 4, 2, 1, fp8_dot=True)
SMALL_SWAP = MlaTiles(16, 32, 32, 4, 2, 1, swap=True, fp8_dot=True)


@pytest.mark.parametrize(("R", "Dr"), [(64, 16), (32, 16)])  # the nano models' 64 + 16; a rope < one K
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tiles", [SMALL, SMALL_SWAP], ids=["rows", "swap"])
def test_matches_emulation_and_reference(tiles: MlaTiles, splits: int, R: int, Dr: int) -> None:
    """20 heads (a full and a partial head block), lengths around pages and steps, one or three
    slices: the emulation to fp32 rounding, the exact op within e4m3's u."""
    batch, _ = make_batch(
        [45, 3, 70], H=20, R=R, Dr=Dr, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=11
    )
    out, ref, flags, _ = run_both(batch, num_splits=splits, tiles=tiles)
    emulated = fp8_dot_emulation(batch, tiles.block_n, splits)
    assert out.shape == (3, 20, R) and not flags.any()
    assert rel_err(out, emulated.to(out.dtype)) < 2e-5  # the same codes, weights and sums; fp16 out
    assert 5e-3 < rel_err(out, ref) < E4M3_U  # different numerics from the exact op, within u


def test_dot_tiles_differ_from_the_exact_kernel() -> None:
    """The same batch through the exact FP8 kernel and the FP8-dot one: different results (the switch
    is live), both near the reference."""
    batch, _ = make_batch([70, 33], H=16, R=64, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=4)
    exact, ref, _, _ = run_both(batch, num_splits=2)
    dot, _, _, _ = run_both(batch, num_splits=2, fp8_dot=True)
    assert rel_err(exact, ref) < 2e-3 and rel_err(dot, ref) < E4M3_U and rel_err(dot, exact) > 5e-3


def test_sparse_mode_within_u_of_reference() -> None:
    seq_lens = [100, 9, 57]
    batch, _ = make_batch(seq_lens, H=20, R=32, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=8)
    topk = sparse_topk(seq_lens, K=40, seed=1)
    out, ref, flags, _ = run_both(batch, topk, num_splits=2, tiles=SMALL_SWAP)
    assert rel_err(out, ref) < E4M3_U and not flags.any()


def test_prefill_through_dot_tiles() -> None:
    """A prefill chunk (causal, 4 heads: 16 queries x 4 heads a 64-row tile, as the nano models run)
    through `mla_prefill(fp8_dot=True)`: within u of the exact op."""
    q_lens, ctx = [5, 20], [37, 20]
    batch, _ = make_batch(ctx, H=4, R=64, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), 4, 80, generator=g).half()
    args = dict(batch, q=q, query_start=query_starts(q_lens))
    ref = mla_attention_ref(**{**args, "tag_mismatch": args["tag_mismatch"].clone()})
    out = mla_prefill(
        **{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in args.items()},
        block_n=32,
        fp8_dot=True,
    ).cpu()
    assert out.shape == ref.shape and 5e-3 < rel_err(out, ref) < E4M3_U


def test_dot_tiles_need_32_token_steps() -> None:
    batch, _ = make_batch([20], H=16, R=32, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=1)
    with pytest.raises(ValueError, match="block_n"):
        mla_decode(**batch, tiles=MlaTiles(16, 16, 32, 4, 2, 1, fp8_dot=True))


def test_dot_tiles_compile_for_sm90_to_fp8_wgmma() -> None:
    """`FP8_DOT_TILES` compiled for the H200 (no GPU): every tile's token loop runs fp8 wgmma (QGMMA) and
    no mma.sync, and converts no line (F2FP.F16.E4M3 under the 9 a token a 576-byte line would take:
    what is left widens the rounded weights for their sum); the 16-row tiles (8 and 16 heads) spill
    nothing and hold the CTAs an SM the table says."""
    lines = compiled_lines("tests.kernels.sm90_compile", "--fp8-dot")
    assert len(lines) == len(FP8_DOT_TILES), lines
    for line in lines:
        per_token = {k: float(v) for k, v in re.findall(r"([A-Z0-9.]+) (\d+\.\d+)", line.split("|")[1])}
        assert per_token["QGMMA"] > 0 and per_token["HMMA"] == 0 and per_token["HGMMA"] == 0, line
        assert per_token.get("F2FP.F16.E4M3", 0.0) < 9, line
        if " 16 rows " in line:
            assert " 0 bytes spill stores" in line, line


# --- GPU: Kimi K2's line (512 + 64), bf16 queries, 32k tokens --------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 16, 64])
def test_gpu_kimi_shapes_32k(heads: int) -> None:
    """8, 16 and 64 heads (TP8, TP4, one rank) over up to 32k tokens on shuffled tagged pages (unused
    memory poisoned with NaN), the launcher's FP8-dot tiles and slices as given: within the emulation's
    own distance from the exact op plus 3% (fp8 wgmma keeps ~14 bits of the scores' sums, so some
    weights round to the neighbouring code: ~5% of them, each by <= u), and close to the emulation."""
    ctx = [32768, 17, 4099, 20000]
    batch = gpu_batch(len(ctx), ctx, FP8, H=heads)
    tiles = FP8_DOT_TILES[("decode", 64 if heads > 32 else 16)]
    poison_allocator()
    out = mla_decode(**batch, tiles=tiles, num_splits=4).float()
    ref = mla_decode_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()}).float()
    emulated = fp8_dot_emulation(batch, tiles.block_n, 4)
    assert not batch["tag_mismatch"].any() and out.isfinite().all()
    cost, err, drift = rel_err(emulated, ref), rel_err(out, ref), rel_err(out, emulated)
    if not (drift < 3e-2 and err < cost + 3e-2):  # what tells a slice, a step or a row apart
        one = mla_decode(**batch, tiles=tiles, num_splits=1).float()
        rows = list(range(len(ctx)))
        pytest.fail(
            f"{tiles.label()}, 4 slices: cost {cost:.3g} err {err:.3g} drift {drift:.3g}\n"
            f"vs the emulation:\n{differences(out, emulated, rows)}\n1 slice, vs its emulation:\n"
            f"{differences(one, fp8_dot_emulation(batch, tiles.block_n, 1), rows)}"
        )


@pytest.mark.gpu
def test_gpu_tampered_page_and_default_slices() -> None:
    """A reallocated page full of NaN through the FP8-dot tiles (16 heads, the launcher's own slice
    count): flagged for its sequence only, finite, within u of the exact op over the remaining pages
    (q scaled to ~1 nat of score spread, as the CPU tests: the bound derived there holds)."""
    ctx = [16384, 3000, 700, 9999]
    batch = gpu_batch(len(ctx), ctx, FP8, H=16)
    batch["q"] = batch["q"] / 8
    bad = batch["page_table"][1, 7]
    batch["page_tags"][bad] += 1
    batch["latent_cache"][bad] = torch.tensor(float("nan")).to(FP8)
    flags = torch.zeros(4, dtype=torch.bool, device="cuda")
    poison_allocator()
    out = mla_decode(**{**batch, "tag_mismatch": flags}, fp8_dot=True).float()
    ref_flags = torch.zeros_like(flags)
    ref = mla_decode_ref(**{**batch, "tag_mismatch": ref_flags}).float()
    assert flags.tolist() == [False, True, False, False] == ref_flags.tolist()
    assert out.isfinite().all() and rel_err(out, ref) < E4M3_U, rel_err(out, ref)


@pytest.mark.gpu
def test_gpu_prefill_chunk_through_dot_tiles() -> None:
    """Prefill chunks (the last 300 / 64 / 1 tokens of three sequences, causal) through
    `mla_prefill(fp8_dot=True)` at 8 heads (8 queries x 8 heads a 64-row tile): within u of the exact op
    (q scaled to ~1 nat of score spread, as the CPU tests)."""
    ctx, q_lens = [4099, 700, 33], [300, 64, 1]
    batch = gpu_batch(len(ctx), ctx, FP8, H=8)
    g = torch.Generator(device="cuda").manual_seed(4)
    q = (torch.randn(sum(q_lens), 8, 576, device="cuda", generator=g) / 4).to(torch.bfloat16)
    args = dict(batch, q=q, query_start=query_starts(q_lens).cuda())
    poison_allocator()
    out = mla_prefill(**args, fp8_dot=True).float()
    ref = mla_attention_ref(**{**args, "tag_mismatch": args["tag_mismatch"].clone()}).float()
    assert not args["tag_mismatch"].any() and out.isfinite().all()
    if rel_err(out, ref) >= E4M3_U:  # per sequence, and through one slice (no merge, no empty slice)
        rows = [b for b, n in enumerate(q_lens) for _ in range(n)]
        one = mla_prefill(**args, fp8_dot=True, num_splits=1).float()
        pytest.fail(
            f"err {rel_err(out, ref):.3g} (launcher's slices):\n{differences(out, ref, rows)}\n"
            f"1 slice: err {rel_err(one, ref):.3g}\n{differences(one, ref, rows)}"
        )
