"""Paged MLA decode (split-K, fused page-tag check, DSA sparse mode) against the MLA reference op.

CPU CI runs the Triton kernels under TRITON_INTERPRET=1 with float16/float32 queries (bf16 tl.dot is
broken in the interpreter) on small latent widths, plus one case at the real 512 + 64; `gpu` tests
run bf16 queries on Kimi K2's shapes (64 heads x 576, page 16, up to 32k tokens) with BF16 and FP8
caches. The reference is `kernels.mla_attention.mla_attention_ref` (checked against naive expanded
MLA in test_mla_attention_ref.py); the tampered-tag test also checks against a float64 softmax over
the pages that remain. Unused cache slots hold NaN (paged_layout), so reading one would show.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels.mla_decode  # noqa: E402
from kernels.mla_attention import mla_decode_ref  # noqa: E402
from kernels.mla_decode import e4m3_bits_to_f16_shifted, e4m3_to_f16_shifted, mla_decode  # noqa: E402
from kernels.mla_tiles import MAX_SPLITS, VARIANTS, MlaTiles, pick_mla_splits, slice_cost_items  # noqa: E402
from kernels.split_k_merge import pick_num_splits  # noqa: E402
from tests.kernels.paged_layout import lay_out, poison_allocator, tag_input_misfits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
FP8 = torch.float8_e4m3fn


def make_batch(
    seq_lens: list[int],
    H: int,
    R: int,
    Dr: int,
    S: int,
    cache_dtype: torch.dtype,
    q_dtype: torch.dtype,
    seed: int,
) -> dict:
    """Sequences' latent lines on shuffled pages (NaN in unused slots), random tags, all matching."""
    g = torch.Generator().manual_seed(seed)
    lines = [[torch.randn(n, R + Dr, generator=g)] for n in seq_lens]
    scale = 1.0
    if cache_dtype == FP8:
        scale = max(float(t[0].abs().max()) for t in lines) / 448
    paged = lay_out(lines, page_size=S, dtype=cache_dtype, scales=[scale], seed=seed)
    return dict(
        q=torch.randn(len(seq_lens), H, R + Dr, generator=g).to(q_dtype),
        latent_cache=paged.caches[0], latent_scale=scale, kv_lora_rank=R,
        seq_lens=paged.seq_lens, page_table=paged.page_table, expected_tags=paged.expected_tags,
        page_tags=paged.page_tags, tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool),
        softmax_scale=(R + Dr) ** -0.5,
    ), paged  # fmt: skip


