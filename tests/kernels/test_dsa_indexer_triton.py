"""DSA indexer on the GPU path (Triton scoring over paged keys, fused tag check, top_positions) vs dsa_indexer_ref.

CPU CI runs the scoring kernel under TRITON_INTERPRET=1 with float16/float32 queries on small odd
shapes; `gpu` tests run bf16 queries with BF16 and FP8 keys at GLM-5's indexer shape (32 heads × 128,
index_topk 2048). Scores are compared with a brute-force pure-torch scoring; the choice is compared
by value (scores a rounding apart may swap): the reference scores of the chosen positions, sorted,
must equal the reference's top-k scores. Exact ties (several relu'd to exactly 0) go to the earlier
token on both paths, index for index.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.dsa_indexer import dsa_indexer_ref  # noqa: E402
from kernels.dsa_indexer_triton import (  # noqa: E402
    INDEXER_TILES,
    IndexerTiles,
    dsa_indexer_scores,
    dsa_indexer_triton,
    indexer_tiles,
)
from tests.kernels.paged_layout import lay_out, query_starts, random_pages, tag_input_misfits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
FP8 = torch.float8_e4m3fn


def make_batch(
    seq_lens: list[int], num_q: list[int], Hi: int, Di: int, S: int, key_dtype: torch.dtype,
    q_dtype: torch.dtype, seed: int, topk: int,
) -> tuple[dict, list[torch.Tensor], object]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, Di, generator=g) for n in seq_lens]
    scale = max(float(k.abs().max()) for k in keys) / 448 if key_dtype == FP8 else 1.0
    paged = lay_out([[k] for k in keys], page_size=S, dtype=key_dtype, scales=[scale], seed=seed)
    T = sum(num_q)
    batch = dict(
        q=torch.randn(T, Hi, Di, generator=g).to(q_dtype), weights=torch.randn(T, Hi, generator=g),
        k_cache=paged.caches[0], k_scale=scale, query_start=query_starts(num_q), seq_lens=paged.seq_lens,
        page_table=paged.page_table, expected_tags=paged.expected_tags, page_tags=paged.page_tags,
        tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool), softmax_scale=Di**-0.5, topk=topk,
    )  # fmt: skip
    return batch, keys, paged


def brute_scores(batch: dict, bad_pages: frozenset[int] = frozenset()) -> torch.Tensor:
    """[T, W] float64 scores from the batch's cache (dequantized), -inf where not visible."""
    cache, S = batch["k_cache"], batch["k_cache"].shape[1]
    W = batch["page_table"].shape[1] * S
    qs, T = batch["query_start"].tolist(), batch["q"].shape[0]
    out = torch.full((T, W), float("-inf"), dtype=torch.float64)
    for b, L in enumerate(batch["seq_lens"].tolist()):
        pages = batch["page_table"][b].long()
        k = cache[pages].double().reshape(W, -1)[:L] * batch["k_scale"]  # [L, Di]
        for t in range(qs[b], qs[b + 1]):
            pos = L - (qs[b + 1] - qs[b]) + (t - qs[b])
            per_head = torch.relu(k @ batch["q"][t].double().T * batch["softmax_scale"])  # [L, Hi]
            s = per_head @ batch["weights"][t].double()
            for j in range(pos + 1):
                if int(pages[j // S]) not in bad_pages:
                    out[t, j] = s[j]
    return out


def run_scores(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, W] float64 per query row, flags); the kernel's score buffer starts as NaN, so a
    score it leaves unwritten shows."""
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    del dev_in["topk"]
    T, Hi, _ = batch["q"].shape
    tiles = indexer_tiles(dev_in["query_start"], T, batch["seq_lens"].shape[0], Hi)
    W = batch["page_table"].shape[1] * batch["k_cache"].shape[1]
    poisoned = torch.full((tiles.tile_seq.shape[0] * tiles.block_q, W), float("nan"), device=DEV)
    scores, q_row = dsa_indexer_scores(**dev_in, **kw, tiles=tiles, out=poisoned)
    assert scores.data_ptr() == poisoned.data_ptr()
    per_query = torch.full((T + 1, W), float("nan"), dtype=torch.float64)
    per_query[q_row.cpu()] = scores.cpu().double()
    assert torch.isneginf(per_query[T]).all() or not (q_row == T).any()  # idle rows: nothing visible
    return per_query[:T], dev_in["tag_mismatch"].cpu()


def assert_same_choice(
    idx: torch.Tensor, ref_idx: torch.Tensor, ref_scores: torch.Tensor, atol: float
) -> None:
    assert idx.shape == ref_idx.shape and idx.dtype == torch.int64
    for t in range(idx.shape[0]):
        got, want = idx[t][idx[t] >= 0], ref_idx[t][ref_idx[t] >= 0]
        assert got.numel() == want.numel() and got.unique().numel() == got.numel()
        assert torch.isfinite(ref_scores[t, got]).all()  # only visible tokens of good pages
        g = ref_scores[t, got].sort(descending=True).values
        w = ref_scores[t, want].sort(descending=True).values
        assert torch.allclose(g, w, atol=atol, rtol=0), (t, g - w)
        assert ((idx[t] >= 0).sum() + (idx[t] == -1).sum()) == idx.shape[1]  # the rest -1


def run_both(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = dsa_indexer_ref(**ref_in)
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    idx = dsa_indexer_triton(**dev_in, **kw)
    return idx.cpu(), ref, dev_in["tag_mismatch"].cpu(), ref_in["tag_mismatch"]


CASES = [
    # seq_lens, num_q, Hi, Di, page size, topk, block_q
    ([1, 15, 16], [1, 15, 1], 4, 16, 16, 8, None),
    ([37, 60, 20], [37, 5, 1], 6, 24, 5, 11, 4),  # Hi, Di, page size not powers of two; tiles of 4
    ([3, 70], [1, 1], 4, 16, 8, 40, None),  # decode, topk above one sequence's length
    ([3, 9, 12], [1, 1, 1], 4, 16, 8, 40, None),  # decode, topk above the table's width: no selection
]


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("seq_lens", "num_q", "Hi", "Di", "S", "topk", "block_q"), CASES)
def test_scores_and_choice_match_reference(
    seq_lens: list[int], num_q: list[int], Hi: int, Di: int, S: int, topk: int, block_q: int | None,
    q_dtype: torch.dtype,
) -> None:  # fmt: skip
    batch, _, _ = make_batch(seq_lens, num_q, Hi, Di, S, q_dtype, q_dtype, seed=sum(seq_lens), topk=topk)
    want = brute_scores(batch)
    got, flags = run_scores(batch, config=IndexerTiles(block_n=16))
    assert not flags.any()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))  # visibility exactly; no NaN left
    tol = 1e-5 if q_dtype == torch.float32 else 3e-3
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=tol, atol=tol * float(want[finite].abs().max()))
    idx, ref, flags, ref_flags = run_both(batch, block_q=block_q, config=IndexerTiles(block_n=16))
    assert not flags.any() and not ref_flags.any()
    assert_same_choice(idx, ref, want, atol=tol * float(want[finite].abs().max()) * 2)


def test_fp8_keys_and_groups_of_tiles() -> None:
    """FP8 keys with the layer scale; a score bound so small that every tile gets its own launch."""
    batch, _, _ = make_batch([50, 9], [12, 9], 8, 32, 16, FP8, torch.float16, seed=3, topk=16)
    want = brute_scores(batch)
    finite = torch.isfinite(want)
    got, _ = run_scores(batch, config=IndexerTiles(block_n=32))
    assert torch.allclose(got[finite], want[finite], rtol=3e-3, atol=3e-3 * float(want[finite].abs().max()))
    idx, ref, _, _ = run_both(batch, config=IndexerTiles(block_n=32), max_score_bytes=1)
    assert_same_choice(idx, ref, want, atol=6e-3 * float(want[finite].abs().max()))


def test_tampered_tag_flags_and_its_keys_are_never_chosen() -> None:
    """A reallocated page with NaN keys (float16: the interpreter's e4m3 loses NaN): the sequence is
    flagged, its tokens score -inf, the choice equals the reference's (which drops the page), and the
    page held tokens the clean run chose."""
    S = 8
    batch, _, paged = make_batch([40, 40, 23], [10, 40, 1], 4, 16, S, torch.float16, torch.float16, 5, topk=6)
    clean, *_ = run_both(batch, config=IndexerTiles(block_n=16))
    bad_page = paged.pages[1][2]  # tokens 16..23 of sequence 1
    assert ((clean[10:50] >= 16) & (clean[10:50] < 24)).any()
    batch["page_tags"][bad_page] += 1
    batch["k_cache"][bad_page] = float("nan")
    want = brute_scores(batch, frozenset({bad_page}))
    got, flags = run_scores(batch, config=IndexerTiles(block_n=16))
    assert flags.tolist() == [False, True, False]
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    idx, ref, flags, ref_flags = run_both(batch, config=IndexerTiles(block_n=16))
    assert flags.tolist() == [False, True, False] == ref_flags.tolist()
    assert not ((idx[10:50] >= 16) & (idx[10:50] < 24)).any()
    finite = torch.isfinite(want)
    assert_same_choice(idx, ref, want, atol=6e-3 * float(want[finite].abs().max()))


@pytest.mark.parametrize("name", sorted(INDEXER_TILES))
def test_every_tile_entry_scores_and_drops_a_tampered_page(name: str) -> None:
    """Each INDEXER_TILES entry on a batch of its phase (decode rows, or a prompt and a chunk): programs
    of several key tiles, tiles no query sees, a reallocated page (NaN keys where 16-bit: the
    interpreter's e4m3 loses NaN) that scores -inf and flags its sequence only."""
    kv = FP8 if name.startswith("fp8") else torch.float16
    lens, num_q = ([300, 45, 600], [1, 1, 1]) if "/decode/" in name else ([90, 140], [30, 140])
    batch, _, paged = make_batch(lens, num_q, 4, 32, 16, kv, torch.float16, seed=9, topk=20)
    bad_page = paged.pages[-1][5]  # tokens 80..95 of the last sequence
    batch["page_tags"][bad_page] += 1
    batch["k_cache"][bad_page] = torch.tensor(float("nan")).to(kv)
    want = brute_scores(batch, frozenset({bad_page}))
    got, flags = run_scores(batch, config=name)
    assert flags.tolist() == [False] * (len(lens) - 1) + [True]
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    scale = float(want[finite].abs().max())
    assert torch.allclose(got[finite], want[finite], rtol=3e-3, atol=3e-3 * scale)
    idx, ref, _, _ = run_both(batch, config=name)
    assert_same_choice(idx, ref, want, atol=6e-3 * scale)


@pytest.mark.parametrize("bad_index", [6, 0])
def test_tampered_page_across_programs_of_unaligned_pages(bad_index: int) -> None:
    """The check is per page, once a program, before its token loop: pages of 5 tokens, programs of 32
    (two 16-token tiles), so a program's first page may start before it and page 6 (tokens 30..34)
    spans two programs; each masks its own tokens of it, and the flag is its sequence's alone."""
    batch, _, paged = make_batch([70, 41], [3, 41], 4, 16, 5, torch.float16, torch.float16, seed=11, topk=9)
    bad_page = paged.pages[0][bad_index]
    batch["page_tags"][bad_page] += 1
    batch["k_cache"][bad_page] = float("nan")
    want = brute_scores(batch, frozenset({bad_page}))
    cfg = IndexerTiles(block_n=16, steps=2)
    got, flags = run_scores(batch, config=cfg)
    assert flags.tolist() == [True, False]
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    scale = float(want[finite].abs().max())
    assert torch.allclose(got[finite], want[finite], rtol=3e-3, atol=3e-3 * scale)
    idx, ref, flags, ref_flags = run_both(batch, config=cfg)
    assert flags.tolist() == ref_flags.tolist() == [True, False]
    assert_same_choice(idx, ref, want, atol=6e-3 * scale)


@pytest.mark.parametrize("S", [4, 5])
def test_decode_rewrite_covers_every_score_the_token_loop_wrote(S: int) -> None:
    """The invariant the decode check rests on (issue 27): the token loop scores a program's tokens before
    it acts on their pages' tags, so a program with a bad page must rewrite -inf over exactly that page's
    tokens of its range. A NaN page at every position of a decode row (pages aligned to the 16-token tiles
    and not, programs of two tiles, so a page may span two programs), in a NaN-filled score buffer: the
    bad page's tokens score -inf, every other score is the brute-force one, no NaN is left, and only that
    sequence is flagged."""
    batch, _, paged = make_batch([45, 9], [1, 1], 4, 16, S, torch.float16, torch.float16, seed=27, topk=9)
    for i, page in enumerate(paged.pages[0]):
        bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        bad["page_tags"][page] += 1
        bad["k_cache"][page] = float("nan")
        want = brute_scores(bad, frozenset({page}))
        got, flags = run_scores(bad, config=IndexerTiles(block_n=16, steps=2))
        assert flags.tolist() == [True, False], i
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any(), i
        finite = torch.isfinite(want)
        scale = float(want[finite].abs().max())
        assert torch.allclose(got[finite], want[finite], rtol=3e-3, atol=3e-3 * scale), i


def test_equal_scores_go_to_the_earlier_token_as_in_the_reference() -> None:
    """Two heads with negative weights: no score is above 0, and a key both ReLUs zero scores exactly
    0 (or -0.0), so most top-k slots are ties. The choice is the reference's set (the GPU path does
    not sort it), and the reference equals a stable sort of the brute-force scores (ties: the
    earlier token first)."""
    batch, _, _ = make_batch([45, 30, 9], [1, 30, 1], 2, 16, 8, torch.float32, torch.float32, seed=11, topk=6)
    batch["weights"] = -batch["weights"].abs()
    idx, ref, _, _ = run_both(batch)
    assert torch.equal(idx.sort(dim=1).values, ref.sort(dim=1).values)
    want = brute_scores(batch)  # [T, W] float64
    order = want.sort(dim=1, descending=True, stable=True).indices[:, :6]
    expected = torch.where(torch.isneginf(want.gather(1, order)), -1, order)
    assert torch.equal(ref, expected)
    assert int((want.gather(1, order) == 0).sum()) > 20  # ties decide many slots


def test_check_can_be_disabled_and_bad_inputs_rejected() -> None:
    batch, _, _ = make_batch([20, 9], [3, 9], 4, 16, 4, torch.float32, torch.float32, seed=6, topk=5)
    batch["page_tags"] += 1
    dev_in = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    unchecked = dsa_indexer_triton(**dev_in, check_tags=False, config=IndexerTiles(block_n=16))
    assert not dev_in["tag_mismatch"].any() and (unchecked >= 0).any()  # the benchmark's "off" arm
    with pytest.raises(ValueError):
        dsa_indexer_triton(**{**batch, "weights": batch["weights"].half()})
    with pytest.raises(ValueError):
        dsa_indexer_triton(**{**batch, "query_start": torch.tensor([0, 12], dtype=torch.int32)})
    with pytest.raises(TypeError):
        dsa_indexer_triton(**{**batch, "k_cache": batch["k_cache"].half()})


def test_tag_inputs_of_the_wrong_dtype_or_stride_are_refused() -> None:
    batch, _, _ = make_batch([20, 9], [3, 9], 4, 16, 4, torch.float32, torch.float32, seed=6, topk=5)
    for what, bad, error in tag_input_misfits(batch):
        with pytest.raises(error):
            dsa_indexer_triton(**bad)
            pytest.fail(what)


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, FP8])
def test_gpu_glm5_indexer(key_dtype: torch.dtype) -> None:
    """GLM-5's indexer (32 heads × 128, top 2048): a 512-token chunk after 6k cached tokens, a
    300-token prompt (fewer than 2048 visible: -1 tail), decode rows at 20k and 3k; a poisoned page."""
    dev, Hi, Di, S, K = "cuda", 32, 128, 16, 2048
    seq_lens, num_q = [6144 + 512, 300, 20000, 3000], [512, 300, 1, 1]
    g = torch.Generator(device=dev).manual_seed(0)
    table, tags = random_pages(seq_lens, S, g)
    P = tags.shape[0]
    keys = torch.randn(P, S, Di, device=dev, generator=g)
    scale = float(keys.abs().amax()) / 448 if key_dtype == FP8 else 1.0
    T = sum(num_q)
    batch = dict(
        q=torch.randn(T, Hi, Di, device=dev, generator=g).to(torch.bfloat16),
        weights=torch.randn(T, Hi, device=dev, generator=g) * Hi**-0.5,
        k_cache=(keys / scale).to(key_dtype), k_scale=scale, query_start=query_starts(num_q).to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), page_table=table,
        expected_tags=tags[table.long()], page_tags=tags.clone(),
        tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool, device=dev), softmax_scale=Di**-0.5, topk=K,
    )  # fmt: skip
    batch["page_tags"][int(table[2, 7])] += 1  # tokens 112..127 of the 20k decode row
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = dsa_indexer_ref(**ref_in)
    idx = dsa_indexer_triton(**batch)
    assert batch["tag_mismatch"].tolist() == [False, False, True, False] == ref_in["tag_mismatch"].tolist()
    assert not ((idx[-2] >= 112) & (idx[-2] < 128)).any()
    assert (idx[512:812, 300:] == -1).all() and (idx[512:812, :1] >= 0).all()
    # reference scores in fp32 from the same bf16 q: the chosen sets' score profiles agree within
    # bf16 rounding of q·k (relative 1e-2 of the row's largest score)
    qs = query_starts(num_q).tolist()
    for b, L in enumerate(seq_lens):
        k = batch["k_cache"][table[b].long()].float().reshape(-1, Di)[:L] * scale
        for t in (qs[b], qs[b + 1] - 1):
            s = torch.relu(k @ batch["q"][t].float().T * Di**-0.5) @ batch["weights"][t]  # [L]
            s[L - (qs[b + 1] - t) + 1 :] = float("-inf")
            if b == 2:
                s[112:128] = float("-inf")
            got, want = idx[t][idx[t] >= 0], ref[t][ref[t] >= 0]
            assert got.numel() == want.numel()
            tol = 1e-2 * float(s[torch.isfinite(s)].abs().max())
            gs, ws = s[got].sort(descending=True).values, s[want].sort(descending=True).values
            assert torch.allclose(gs, ws, atol=tol, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, FP8])
