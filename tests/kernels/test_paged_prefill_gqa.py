"""Paged GQA prefill (varlen causal chunks over cached pages, split-K, fused tag check) vs paged_attention_ref.

CPU CI runs the kernel under TRITON_INTERPRET=1 with float16/float32 queries (bf16 tl.dot is broken
in the interpreter) on small odd shapes; `gpu` tests run bf16 with BF16 and FP8 caches on
GLM-4.5-Air's 96/8 heads × 128. Each batch mixes a whole-prompt prefill, a chunk after a cached
prefix and a decode row, so tiles straddle sequence ends and causal limits differ per row. Unused
cache slots hold NaN (`lay_out`) and the output buffer starts as NaN, so a stray read or a row left
unwritten shows.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.gqa_slice import GQATiles, slice_constexprs  # noqa: E402
from kernels.paged_attention import paged_attention_ref  # noqa: E402
from kernels.paged_prefill_gqa import PREFILL_TILES, paged_prefill_gqa  # noqa: E402
from tests.kernels.paged_layout import lay_out, query_starts, random_pages, tag_input_misfits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: q and p rounded to fp16 for the dots


def make_batch(
    seq_lens: list[int], num_q: list[int], Hq: int, Hkv: int, D: int, S: int, cache_dtype: torch.dtype,
    q_dtype: torch.dtype, seed: int,
) -> tuple[dict, object]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    kv = [[torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)] for n in seq_lens]
    scales = [1.0, 1.0]
    if cache_dtype == FP8:  # FP8 values exact in the interpreter: stored = value / scale, rounded once
        scales = [max(float(t[i].abs().max()) for t in kv) / 448 for i in (0, 1)]
    paged = lay_out(kv, page_size=S, dtype=cache_dtype, scales=scales, seed=seed)
    return dict(
        q=torch.randn(sum(num_q), Hq, D, generator=g).to(q_dtype),
        k_cache=paged.caches[0], v_cache=paged.caches[1], k_scale=scales[0], v_scale=scales[1],
        query_start=query_starts(num_q), seq_lens=paged.seq_lens, page_table=paged.page_table,
        expected_tags=paged.expected_tags, page_tags=paged.page_tags,
        tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool), softmax_scale=D**-0.5,
    ), paged  # fmt: skip


def run_both(batch: dict, **kw) -> tuple[torch.Tensor, ...]:
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = paged_attention_ref(**ref_in)
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    poisoned = torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=DEV)
    out = paged_prefill_gqa(**dev_in, out=poisoned, **kw)
    assert out.data_ptr() == poisoned.data_ptr()
    return out.cpu(), ref.cpu(), dev_in["tag_mismatch"].cpu(), ref_in["tag_mismatch"].cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


CASES = [
    # cached + new tokens per sequence (seq_lens), new tokens (num_q), Hq, Hkv, D, page size
    ([1, 15, 16], [1, 15, 1], 6, 2, 16, 16),
    ([17, 33, 40], [17, 5, 1], 12, 1, 24, 5),  # G = 12 (GLM-4.5-Air's group), page 5, D not a power of 2
    ([70, 9, 100], [13, 9, 1], 4, 4, 16, 8),  # MHA
]


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("seq_lens", "num_q", "Hq", "Hkv", "D", "S"), CASES)
def test_matches_reference(
    seq_lens: list[int], num_q: list[int], Hq: int, Hkv: int, D: int, S: int, q_dtype: torch.dtype
) -> None:
    batch, _ = make_batch(seq_lens, num_q, Hq, Hkv, D, S, q_dtype, q_dtype, seed=sum(seq_lens) + Hq)
    out, ref, flags, ref_flags = run_both(batch, tiles=GQATiles(block_m=32, block_n=16))
    assert out.dtype == q_dtype and out.shape == (sum(num_q), Hq, D)
    assert rel_err(out, ref) < TOL[q_dtype]
    assert not flags.any() and not ref_flags.any()


@pytest.mark.parametrize(("block_m", "splits"), [(16, 3), (64, 2), (32, None)])
def test_tile_shapes_and_splits(block_m: int, splits: int | None) -> None:
    """Split-K over a varlen batch (merge per query row), 1-query tiles (block_m 16 < 2 · G)."""
    batch, _ = make_batch([45, 12, 5], [7, 5, 2], 12, 2, 16, 8, torch.float32, torch.float32, seed=4)
    out, ref, _, _ = run_both(batch, tiles=GQATiles(block_m=block_m, block_n=16), num_splits=splits)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_cache(splits: int) -> None:
    batch, _ = make_batch([40, 7], [9, 7], 8, 2, 32, 16, FP8, torch.float16, seed=3)
    out, ref, _, _ = run_both(batch, tiles=GQATiles(block_m=16, block_n=16), num_splits=splits)
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("splits", [1, 2])
def test_tampered_tag_flags_and_drops_the_page(splits: int) -> None:
    """A reallocated page (tag bumped, NaN bytes: float16, the interpreter's e4m3 loses NaN) is flagged
    for its sequence only; the output equals the reference's, which drops the page's tokens, and that
    differs from the clean reference's (the page really was in view)."""
    S = 8
    batch, paged = make_batch([40, 40, 23], [10, 40, 1], 4, 2, 16, S, torch.float16, torch.float16, seed=5)
    clean = paged_attention_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()})
    bad_page = paged.pages[1][2]  # tokens 16..23 of sequence 1, seen by its later queries only
    batch["page_tags"][bad_page] += 1
    batch["k_cache"][bad_page] = float("nan")
    batch["v_cache"][bad_page] = float("nan")
    out, ref, flags, ref_flags = run_both(batch, tiles=GQATiles(block_m=16, block_n=16), num_splits=splits)
    assert flags.tolist() == [False, True, False] == ref_flags.tolist()
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-3
    assert rel_err(out[:10], clean[:10]) < 2e-3 and rel_err(out[50:], clean[50:]) < 2e-3  # others untouched
    assert rel_err(out[10 + 16 :], clean[10 + 16 :]) > 1e-2  # queries at 16.. saw the page before