def run_both(batch: dict, topk: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, ...]:
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = mla_decode_ref(**ref_in, topk_indices=topk)
    dev_in = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = mla_decode(**dev_in, topk_indices=None if topk is None else topk.to(DEV), **kw)
    return out.cpu(), ref, dev_in["tag_mismatch"].cpu(), ref_in["tag_mismatch"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: q and p rounded to fp16 for the dots


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("L", [1, 15, 16, 17, 33, 200])
def test_matches_reference(L: int, q_dtype: torch.dtype) -> None:
    """Several sequences of different lengths around page edges; 20 heads = one full and one partial
    head block; 200 tokens in 3 slices, the short ones in slices that are partly or wholly empty."""
    seq_lens = [L, max(1, L // 3), L + 5]
    batch, _ = make_batch(seq_lens, H=20, R=32, Dr=8, S=16, cache_dtype=q_dtype, q_dtype=q_dtype, seed=L)
    out, ref, flags, ref_flags = run_both(batch, num_splits=3 if L == 200 else None)
    assert out.dtype == q_dtype and out.shape == (3, 20, 32)
    assert rel_err(out, ref) < TOL[q_dtype]
    assert not flags.any() and not ref_flags.any()


@pytest.mark.parametrize("splits", [9, 20])
def test_many_slices_merge_in_chunks(splits: int) -> None:
    """More slices than the merge reads a step (8): slices of 16 tokens, most of the short sequences'
    slices empty (LSE -inf), merged chunk by chunk."""
    batch, _ = make_batch(
        [200, 40, 7], H=16, R=32, Dr=8, S=16, cache_dtype=torch.float32, q_dtype=torch.float32, seed=4
    )
    out, ref, _, _ = run_both(batch, num_splits=splits, block_n=16)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_real_latent_width(splits: int) -> None:
    """Kimi's 512 + 64 line, page size 16, one slice (direct output) and two (merge)."""
    batch, _ = make_batch(
        [40, 7], H=16, R=512, Dr=64, S=16, cache_dtype=torch.float16, q_dtype=torch.float16, seed=3
    )
    out, ref, _, _ = run_both(batch, num_splits=splits, block_n=16)
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize(("block_rc", "splits"), [(16, 1), (64, 2)])
def test_wide_head_tiles_and_latent_chunks(block_rc: int, splits: int) -> None:
    """70 heads: one 64-row tile (the wgmma orientation, scores as [heads, tokens]) and a partial one;
    a latent of 40 in chunks of 16 (the last one part-masked) or in one chunk of 64 (part-masked)."""
    batch, _ = make_batch(
        [50, 9], H=70, R=40, Dr=8, S=16, cache_dtype=torch.float16, q_dtype=torch.float16, seed=12
    )
    out, ref, _, _ = run_both(batch, num_splits=splits, block_rc=block_rc)
    assert out.shape == (2, 70, 40) and rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_cache_matches_reference(splits: int) -> None:
    batch, _ = make_batch(
        [45, 3, 70], H=8, R=32, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=11
    )
    assert batch["latent_scale"] != 1.0
    out, ref, _, _ = run_both(batch, num_splits=splits)
    assert rel_err(out, ref) < 2e-3  # the fp8 values are exact in fp16; q and p are rounded


SWAPPED = MlaTiles(16, 16, 16, 4, 2, 1, swap=True)
SHIFTED = MlaTiles(16, 16, 16, 4, 2, 1, fp8_shift=True)
BOTH = MlaTiles(16, 16, 16, 4, 2, 1, swap=True, fp8_shift=True)


@pytest.mark.parametrize(
    ("cache_dtype", "tiles", "splits"),
    [(torch.float32, SWAPPED, 1), (torch.float32, SWAPPED, 3), (FP8, SWAPPED, 2), (FP8, SHIFTED, 1),
     (FP8, SHIFTED, 3), (FP8, BOTH, 1), (FP8, BOTH, 2)],
)  # fmt: skip
def test_swapped_dots_and_shifted_fp8(cache_dtype: torch.dtype, tiles: MlaTiles, splits: int) -> None:
    """Tokens as the dots' rows (`swap`: transposed scores and accumulators, stored through transposed
    pointers) and FP8 lines converted by moving bits (`fp8_shift`: 2^-8 of their value, the launcher's
    scales times 2^8, in the direct store and the merge alike); 20 heads = a full and a partial head
    block, lengths around page edges."""
    q_dtype = torch.float32 if cache_dtype == torch.float32 else torch.float16
    batch, _ = make_batch(
        [45, 3, 70], H=20, R=32, Dr=16, S=16, cache_dtype=cache_dtype, q_dtype=q_dtype, seed=11
    )
    out, ref, flags, _ = run_both(batch, num_splits=splits, tiles=tiles)
    assert out.shape == (3, 20, 32) and not flags.any()
    assert rel_err(out, ref) < TOL[q_dtype]


@pytest.mark.parametrize("tiles", [SWAPPED, BOTH, MlaTiles(16, 32, 32, 4, 2, 1, swap=True, fp8_dot=True)])
def test_swapped_dots_drop_a_tampered_page(tiles: MlaTiles) -> None:
    """The sanitised page list and the flag, as `test_tampered_tag_flags_sequence_and_drops_page`,
    through the swapped dots (FP8: also the shifted conversion, or the e4m3 dots: within their u,
    `tests/kernels/test_mla_fp8_dot.py`)."""
    S = 8
    batch, paged = make_batch(
        [40, 40, 23], H=6, R=32, Dr=16, S=S, cache_dtype=FP8, q_dtype=torch.float16, seed=5
    )
    batch["page_tags"][paged.pages[1][2]] += 1
    out, ref, flags, ref_flags = run_both(batch, num_splits=2, tiles=tiles)
    assert flags.tolist() == [False, True, False] == ref_flags.tolist()
    keep = torch.ones(40, dtype=torch.bool)
    keep[2 * S : 3 * S] = False
    tol = 2.0**-4 if tiles.fp8_dot else 2e-3
    assert rel_err(out, ref) < tol and rel_err(out[1], softmax_over(batch, 1, keep)) < tol


def test_swapped_dots_in_sparse_mode() -> None:
    seq_lens = [100, 9, 57]
    batch, _ = make_batch(
        seq_lens, H=20, R=32, Dr=8, S=16, cache_dtype=torch.float32, q_dtype=torch.float32, seed=8
    )
    topk = sparse_topk(seq_lens, K=24, seed=1)
    out, ref, flags, _ = run_both(batch, topk, num_splits=2, tiles=SWAPPED)
    assert rel_err(out, ref) < 1e-5 and not flags.any()


@triton.jit
def _convert_kernel(x_ptr, y_ptr, N: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = e4m3_to_f16_shifted(x) if ASM else e4m3_bits_to_f16_shifted(x)
    tl.store(y_ptr + offs, y)


def test_shifted_conversion_is_exact_on_every_byte() -> None:
    """Every e4m3 byte but the two NaNs: fp16 bits = its value x 2^-8, exactly (subnormals included);
    on the GPU the inline-asm form, in the interpreter the plain-op one."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    x = codes.view(FP8)
    y = torch.empty(256, dtype=torch.float16, device=DEV)
    xs = torch.zeros(256, dtype=torch.uint8)
    xs[: codes.numel()] = codes
    # one warp: 8 bytes a thread, whole 4-byte groups for the asm's pack=4
    _convert_kernel[(1,)](xs.view(FP8).to(DEV), y, N=256, ASM=DEV == "cuda", num_warps=1)
    expected = x.to(torch.float32) * 2.0**-8
    assert torch.equal(y[: codes.numel()].cpu().float(), expected)


def softmax_over(batch: dict, b: int, keep: torch.Tensor) -> torch.Tensor:
    """float64 attention of sequence b's query over its tokens where `keep [L]` is True: [H, R]."""
    S, R, L = batch["latent_cache"].shape[1], batch["kv_lora_rank"], int(batch["seq_lens"][b])
    pages = batch["page_table"][b, : -(-L // S)].long()
    kv = batch["latent_cache"][pages].double().reshape(-1, batch["latent_cache"].shape[2])[:L]
    kv = kv * batch["latent_scale"]
    s = batch["q"][b].double() @ kv[keep].T * batch["softmax_scale"]  # [H, kept]
    return torch.softmax(s, dim=-1) @ kv[keep, :R]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("cache_dtype", [FP8, torch.float32])
def test_tampered_tag_flags_sequence_and_drops_page(cache_dtype: torch.dtype, splits: int) -> None:
    """A reallocated page (tag bumped, bytes NaN: another tenant's data) is flagged for its sequence
    only, contributes nothing, and the result is attention over the remaining pages: the slice that
    holds it walks a sanitised page list, the others the page table. (The interpreter's e4m3
    emulation turns the NaN byte into a finite number; float32 keeps the NaN.)"""
    S = 8
    batch, paged = make_batch(
        [40, 40, 23], H=6, R=32, Dr=16, S=S, cache_dtype=cache_dtype, q_dtype=torch.float32, seed=5
    )
    bad_page = paged.pages[1][2]
    batch["page_tags"][bad_page] += 1
    batch["latent_cache"][bad_page] = torch.tensor(float("nan")).to(cache_dtype)
    out, ref, flags, ref_flags = run_both(batch, num_splits=splits)
    assert flags.tolist() == [False, True, False] == ref_flags.tolist()
    assert not out.isnan().any()
    tol = 2e-3 if cache_dtype == FP8 else 1e-5  # an FP8 cache computes its dots in fp16
    assert rel_err(out, ref) < tol
    keep = torch.ones(40, dtype=torch.bool)
    keep[2 * S : 3 * S] = False
    assert rel_err(out[1], softmax_over(batch, 1, keep)) < tol


def test_all_pages_mismatched_gives_zeros_and_flag() -> None:
    batch, _ = make_batch(
        [12, 30], H=4, R=16, Dr=16, S=4, cache_dtype=torch.float32, q_dtype=torch.float32, seed=6
    )
    batch["page_tags"] += 7  # every page reallocated
    for splits in (1, 3):
        out, ref, flags, _ = run_both(
            {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}, num_splits=splits
        )
        assert flags.all()
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, torch.zeros_like(ref))


@pytest.mark.parametrize("sparse", [False, True])
def test_a_sequence_longer_than_its_table_row_stays_in_its_row(sparse: bool) -> None:
    """A length past the page table's width (a wrong reservation, which no planner makes): the sequence
    attends over its own row's pages only, never the next row's (sequence 0 past its row would read
    sequence 1's first page, under a tag that matches: unflagged), and the others are untouched. The
    CPU reference raises on such a length."""
    S = 8
    batch, _ = make_batch(
        [40, 40, 23], H=6, R=32, Dr=16, S=S, cache_dtype=torch.float32, q_dtype=torch.float32, seed=9
    )
    topk = sparse_topk([40, 40, 23], 16, seed=9) if sparse else None
    if topk is not None:
        topk[0, :3] = torch.tensor([41, 44, 46])  # chosen positions past the row: dropped
    _, ref, _, _ = run_both(batch, topk, num_splits=2)  # the lengths as laid out: the answer
    long = {**batch, "seq_lens": torch.tensor([47, 40, 23], dtype=torch.int32)}
    for splits in (1, 2):
        dev_in = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in long.items()}
        dev_in["tag_mismatch"] = torch.zeros(3, dtype=torch.bool, device=DEV)
        out = mla_decode(**dev_in, topk_indices=None if topk is None else topk.to(DEV), num_splits=splits)
        assert dev_in["tag_mismatch"].tolist()[1:] == [False, False]
        out = out.cpu()
        assert not out.isnan().any()
        assert rel_err(out, ref) < 1e-5  # sequence 0 over its row's 40 tokens, as if its length were right


def sparse_topk(seq_lens: list[int], K: int, seed: int) -> torch.Tensor:
    """Distinct positions per sequence, fewer than K where the sequence is short (-1 padded), plus
    one out-of-range position in the first row (ignored, as the reference ignores it)."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.full((len(seq_lens), K), -1, dtype=torch.int64)
    for b, L in enumerate(seq_lens):
        n = min(K - 1, L)
        topk[b, :n] = torch.randperm(L, generator=g)[:n]
    topk[0, -1] = seq_lens[0] + 3
    return topk


@pytest.mark.parametrize("splits", [1, 2])
def test_sparse_mode_matches_reference(splits: int) -> None:
    seq_lens = [100, 9, 57]
    batch, _ = make_batch(
        seq_lens, H=20, R=32, Dr=8, S=16, cache_dtype=torch.float32, q_dtype=torch.float32, seed=8
    )
    topk = sparse_topk(seq_lens, K=24, seed=1)
    out, ref, flags, _ = run_both(batch, topk, num_splits=splits)
    assert rel_err(out, ref) < 1e-5 and not flags.any()
    keep = torch.zeros(100, dtype=torch.bool)
    keep[topk[0][(topk[0] >= 0) & (topk[0] < 100)]] = True
    assert rel_err(out[0], softmax_over(batch, 0, keep)) < 1e-5
    dense, _, _, _ = run_both(batch, num_splits=splits)
    assert rel_err(out[0], dense[0]) > 1e-2  # the sparse result really is a different attention


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_selecting_every_key_is_dense_attention_to_rounding(q_dtype: torch.dtype) -> None:
    """What the DSA indexer hands sparse MLA at a context within index_topk: every position, in the
    GPU top-k's arbitrary order, then -1s (GLM-5 now runs dense mode there instead). The reference
    gives the two bit for bit; the kernel sums the same keys in another order (shuffled, and slices
    of the K list rather than of the tokens), so both agree with it to rounding only."""
    seq_lens, K = [40, 9, 33], 48
    batch, _ = make_batch(seq_lens, H=20, R=32, Dr=8, S=16, cache_dtype=q_dtype, q_dtype=q_dtype, seed=21)
    g = torch.Generator().manual_seed(5)
    topk = torch.full((len(seq_lens), K), -1, dtype=torch.int64)
    for b, L in enumerate(seq_lens):
        topk[b, torch.randperm(K, generator=g)[:L]] = torch.randperm(L, generator=g)
    sparse, sparse_ref, _, _ = run_both(batch, topk, num_splits=2)
    dense, dense_ref, _, _ = run_both(batch, num_splits=3)
    assert torch.equal(sparse_ref, dense_ref)
    assert rel_err(sparse, dense_ref) < TOL[q_dtype] and rel_err(dense, dense_ref) < TOL[q_dtype]


def test_sparse_mode_flags_pages_it_did_not_choose() -> None:
    """int32 indices, fp16; sequence 0's tampered page holds a chosen token (dropped, flagged);
    sequence 1's tampered page holds none of its chosen tokens (flagged all the same, as the
    reference flags every page in use)."""
    S, seq_lens = 8, [64, 64, 30]
    batch, paged = make_batch(
        seq_lens, H=16, R=32, Dr=16, S=S, cache_dtype=torch.float16, q_dtype=torch.float16, seed=9
    )
    topk = sparse_topk(seq_lens, K=16, seed=2)
    topk[0, 0] = 3 * S + 1  # sequence 0 chooses a token of its page 3
    topk[1] = torch.where((topk[1] // S) == 5, -1, topk[1])  # sequence 1 never chooses its page 5
    batch["page_tags"][paged.pages[0][3]] -= 1
    batch["page_tags"][paged.pages[1][5]] += 2
    batch["latent_cache"][paged.pages[0][3]] = float("nan")
    out, ref, flags, ref_flags = run_both(batch, topk.to(torch.int32), num_splits=3)
    assert flags.tolist() == [True, True, False] == ref_flags.tolist()
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_slices_the_h200_chooser_gives_a_few_sequences(
    cache_dtype: torch.dtype, sparse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's own slice count as on the H200's 132 SMs, GLM-5's 64 heads (one 64-row tile, 32-
    token steps) and two sequences, the page table 64 pages wide as a decode graph's (1,024 items; sparse:
    1,024 top-k slots): 32 slices of one step, so the 600-token sequence leaves 13 slices without a
    token (sparse: with only -1s, or the out-of-range position) and the 40-token one 30. The float16
    cache stands in for BF16 (the interpreter's bf16 dots are broken)."""
    seq_lens, width = [600, 40], 64
    batch, _ = make_batch(
        seq_lens, H=64, R=32, Dr=8, S=16, cache_dtype=cache_dtype, q_dtype=torch.float16, seed=31
    )
    pad = width - batch["page_table"].shape[1]
    batch["page_table"] = torch.nn.functional.pad(batch["page_table"], (0, pad))  # page 0, never read
    batch["expected_tags"] = torch.nn.functional.pad(batch["expected_tags"], (0, pad), value=-1)
    topk = sparse_topk(seq_lens, K=1024, seed=3) if sparse else None
    slices: list[int] = []
    real_merge = kernels.mla_decode.merge_splits

    def merge(part_o: torch.Tensor, *args: object) -> None:
        slices.append(part_o.shape[2])
        real_merge(part_o, *args)

    monkeypatch.setattr(kernels.mla_decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(kernels.mla_decode, "merge_splits", merge)
    out, ref, flags, _ = run_both(batch, topk)
    assert slices == [32]
    assert out.shape == (2, 64, 32) and not flags.any()
    assert rel_err(out, ref) < 2e-3  # FP8 lines are exact in fp16; q and p are rounded


def test_launcher_rejects_bad_inputs() -> None:
    batch, _ = make_batch(
        [5], H=4, R=16, Dr=16, S=4, cache_dtype=torch.float32, q_dtype=torch.float32, seed=1
    )
    with pytest.raises(TypeError):
        mla_decode(**{**batch, "q": batch["q"].half()})  # cache fp32, q fp16
    with pytest.raises(ValueError):
        mla_decode(**{**batch, "kv_lora_rank": 40})
    with pytest.raises(ValueError):
        mla_decode(**{**batch, "tag_mismatch": torch.zeros(2, dtype=torch.bool)})
    with pytest.raises(TypeError):
        mla_decode(**{**batch, "page_table": batch["page_table"].long()})


def test_tag_inputs_of_the_wrong_dtype_or_stride_are_refused() -> None:
    """Decode and prefill share the launcher's checks (`check_mla_inputs`)."""
    batch, _ = make_batch(
        [5], H=4, R=16, Dr=16, S=4, cache_dtype=torch.float32, q_dtype=torch.float32, seed=1
    )
    for what, bad, error in tag_input_misfits(batch):
        with pytest.raises(error):
            mla_decode(**bad)
            pytest.fail(what)


def test_kernels_compile_for_sm90() -> None:
    """The interpreter never lowers a kernel: compile MLA decode (64 and 16 heads, BF16 and FP8), sparse
    FP8, prefill, merge and kv_write (tag check on and off), GQA prefill and the DSA indexer's scoring
    with their default tiles for the H200 with Triton and ptxas (no GPU needed, a process without
    TRITON_INTERPRET); none may spill, nor hold fewer CTAs an SM than the MLA tile table says."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 17 and all(" 0 bytes spill stores" in line for line in lines), run.stdout


def test_pick_mla_splits_on_a_busy_grid() -> None:
    """Tiles that fill more than an eighth of the SMs: the busy model, each slice at least its cost."""
    fp8_64, fp8_16 = slice_cost_items(64, 512, 576), slice_cost_items(16, 512, 576)
    assert (fp8_64, fp8_16) == (519, 177)  # 64 + a slice's partials (rows x 512 fp32, both ways) in lines
    assert pick_mla_splits(64, 1, 32768, 132, 1, fp8_64, 32) == 2  # 64 heads, one CTA an SM: 128 of 132
    assert pick_mla_splits(64, 1, 32768, 132, 2, fp8_16, 32) == 4  # 16 heads, two CTAs an SM: 256 of 264
    assert pick_mla_splits(64, 1, 2048, 132, 1, fp8_64, 32) == 2  # sparse top-2048
    assert pick_mla_splits(17, 1, 2048, 132, 1, fp8_64, 32) == 3  # each slice >= its cost (519 lines)
    assert pick_mla_splits(4096, 1, 12288, 132, 1, fp8_64, 32) == 1  # prefill: enough tiles already


def test_pick_mla_splits_spreads_few_tiles_over_the_sms() -> None:
    """Up to 16 tiles on the H200's 132 SMs (GLM-5 at one rank: 64 heads, one 64-row tile a sequence,
    one CTA an SM, 32-token steps): the idle model, whatever the slice's partials cost, where the busy
    one took 7 slices (BF16) or 3 (FP8) at 2,048 items, and 39 / 103 µs at batch 1 (the sweep's best,
    32 / 64 slices: 20 / 21 µs)."""
    for cost in (slice_cost_items(64, 512, 1152), slice_cost_items(64, 512, 576)):  # BF16, FP8 lines
        assert pick_mla_splits(1, 1, 2048, 132, 1, cost, 32) == 32  # two steps a slice
        assert pick_mla_splits(1, 1, 2176, 132, 1, cost, 32) == 34  # 68 steps: two a slice
        assert pick_mla_splits(1, 1, 8192, 132, 1, cost, 32) == 86  # 256 steps: three a slice
        assert pick_mla_splits(1, 1, 700, 132, 1, cost, 32) == 22  # short: one step a slice
        assert pick_mla_splits(1, 1, 32, 132, 1, cost, 32) == 1  # one step: no merge
        assert pick_mla_splits(4, 1, 2048, 132, 1, cost, 32) == 32  # 128 programs
        assert pick_mla_splits(16, 1, 2048, 132, 1, cost, 32) == 8  # one wave: 128 of 132
    assert pick_mla_splits(1, 1, 32768, 132, 2, slice_cost_items(16, 512, 576), 32) == MAX_SPLITS
    for tiles in (1, 2, 3, 5, 8, 16):
        for items in (1, 31, 33, 500, 2048, 2049, 8192, 131072):
            for ctas in (1, 2):
                splits = pick_mla_splits(tiles, 1, items, 132, ctas, 519, 32)
                assert 1 <= splits <= min(MAX_SPLITS, -(-items // 32))  # at least one step a slice
                assert tiles * splits <= 132 * ctas  # one wave


def test_pick_num_splits() -> None:
    assert pick_num_splits(64, 4, 32768, 132) == 2  # 256 programs: one slice would leave SMs idle
    assert pick_num_splits(1, 4, 32768, 132) == 64  # batch 1, long context: many slices
    assert pick_num_splits(1, 4, 200, 132) == 1  # short context: one slice, no merge
    assert pick_num_splits(256, 4, 32768, 132) == 1


# --- GPU: bf16 queries, Kimi K2 shapes ---------------------------------------------------------------


def gpu_batch(B: int, ctx: list[int], cache_dtype: torch.dtype, H: int = 64, S: int = 16) -> dict:
    dev, R, Dr = "cuda", 512, 64
    g = torch.Generator(device=dev).manual_seed(0)
    pages_per = [-(-n // S) for n in ctx]
    P = sum(pages_per) + 8
    Mp = max(pages_per)
    perm = torch.randperm(P, device=dev, generator=g).to(torch.int32)
    table = torch.zeros(B, Mp, dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used : used + n]
        used += n
    tags = torch.randint(0, 2**40, (P,), device=dev, generator=g)
    lines = torch.randn(P, S, R + Dr, device=dev, generator=g)
    scale = 1.0
    if cache_dtype == FP8:
        scale = float(lines.abs().amax()) / 448
        cache = (lines / scale).to(FP8)
    else:
        cache = lines.to(cache_dtype)
    return dict(
        q=(torch.randn(B, H, R + Dr, device=dev, generator=g) * 2).to(torch.bfloat16),
        latent_cache=cache, latent_scale=scale, kv_lora_rank=R,
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=dev), page_table=table,
        expected_tags=tags[table.long()], page_tags=tags,
        tag_mismatch=torch.zeros(B, dtype=torch.bool, device=dev), softmax_scale=0.1447,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("block_h", [16, 32, 64])
def test_gpu_kimi_shapes(cache_dtype: torch.dtype, block_h: int) -> None:
    """64 heads in tiles of 16 and 32 (mma.sync) and 64 (wgmma); lengths around pages and steps."""
    ctx = [32768, 1, 17, 4099, 8192, 12345, 31, 20000]
    batch = gpu_batch(len(ctx), ctx, cache_dtype)
    poison_allocator()
    out = mla_decode(**batch, block_h=block_h, num_warps=8 if block_h > 16 else 4)
    ref = mla_decode_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()})
    assert not batch["tag_mismatch"].any() and out.isfinite().all()
    assert rel_err(out.float(), ref.float()) < 1e-2  # bf16 q/p in the dots, bf16 output


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("heads", [8, 16])
def test_gpu_tensor_parallel_shards(heads: int, cache_dtype: torch.dtype) -> None:
    """Kimi's TP8 and TP4 shards with the default tiles (16 rows, mma.sync; 8 heads fill half)."""
    ctx = [32768, 5, 16, 4097, 9000]
    batch = gpu_batch(len(ctx), ctx, cache_dtype, H=heads)
    poison_allocator()
    out = mla_decode(**batch)
    ref = mla_decode_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()})
    assert out.shape == (5, heads, 512) and out.isfinite().all()
    assert rel_err(out.float(), ref.float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_one_sequence_spreads_over_the_sms(cache_dtype: torch.dtype) -> None:
    """Batch 1 at 64 heads, the launcher's own slice count (`idle_splits`: 32 to 34 slices of two
    steps): 2,048 and 2,176 tokens dense, the top-2,048 of 2,176, and 700 tokens in a page table 2,048
    tokens wide (a decode graph's narrow width: 10 of the 32 slices without a token)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for ctx, sparse, width in ((2048, False, 128), (2176, False, 136), (2176, True, 136), (700, False, 128)):
        batch = gpu_batch(1, [ctx], cache_dtype)
        pad = width - batch["page_table"].shape[1]
        batch["page_table"] = torch.nn.functional.pad(batch["page_table"], (0, pad))
        batch["expected_tags"] = torch.nn.functional.pad(batch["expected_tags"], (0, pad), value=-1)
        topk = torch.randperm(ctx, device="cuda", generator=g)[None, :2048] if sparse else None
        poison_allocator()
        out = mla_decode(**batch, topk_indices=topk)
        ref = mla_decode_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()}, topk_indices=topk)
        assert not batch["tag_mismatch"].any() and out.isfinite().all(), (ctx, sparse)
        assert rel_err(out.float(), ref.float()) < 1e-2, (ctx, sparse)


@pytest.mark.gpu
@pytest.mark.parametrize("key", [k for k in VARIANTS if k[0] != "prefill"])
def test_gpu_tile_variants_match_reference(key: tuple[str, int, bool]) -> None:
    """Every tile config the benchmark's sweep may choose, on a dense or sparse batch."""
    mode, rows, fp8 = key
    ctx = [9000, 33, 2100]
    batch = gpu_batch(len(ctx), ctx, FP8 if fp8 else torch.bfloat16, H=64 if rows == 64 else 16)
    topk = None
    if mode == "sparse":
        g = torch.Generator(device="cuda").manual_seed(2)
        topk = torch.stack([torch.randperm(max(ctx), device="cuda", generator=g)[:2048] for _ in ctx])
        topk = torch.where(topk < torch.tensor(ctx, device="cuda")[:, None], topk, -1)
    ref = mla_decode_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()}, topk_indices=topk)
    for t in VARIANTS[key]:
        poison_allocator()
        out = mla_decode(
            **batch, topk_indices=topk, block_h=t.block_h, block_n=t.block_n, block_rc=t.block_rc,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
        assert out.isfinite().all() and rel_err(out.float(), ref.float()) < 1e-2, t


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("splits", [None, 3])
def test_gpu_tampered_and_sparse(splits: int | None, cache_dtype: torch.dtype) -> None:
    """A reallocated page full of NaN: the dirty slice walks the sanitised page list (dense and sparse,
    one or three slices); the flag is raised for its sequence only."""
    ctx = [16384, 3000, 700, 9999]
    batch = gpu_batch(len(ctx), ctx, cache_dtype)
    S = 16
    batch["page_tags"][batch["page_table"][1, 7]] += 1
    batch["latent_cache"][batch["page_table"][1, 7]] = torch.tensor(float("nan")).to(cache_dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    topk = torch.stack([torch.randperm(max(ctx), device="cuda", generator=g)[:2048] for _ in ctx])
    topk = torch.where(topk < torch.tensor(ctx, device="cuda")[:, None], topk, -1)  # 700 tokens: mostly -1
    topk[1] = torch.where(topk[1] == 7 * S + 3, -1, topk[1])
    topk[1, 0] = 7 * S + 3  # a token on the tampered page
    for tk in (None, topk):
        flags = torch.zeros(4, dtype=torch.bool, device="cuda")
        ref_flags = flags.clone()
        poison_allocator()
        out = mla_decode(**{**batch, "tag_mismatch": flags}, topk_indices=tk, num_splits=splits)
        ref = mla_decode_ref(**{**batch, "tag_mismatch": ref_flags}, topk_indices=tk)
        assert flags.tolist() == [False, True, False, False] == ref_flags.tolist()
        assert out.isfinite().all() and rel_err(out.float(), ref.float()) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_a_cuda_graph() -> None:
    """kv_write then mla_decode captured once (as the engine's decode graphs are) and replayed on new
    inputs copied into the same buffers: equal to eager calls, flags raised inside the replay."""
    from kernels.kv_write_triton import kv_write_triton

    ctx = [5000, 123, 16, 2049]
    batch = gpu_batch(len(ctx), ctx, FP8)
    B, S = len(ctx), 16
    seq_lens = batch["seq_lens"]
    slots = (batch["page_table"].long().gather(1, ((seq_lens.long() - 1) // S)[:, None])[:, 0] * S) + (
        seq_lens.long() - 1
    ) % S
    new = torch.randn(B, 576, device="cuda", dtype=torch.bfloat16)
    token_tags = batch["expected_tags"].gather(1, ((seq_lens.long() - 1) // S)[:, None])[:, 0].clone()
    token_seq = torch.arange(B, device="cuda")

    def step() -> torch.Tensor:
        kv_write_triton(batch["latent_cache"], new, slots, batch["latent_scale"], batch["page_tags"], token_tags,
                 token_seq, batch["tag_mismatch"])  # fmt: skip
        return mla_decode(**batch)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(2):
        new.copy_(torch.randn_like(new))
        batch["q"].copy_(torch.randn_like(batch["q"]))
        if trial == 1:  # sequence 2's page reallocated between steps
            batch["page_tags"][batch["page_table"][2, 0]] += 1
        batch["tag_mismatch"].zero_()
        graph.replay()
        flags = batch["tag_mismatch"].clone()
        batch["tag_mismatch"].zero_()
        eager = step()
        assert torch.equal(flags, batch["tag_mismatch"]) and flags.tolist() == [
            False,
            False,
            trial == 1,
            False,
        ]
        assert torch.equal(out, eager)