def test_gpu_decode_nan_page_at_every_position_scores_minus_inf(key_dtype: torch.dtype) -> None:
    """Issue 27 on the compiled decode kernel (default tiles; the interpreter's e4m3 loses NaN): GLM-5's 32
    indexer heads, a reallocated page with NaN keys at every position of a 3000-token decode row, in a
    NaN-filled score buffer: that page's tokens score -inf, every other score is bit for bit the clean
    run's (the rewrite touched nothing else), and only that sequence is flagged."""
    batch, _, paged = make_batch(
        [3000, 700], [1, 1], 32, 128, 16, key_dtype, torch.bfloat16, seed=27, topk=2048
    )
    clean, flags = run_scores(batch)
    assert flags.tolist() == [False, False] and not clean.isnan().any()
    for i, page in enumerate(paged.pages[0]):
        bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        bad["page_tags"][page] += 1
        bad["k_cache"][page] = torch.tensor(float("nan")).to(key_dtype)
        got, flags = run_scores(bad)
        assert flags.tolist() == [True, False], i
        on_page = torch.zeros_like(got, dtype=torch.bool)
        on_page[0, i * 16 : (i + 1) * 16] = True
        assert torch.isneginf(got[on_page]).all() and torch.equal(got[~on_page], clean[~on_page]), i
