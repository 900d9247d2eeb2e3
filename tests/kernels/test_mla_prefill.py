"""Paged MLA prefill (varlen causal chunks over cached pages, tag-checked, DSA sparse) vs mla_attention_ref.

CPU CI runs the kernel under TRITON_INTERPRET=1 with float16/float32 queries and small latent widths;
`gpu` tests run bf16 on Kimi's shapes. Each batch mixes a whole-prompt prefill, a chunk after a
cached prefix, and a decode row, so tiles straddle sequence ends and causal limits differ per row.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.mla_attention import mla_attention_ref  # noqa: E402
from kernels.mla_prefill import mla_prefill  # noqa: E402
from kernels.mla_tiles import VARIANTS  # noqa: E402
from kernels.triton_lib import query_tiles, query_tiles_triton  # noqa: E402
from tests.kernels.paged_layout import lay_out, poison_allocator, query_starts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: q and p rounded to fp16 for the dots


def make_batch(
    seq_lens: list[int], num_q: list[int], H: int, R: int, Dr: int, S: int, cache_dtype: torch.dtype,
    q_dtype: torch.dtype, seed: int,
) -> tuple[dict, object]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    lines = [[torch.randn(n, R + Dr, generator=g)] for n in seq_lens]
    scale = 1.0
    if cache_dtype == FP8:
        scale = max(float(t[0].abs().max()) for t in lines) / 448
    paged = lay_out(lines, page_size=S, dtype=cache_dtype, scales=[scale], seed=seed)
    return dict(
        q=torch.randn(sum(num_q), H, R + Dr, generator=g).to(q_dtype),
        latent_cache=paged.caches[0], latent_scale=scale, kv_lora_rank=R, query_start=query_starts(num_q),
        seq_lens=paged.seq_lens, page_table=paged.page_table, expected_tags=paged.expected_tags,
        page_tags=paged.page_tags, tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool),
        softmax_scale=(R + Dr) ** -0.5,
    ), paged  # fmt: skip


def run_both(batch: dict, topk: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, ...]:
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = mla_attention_ref(**ref_in, topk_indices=topk)
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = mla_prefill(**dev_in, topk_indices=None if topk is None else topk.to(DEV), **kw)
    return out.cpu(), ref, dev_in["tag_mismatch"].cpu(), ref_in["tag_mismatch"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_query_tiles_cover_every_query_once() -> None:
    qs = query_starts([5, 0, 1, 8, 3])
    tiles = query_tiles(qs, 17, 4)
    covered = []
    for seq, q0 in zip(tiles.tile_seq.tolist(), tiles.tile_q0.tolist(), strict=True):
        if seq < 5:
            end = int(qs[seq + 1])
            assert int(qs[seq]) <= q0 < end
            covered += range(q0, min(q0 + 4, end))
    assert sorted(covered) == list(range(17))
    assert tiles.tile_seq.shape[0] == min(17, 5 + 5)  # the host-known bound


@pytest.mark.parametrize("block_q", [1, 2, 4, 64])
def test_one_launch_query_tiles_are_the_torch_ones(block_q: int) -> None:
    """The Triton grid builder (one launch on CUDA) against the torch one (3 launches at block_q = 1,
    19 above): the same tiles in the same order, empty sequences and partial tiles included; idle
    tiles' first query is never read (0 here)."""
    g = torch.Generator().manual_seed(block_q)
    for lens in (
        [5, 0, 1, 8, 3],
        [1],
        [0, 0, 7],
        [300, 2, 0, 129],
        torch.randint(0, 9, (40,), generator=g).tolist(),
    ):
        qs = query_starts(lens)
        T = int(qs[-1])
        ref = query_tiles(qs, T, block_q)
        got = query_tiles_triton(qs.to(DEV), T, block_q)
        seq, q0 = got.tile_seq.cpu(), got.tile_q0.cpu()
        assert got.block_q == block_q and torch.equal(got.query_start.cpu(), qs.to(torch.int32))
        assert seq.dtype == q0.dtype == torch.int32 and torch.equal(seq, ref.tile_seq)
        real = seq < len(lens)
        assert torch.equal(q0[real], ref.tile_q0[real])
        # idle tiles: at a query per tile, tile t stays query t (the DSA indexer's score-row map)
        assert torch.equal(q0, ref.tile_q0) if block_q == 1 else not q0[~real].any()
    idle = query_tiles_triton(query_starts([5]).to(DEV), 7, block_q)  # more tokens than queries: idle tiles
    ref = query_tiles(query_starts([5]), 7, block_q)
    assert torch.equal(idle.tile_seq.cpu(), ref.tile_seq) and idle.tile_seq.cpu().tolist()[-1] == 1
    if block_q == 1:
        assert idle.tile_q0.cpu().tolist() == list(range(7)) == ref.tile_q0.tolist()