@pytest.mark.parametrize("splits", [1, 2])
def test_a_sequence_longer_than_its_table_row_stays_in_its_row(splits: int) -> None:
    """A length past the page table's width (a wrong reservation, which no planner makes): both
    launches walk only the sequence's own row (past it lies the next row's first page, under a tag
    that matches: read unflagged), the others are untouched. The CPU reference raises on it."""
    batch, _ = make_batch([40, 40, 23], [1, 40, 1], 4, 2, 16, 8, torch.float32, torch.float32, seed=7)
    clean = paged_attention_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()})
    batch["seq_lens"] = torch.tensor([47, 40, 23], dtype=torch.int32)  # 6 pages' worth, 5 in the row
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = paged_prefill_gqa(**dev_in, tiles=GQATiles(block_m=16, block_n=16), num_splits=splits).cpu()
    assert not dev_in["tag_mismatch"].any()
    assert (
        rel_err(out, clean) < 1e-5
    )  # sequence 0's query over its row's 40 tokens, as if its length were right


@pytest.mark.parametrize(("dv", "cache_dtype", "want"), [(32, FP8, False), (64, FP8, False), (128, FP8, True),
                                                        (256, FP8, True), (128, torch.float16, False)])  # fmt: skip
def test_fp8_v_is_read_as_byte_pairs_only_from_128_columns(
    dv: int, cache_dtype: torch.dtype, want: bool
) -> None:
    """SPLIT_V's 16- and 32-column halves (Dv 32, 64) were wrong on the H200
    (results/2026-12-02-gqa-prefill-splitv-diag*.log): the launchers read V as byte pairs only when each
    half has >= 64 columns, and only for FP8."""
    cache = torch.zeros(4, 16, 2, dv).to(cache_dtype)
    q = torch.zeros(3, 4, dv, dtype=torch.float16)
    flags = slice_constexprs(PREFILL_TILES["fp8/v4"], q, cache, cache, dv, dv)
    assert flags["SPLIT_V"] is want and flags["EVEN_D"]