CASES = [
    # cached + new tokens per sequence (seq_lens), new tokens (num_q)
    ([1, 15, 16], [1, 15, 1]),
    ([17, 33, 40], [17, 5, 1]),
    ([200, 9, 70], [23, 9, 1]),
]


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("seq_lens", "num_q"), CASES)
def test_matches_reference(seq_lens: list[int], num_q: list[int], q_dtype: torch.dtype) -> None:
    """12 heads in blocks of 8 (a partial head block), tiles of 4 queries (partial tiles)."""
    batch, _ = make_batch(
        seq_lens, num_q, H=12, R=32, Dr=8, S=16, cache_dtype=q_dtype, q_dtype=q_dtype, seed=sum(seq_lens)
    )
    out, ref, flags, ref_flags = run_both(batch, block_q=4, block_h=8)
    assert out.dtype == q_dtype and out.shape == (sum(num_q), 12, 32)
    assert rel_err(out, ref) < TOL[q_dtype]
    assert not flags.any() and not ref_flags.any()


def test_a_steps_memo_makes_its_query_tiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of one step share `PagedBatch.memo`: the tiles are made by the first (19 launches at
    block_q > 1, 76 of a 3-draft greedy step's 366 before), read by the rest, with the same output."""
    import kernels.triton_lib as lib

    made = []
    real = lib.query_tiles
    monkeypatch.setattr(lib, "query_tiles", lambda *a: made.append(a) or real(*a))
    batch, _ = make_batch(
        [9, 20], [4, 4], H=8, R=32, Dr=8, S=8, cache_dtype=torch.float32, q_dtype=torch.float32, seed=3
    )
    alone, ref, _, _ = run_both(batch, block_q=4, block_h=8)
    assert len(made) == 1  # no memo: made for the call
    memo: dict = {}
    for _layer in range(3):
        out, _, _, _ = run_both(batch, block_q=4, block_h=8, memo=memo)
        assert torch.equal(out, alone) and rel_err(out, ref) < 1e-5
    assert len(made) == 2  # one more: the memo's, for all three
    run_both(batch, block_q=2, block_h=8, memo=memo)  # other tiles: made anew
    assert len(made) == 3


@pytest.mark.parametrize(("block_q", "block_h", "splits"), [(2, 16, 3), (1, 16, 2), (8, 2, None)])
def test_tile_shapes_and_splits(block_q: int, block_h: int, splits: int | None) -> None:
    """Split-K over a varlen batch (merge per query row), single-query tiles, wide query tiles."""
    batch, _ = make_batch(
        [70, 12, 5],
        [10, 12, 2],
        H=16,
        R=32,
        Dr=16,
        S=8,
        cache_dtype=torch.float32,
        q_dtype=torch.float32,
        seed=4,
    )
    out, ref, _, _ = run_both(batch, block_q=block_q, block_h=block_h, num_splits=splits)
    assert rel_err(out, ref) < 1e-5


def test_fp8_cache_and_real_width() -> None:
    batch, _ = make_batch(
        [40, 7], [9, 7], H=16, R=512, Dr=64, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=3
    )
    out, ref, _, _ = run_both(batch, block_q=1, block_h=16, block_n=16)
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("splits", [1, 2])
def test_tampered_tag_flags_and_drops_the_page(splits: int) -> None:
    """NaN bytes on the reallocated page (float16: the interpreter's e4m3 emulation loses NaN)."""
    S = 8
    batch, paged = make_batch(
        [40, 40, 23],
        [10, 40, 1],
        H=6,
        R=32,
        Dr=16,
        S=S,
        cache_dtype=torch.float16,
        q_dtype=torch.float16,
        seed=5,
    )
    bad_page = paged.pages[1][2]  # tokens 16..23 of sequence 1, seen by its later queries only
    batch["page_tags"][bad_page] += 1
    batch["latent_cache"][bad_page] = float("nan")
    out, ref, flags, ref_flags = run_both(batch, block_q=4, block_h=8, num_splits=splits)
    assert flags.tolist() == [False, True, False] == ref_flags.tolist()
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("splits", [1, 2])
def test_sparse_mode_matches_reference(splits: int) -> None:
    """Per-query lists with positions after the query (causally hidden), -1 padding, one list that
    sees nothing (all zeros), and a tampered page no list chooses (flagged all the same)."""
    S, seq_lens, num_q = 8, [60, 30], [12, 1]
    batch, paged = make_batch(
        seq_lens, num_q, H=20, R=32, Dr=8, S=S, cache_dtype=torch.float16, q_dtype=torch.float16, seed=8
    )
    g = torch.Generator().manual_seed(1)
    topk = torch.full((13, 10), -1, dtype=torch.int64)
    for t in range(13):
        L = seq_lens[0] if t < 12 else seq_lens[1]
        topk[t, :9] = torch.randperm(L, generator=g)[:9]
    topk[0, :9] = torch.arange(59, 50, -1)  # query 0 sits at position 48: every choice is in its future
    topk[12] = torch.where(topk[12] // S == 1, -1, topk[12])
    batch["page_tags"][paged.pages[1][1]] += 3
    out, ref, flags, ref_flags = run_both(batch, topk.to(torch.int32), num_splits=splits)
    assert flags.tolist() == [False, True] == ref_flags.tolist()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out, ref) < 2e-3


def test_launcher_rejects_bad_inputs() -> None:
    batch, _ = make_batch(
        [5], [2], H=4, R=16, Dr=16, S=4, cache_dtype=torch.float32, q_dtype=torch.float32, seed=1
    )
    with pytest.raises(ValueError):
        mla_prefill(**{**batch, "query_start": torch.tensor([0, 1, 2], dtype=torch.int32)})
    with pytest.raises(ValueError):
        mla_prefill(**batch, topk_indices=torch.zeros(3, 4, dtype=torch.int64))  # T is 2
    with pytest.raises(ValueError):
        mla_prefill(**batch, block_q=2, block_h=4)  # 8 rows: below a tl.dot tile


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_kimi_chunk_over_cached_prefix(cache_dtype: torch.dtype, sparse: bool) -> None:
    """64 heads x 576: a 512-token chunk after 8k cached tokens, a 300-token prompt, 3 decodes;
    sparse: GLM-5's 2048 positions per query (some after the query: causally hidden)."""
    dev, R, Dr, S, H = "cuda", 512, 64, 16, 64
    seq_lens, num_q = [8192 + 512, 300, 4000, 17, 1], [512, 300, 1, 1, 1]
    g = torch.Generator(device=dev).manual_seed(0)
    pages_per = [-(-n // S) for n in seq_lens]
    P = sum(pages_per) + 4
    perm = torch.randperm(P, device=dev, generator=g).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used : used + n]
        used += n
    tags = torch.randint(0, 2**40, (P,), device=dev, generator=g)
    lines = torch.randn(P, S, R + Dr, device=dev, generator=g)
    scale = float(lines.abs().amax()) / 448 if cache_dtype == FP8 else 1.0
    batch = dict(
        q=torch.randn(sum(num_q), H, R + Dr, device=dev, generator=g).to(torch.bfloat16),
        latent_cache=(lines / scale).to(cache_dtype), latent_scale=scale, kv_lora_rank=R,
        query_start=query_starts(num_q).to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        page_table=table, expected_tags=tags[table.long()], page_tags=tags,
        tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool, device=dev), softmax_scale=0.1447,
    )  # fmt: skip
    topk = None
    if sparse:
        seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(num_q)).tolist()
        rows = [torch.randperm(seq_lens[b], device=dev, generator=g)[:2048] for b in seq_of]
        topk = torch.stack([torch.nn.functional.pad(r, (0, 2048 - r.numel()), value=-1) for r in rows])
    ref = mla_attention_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()}, topk_indices=topk)
    variants = [] if sparse else VARIANTS[("prefill", 64, cache_dtype == FP8)]  # what the sweep may pick
    for t in [None, *variants]:
        kw = {} if t is None else dict(
            block_q=64 // t.block_h, block_h=t.block_h, block_n=t.block_n, block_rc=t.block_rc,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
        poison_allocator()
        out = mla_prefill(**batch, topk_indices=topk, **kw)
        assert not batch["tag_mismatch"].any() and out.isfinite().all()
        assert rel_err(out.float(), ref.float()) < 1e-2, t