@pytest.mark.parametrize(
    "D", [32, 64, 128]
)  # Dv 128: FP8 entries read V as byte pairs (SPLIT_V); 32, 64: plain
@pytest.mark.parametrize("name", sorted(PREFILL_TILES))
def test_every_tile_entry_drops_a_tampered_nan_page(name: str, D: int) -> None:
    """Each PREFILL_TILES entry at GLM-4.5-Air's 12 heads per KV head: a 90-token prompt (whole tiles,
    then diagonal ones), a chunk after 100 cached tokens and a decode row; a reallocated page with NaN
    bytes in the prompt (the interpreter's e4m3 loses NaN: FP8 rows only check that the page is
    dropped), seen by its later queries only."""
    kv = FP8 if name.startswith("fp8") else torch.float16
    batch, paged = make_batch([90, 107, 300], [90, 7, 1], 12, 1, D, 16, kv, torch.float16, seed=8)
    bad_page = paged.pages[0][3]  # tokens 48..63 of the prompt
    batch["page_tags"][bad_page] += 1
    for cache in ("k_cache", "v_cache"):
        batch[cache][bad_page] = torch.tensor(float("nan")).to(kv)
    out, ref, flags, ref_flags = run_both(
        batch, tiles=name, num_splits=1 + sorted(PREFILL_TILES).index(name) % 2
    )
    assert flags.tolist() == [True, False, False] == ref_flags.tolist()
    assert not out.isnan().any() and rel_err(out, ref) < 2e-3


@pytest.mark.parametrize(("S", "splits"), [(4, 2), (5, 3)])
def test_second_launch_covers_every_page_the_first_read(S: int, splits: int) -> None:
    """The invariant the prefill check rests on (issue 27): the first launch reads pages before any tag is
    checked and writes its part of the output, so the second must rewrite exactly the part of every slice
    holding a bad page. The output buffer starts as NaN and a NaN page sits at every position of a
    45-token sequence (a 20-query chunk over 25 cached tokens, 2-query tiles, split-K): no NaN is left,
    the output is the reference's, and only that sequence is flagged."""
    batch, paged = make_batch([45, 9], [20, 9], 4, 2, 16, S, torch.float16, torch.float16, seed=27)
    for i, page in enumerate(paged.pages[0]):
        bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        bad["page_tags"][page] += 1
        bad["k_cache"][page] = bad["v_cache"][page] = float("nan")
        out, ref, flags, ref_flags = run_both(bad, tiles=GQATiles(block_m=16, block_n=16), num_splits=splits)
        assert flags.tolist() == [True, False] == ref_flags.tolist(), i
        assert not out.isnan().any() and rel_err(out, ref) < 2e-3, i


def test_all_pages_mismatched_gives_zeros_and_check_can_be_disabled() -> None:
    batch, _ = make_batch([12, 30], [3, 30], 4, 1, 16, 4, torch.float32, torch.float32, seed=6)
    checked_ref = paged_attention_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()})
    batch["page_tags"] += 7  # every page reallocated
    out, ref, flags, _ = run_both(batch, num_splits=2, tiles=GQATiles(block_m=16, block_n=16))
    assert flags.all()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, torch.zeros_like(ref))
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    unchecked = paged_prefill_gqa(**dev_in, check_tags=False, tiles=GQATiles(block_m=16, block_n=16))
    assert not dev_in["tag_mismatch"].any()  # the benchmark's "off" arm really skips the check
    assert rel_err(unchecked.cpu(), checked_ref) < 1e-5


def test_launcher_rejects_bad_inputs() -> None:
    batch, _ = make_batch([5], [2], 4, 2, 16, 4, torch.float32, torch.float32, seed=1)
    with pytest.raises(ValueError):
        paged_prefill_gqa(**{**batch, "query_start": torch.tensor([0, 1, 2], dtype=torch.int32)})
    with pytest.raises(TypeError):
        paged_prefill_gqa(**{**batch, "k_cache": batch["k_cache"].half(), "v_cache": batch["v_cache"].half()})
    with pytest.raises(ValueError):
        paged_prefill_gqa(**batch, out=torch.empty(2, 4, 8))


def test_tag_inputs_of_the_wrong_dtype_or_stride_are_refused() -> None:
    batch, _ = make_batch([5], [2], 4, 2, 16, 4, torch.float32, torch.float32, seed=1)
    for what, bad, error in tag_input_misfits(batch):
        with pytest.raises(error):
            paged_prefill_gqa(**bad)
            pytest.fail(what)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_glm_air_chunk_over_cached_prefix(cache_dtype: torch.dtype) -> None:
    """96/8 heads × 128, bf16 q: a 1024-token chunk after 8k cached tokens, a 700-token prompt, decode
    rows (one at 20k), a poisoned page in the prompt; bf16/FP8 outputs within 1e-2 / 3e-2 of fp32."""
    dev, Hq, Hkv, D, S = "cuda", 96, 8, 128, 16
    seq_lens, num_q = [8192 + 1024, 700, 20000, 33, 1], [1024, 700, 1, 1, 1]
    g = torch.Generator(device=dev).manual_seed(0)
    table, tags = random_pages(seq_lens, S, g)
    P = tags.shape[0]
    k = torch.randn(P, S, Hkv, D, device=dev, generator=g)
    v = torch.randn(P, S, Hkv, D, device=dev, generator=g)
    ks, vs = (float(k.abs().amax()) / 448, float(v.abs().amax()) / 448) if cache_dtype == FP8 else (1.0, 1.0)
    batch = dict(
        q=torch.randn(sum(num_q), Hq, D, device=dev, generator=g).to(torch.bfloat16),
        k_cache=(k / ks).to(cache_dtype), v_cache=(v / vs).to(cache_dtype), k_scale=ks, v_scale=vs,
        query_start=query_starts(num_q).to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        page_table=table, expected_tags=tags[table.long()], page_tags=tags.clone(),
        tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool, device=dev), softmax_scale=D**-0.5,
    )  # fmt: skip
    batch["page_tags"][int(table[1, 20])] += 1  # tokens 320..335 of the prompt
    out, ref, flags, ref_flags = run_both(batch)
    assert flags.tolist() == [False, True, False, False, False] == ref_flags.tolist()
    assert out.isfinite().all()
    assert rel_err(out.float(), ref.float()) < (1e-2 if cache_dtype == torch.bfloat16 else 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_nan_page_at_every_position_is_dropped(cache_dtype: torch.dtype, splits: int) -> None:
    """Issue 27 on the compiled kernels (default tiles, inline PTX, FP8 V as byte pairs; the interpreter's
    e4m3 loses NaN): GLM-4.5-Air's heads, a 256-token chunk after 768 cached tokens and a decode row; a
    reallocated page with NaN bytes at every position of the chunk's sequence leaves no NaN (the second
    launch rewrote every part the first wrote from it) and the reference's output (run on the GPU)."""
    batch, paged = make_batch([1024, 700], [256, 1], 96, 8, 128, 16, cache_dtype, torch.bfloat16, seed=27)
    batch = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    for i, page in enumerate(paged.pages[0]):
        bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        bad["page_tags"][page] += 1
        bad["k_cache"][page] = bad["v_cache"][page] = torch.tensor(float("nan")).to(cache_dtype)
        out, ref, flags, ref_flags = run_both(bad, num_splits=splits)
        assert flags.tolist() == [True, False] == ref_flags.tolist(), i
        assert out.isfinite().all(), i
        assert rel_err(out.float(), ref.float()) < (1e-2 if cache_dtype == torch.bfloat16 else 3e-2), i
