"""Paged decode GQA attention (split-K, fused page-tag check) against the paged attention reference.

CPU CI runs the Triton kernels under TRITON_INTERPRET=1 with float16/float32 queries (bf16 tl.dot is
broken in the interpreter); `gpu` tests run bf16 with BF16 and FP8 caches on real shapes. The
reference is `kernels.paged_attention.paged_attention_ref`, itself checked against a plain softmax
over the gathered tokens below.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.gqa_slice import GQATiles  # noqa: E402
from kernels.paged_attention import paged_decode_gqa_ref  # noqa: E402
from kernels.paged_decode_gqa import (  # noqa: E402
    DECODE_TILES,
    DEFAULT_TILES,
    paged_decode_gqa,
    pick_num_splits,
)
from tests.kernels.paged_layout import tag_input_misfits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# triton 3.6's interpreter turns 1-element arrays into loop bounds with int(); numpy < 2.4 only warns
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def make_batch(
    seq_lens: list[int],
    Hq: int,
    Hkv: int,
    D: int,
    S: int,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype,
    gen: torch.Generator,
    spare_pages: int = 3,
) -> dict:
    """A paged cache holding `len(seq_lens)` sequences on shuffled pages, random tags, all matching."""
    pages_per = [math.ceil(n / S) for n in seq_lens]
    P = sum(pages_per) + spare_pages
    Mp = max(pages_per) + 1  # one padding column
    perm = torch.randperm(P, generator=gen)
    page_table = torch.zeros(len(seq_lens), Mp, dtype=torch.int32)
    expected = torch.full((len(seq_lens), Mp), -1, dtype=torch.int64)
    page_tags = torch.randint(0, 2**40, (P,), generator=gen)
    used = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[used : used + n].to(torch.int32)
        expected[b, :n] = page_tags[page_table[b, :n].long()]
        used += n
    k = torch.randn(P, S, Hkv, D, generator=gen)
    v = torch.randn(P, S, Hkv, D, generator=gen)
    k_scale = v_scale = 1.0
    if kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = 0.02, 0.03  # stored = value / scale
        k, v = (k / k_scale).to(kv_dtype), (v / v_scale).to(kv_dtype)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    return dict(
        q=torch.randn(len(seq_lens), Hq, D, generator=gen).to(q_dtype),
        k_cache=k, v_cache=v, k_scale=k_scale, v_scale=v_scale,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), page_table=page_table,
        expected_tags=expected, page_tags=page_tags,
        tag_mismatch=torch.zeros(len(seq_lens), dtype=torch.bool), softmax_scale=D**-0.5,
    )  # fmt: skip


def to(batch: dict, device: str) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def run_both(batch: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = paged_decode_gqa_ref(**ref_in)
    dev_in = to(batch, DEV)
    out = paged_decode_gqa(**dev_in, **kw)
    return out.cpu(), ref, dev_in["tag_mismatch"].cpu(), ref_in["tag_mismatch"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_reference_is_softmax_attention() -> None:
    """The reference op against a plain per-sequence softmax over the gathered pages (float64)."""
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([7, 20], Hq=4, Hkv=2, D=8, S=4, kv_dtype=torch.float32, q_dtype=torch.float32, gen=gen)
    ref = paged_decode_gqa_ref(**batch)
    for b, L in enumerate([7, 20]):
        pages = batch["page_table"][b, : math.ceil(L / 4)].long()
        k = batch["k_cache"][pages].reshape(-1, 2, 8)[:L].double()  # [L, Hkv, D]
        v = batch["v_cache"][pages].reshape(-1, 2, 8)[:L].double()
        for h in range(4):
            p = torch.softmax(k[:, h // 2] @ batch["q"][b, h].double() * 8**-0.5, dim=0)
            assert torch.allclose(ref[b, h].double(), p @ v[:, h // 2], atol=1e-5)


CASES = [
    # seq_lens, Hq, Hkv, D, S, num_splits
    ([1, 17, 40], 4, 2, 32, 16, None),
    ([33, 5, 64, 100], 6, 3, 48, 5, 3),  # page size not a power of two, D not a power of two
    ([130], 12, 1, 64, 8, 4),  # 12 heads on one KV head (GLM-4.5-Air's 12:1 group)
    ([9, 70], 8, 8, 16, 16, 7),  # MHA, more splits than some sequences have tokens
]


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("seq_lens", "Hq", "Hkv", "D", "S", "splits"), CASES)
def test_matches_reference(
    seq_lens: list[int], Hq: int, Hkv: int, D: int, S: int, splits: int | None, q_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + Hq)
    batch = make_batch(seq_lens, Hq, Hkv, D, S, q_dtype, q_dtype, gen)
    out, ref, flags, ref_flags = run_both(batch, num_splits=splits)
    assert out.dtype == q_dtype and out.shape == (len(seq_lens), Hq, D)
    assert rel_err(out, ref) < (2e-3 if q_dtype == torch.float16 else 1e-5)
    assert not flags.any() and not ref_flags.any()


@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_cache_matches_reference(splits: int) -> None:
    gen = torch.Generator().manual_seed(11)
    batch = make_batch([45, 3], 8, 2, 32, 16, torch.float8_e4m3fn, torch.float16, gen)
    out, ref, _, _ = run_both(batch, num_splits=splits)
    assert rel_err(out, ref) < 2e-3


def test_tag_mismatch_flags_sequence_and_drops_page() -> None:
    """A reallocated page (tag bumped) is flagged for its sequence only and contributes nothing,
    even when its bytes are NaN (another tenant's FP8 data)."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([40, 40, 23], 4, 2, 32, 8, torch.float8_e4m3fn, torch.float32, gen)
    bad_page = int(batch["page_table"][1, 2])
    batch["page_tags"][bad_page] += 1
    batch["k_cache"][bad_page] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    batch["v_cache"][bad_page] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    out, ref, flags, ref_flags = run_both(
        batch, num_splits=2, tiles=GQATiles(block_n=16)
    )  # bad page in slice 0
    assert flags.tolist() == [False, True, False] == ref_flags.tolist()
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-3  # an FP8 cache computes its dots in fp16


@pytest.mark.parametrize("splits", [1, 2])
def test_a_sequence_longer_than_its_table_row_stays_in_its_row(splits: int) -> None:
    """A length past the page table's width (a wrong reservation, which no planner makes): the sequence
    attends over its own row only; past it lies the next row's first page, under a tag that matches,
    which the walk would read unflagged. The others are untouched."""
    gen = torch.Generator().manual_seed(8)
    batch = make_batch([40, 40, 23], 4, 2, 32, 8, torch.float32, torch.float32, gen, spare_pages=3)
    for name in ("page_table", "expected_tags"):  # no padding column: 5 wide, row after row
        batch[name] = batch[name][:, :5].contiguous()
    _, ref, _, _ = run_both(batch, num_splits=splits)  # the lengths as laid out: the answer
    long = {**batch, "seq_lens": torch.tensor([47, 40, 23], dtype=torch.int32)}
    long["tag_mismatch"] = torch.zeros(3, dtype=torch.bool)
    dev_in = to(long, DEV)
    out = paged_decode_gqa(**dev_in, num_splits=splits, tiles=GQATiles(block_n=16)).cpu()
    assert not dev_in["tag_mismatch"].any()
    assert rel_err(out, ref) < 1e-5  # sequence 0 over its own 40 tokens, as if its length were right


@pytest.mark.parametrize("block_n", [16, 64])
def test_bad_page_in_a_later_slice(block_n: int) -> None:
    """Slices before the bad page take the fast path; the slice holding it drops only that page."""
    gen = torch.Generator().manual_seed(15)
    batch = make_batch([100, 61], 4, 2, 16, 4, torch.float16, torch.float16, gen)
    batch["page_tags"][int(batch["page_table"][0, 20])] -= 3  # tokens 80..83 of sequence 0
    out, ref, flags, ref_flags = run_both(batch, num_splits=4, tiles=GQATiles(block_n=block_n, lazy_sum=True))
    assert flags.tolist() == [True, False] == ref_flags.tolist()
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("name", sorted(DECODE_TILES))
def test_every_tile_entry_drops_a_tampered_nan_page(name: str) -> None:
    """Each DECODE_TILES entry: 12 query heads per KV head, partial last tiles, a slice with a reallocated
    page (tag bumped, NaN bytes) and slices without; outputs equal the reference's."""
    kv = torch.float8_e4m3fn if name.startswith("fp8") else torch.float16
    batch = make_batch([300, 1, 77, 513], 24, 2, 32, 16, kv, torch.float16, torch.Generator().manual_seed(21))
    bad = int(batch["page_table"][3, 20])  # tokens 320..335 of sequence 3
    batch["page_tags"][bad] += 1
    batch["k_cache"][bad] = batch["v_cache"][bad] = torch.tensor(float("nan")).to(kv)
    out, ref, flags, ref_flags = run_both(batch, tiles=name, num_splits=3)
    assert flags.tolist() == [False, False, False, True] == ref_flags.tolist()
    assert not out.isnan().any() and rel_err(out, ref) < 2e-3


def tamper(batch: dict, page: int) -> dict:
    """The batch with `page` reallocated: its tag bumped, its K/V bytes NaN (another tenant's)."""
    batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    batch["page_tags"][page] += 1
    kv = batch["k_cache"].dtype
    batch["k_cache"][page] = batch["v_cache"][page] = torch.tensor(float("nan")).to(kv)
    return batch


@pytest.mark.parametrize(("S", "block_n"), [(4, 16), (5, 16)])
def test_rewalk_covers_every_page_the_hot_walk_read(S: int, block_n: int) -> None:
    """The invariant the decode check rests on (issue 27, `kernels/gqa_slice.py`): the hot walk reads a
    slice's pages before their tags are checked, so a slice holding a bad page must be walked again from
    a fresh state over exactly its tokens. A NaN page at every position of a 3-slice sequence (slice
    edges, the partial last page; tiles aligned to pages and not) leaves no NaN and the reference's
    output, and flags that sequence only."""
    gen = torch.Generator().manual_seed(27)
    batch = make_batch([45, 7], 4, 2, 16, S, torch.float16, torch.float16, gen)
    for i in range(math.ceil(45 / S)):
        out, ref, flags, ref_flags = run_both(
            tamper(batch, int(batch["page_table"][0, i])), num_splits=3, tiles=GQATiles(block_n=block_n)
        )
        assert flags.tolist() == [True, False] == ref_flags.tolist(), i
        assert not out.isnan().any() and rel_err(out, ref) < 2e-3, i


@pytest.mark.parametrize("kv", [torch.float16, torch.float8_e4m3fn])
def test_value_cache_of_its_own_width_and_strides(kv: torch.dtype) -> None:
    """V 24 wide in a 40-wide allocation: its strides differ from K's (no shared offsets), its columns
    are masked (FP8: the byte pairs too), and the output is 24 wide."""
    gen = torch.Generator().manual_seed(4)
    batch = make_batch([70, 129], 8, 2, 32, 16, kv, torch.float16, gen)
    v = torch.randn(*batch["v_cache"].shape[:3], 40, generator=gen)
    batch["v_cache"] = (v / batch["v_scale"]).to(kv)[..., :24]
    for name in ("bf16/v4", "fp8/v4") if kv == torch.float8_e4m3fn else ("bf16/v4",):
        out, ref, _, _ = run_both(batch, tiles=name, num_splits=2)
        assert out.shape == (2, 8, 24) and rel_err(out, ref) < 2e-3


def test_all_pages_mismatched_gives_zeros_and_flag() -> None:
    gen = torch.Generator().manual_seed(6)
    batch = make_batch([12, 30], 4, 1, 16, 4, torch.float32, torch.float32, gen)
    batch["page_tags"] += 7  # every page reallocated
    out, ref, flags, _ = run_both(batch, num_splits=3)
    assert flags.all()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, torch.zeros_like(ref))


def test_flags_are_sticky_and_check_can_be_disabled() -> None:
    gen = torch.Generator().manual_seed(8)
    batch = make_batch([20, 20], 4, 2, 16, 4, torch.float32, torch.float32, gen)
    batch["tag_mismatch"][0] = True  # set by an earlier layer: never cleared
    out, ref, flags, _ = run_both(batch)
    assert flags.tolist() == [True, False]
    assert rel_err(out, ref) < 1e-5
    batch["page_tags"] += 1
    dev_in = to(batch, DEV)
    dev_in["tag_mismatch"].zero_()
    unchecked = paged_decode_gqa(**dev_in, check_tags=False)
    assert not dev_in["tag_mismatch"].any()  # the benchmark's "off" arm really skips the check
    assert rel_err(unchecked.cpu(), ref) < 1e-5


def test_split_choice() -> None:
    assert pick_num_splits(64, 8, 8192, 132) == 2  # occupancy unknown: 512 programs already ~4 per SM
    assert pick_num_splits(1, 8, 131072, 132) == 64  # one long sequence: capped
    assert pick_num_splits(4, 8, 100, 132) == 1  # short context: one slice
    # knowing the occupancy: 512 programs fill 4 × 132 slots (97%); at 6 a SM, 3 slices fill two waves (97%)
    assert pick_num_splits(64, 8, 8192, 132, programs_per_sm=4, split_cost=0.006) == 1
    assert pick_num_splits(64, 8, 8192, 132, programs_per_sm=6, split_cost=0.003) == 3
    assert pick_num_splits(8, 8, 32768, 132, programs_per_sm=4, split_cost=0.0004) == 8


def test_shape_errors() -> None:
    gen = torch.Generator().manual_seed(9)
    batch = make_batch([5], 4, 2, 16, 4, torch.float32, torch.float32, gen)
    with pytest.raises(ValueError):
        paged_decode_gqa(**{**batch, "q": batch["q"][:, :3]})
    with pytest.raises(TypeError):
        paged_decode_gqa(**{**batch, "k_cache": batch["k_cache"].half(), "v_cache": batch["v_cache"].half()})
    with pytest.raises(ValueError):
        paged_decode_gqa(**{**batch, "tag_mismatch": torch.zeros(1, dtype=torch.int32)})


def test_tag_inputs_of_the_wrong_dtype_or_stride_are_refused() -> None:
    gen = torch.Generator().manual_seed(9)
    batch = make_batch([5], 4, 2, 16, 4, torch.float32, torch.float32, gen)
    for what, bad, error in tag_input_misfits(batch):
        with pytest.raises(error):
            paged_decode_gqa(**bad)
            pytest.fail(what)


def test_kernels_compile_for_sm90() -> None:
    """The GQA decode and prefill kernels (prefill's two launches) and the DSA scoring, at their default
    tiles, compile for the H200 (Triton + ptxas, no GPU; a process without TRITON_INTERPRET, whose inline
    PTX the interpreter never sees) with the launch's 16-divisible strides; none spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile_gqa"],
        env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 9 and all(" 0 bytes spill stores" in line for line in lines), run.stdout
    for kv in ("bf16", "fp8"):  # the split rule's occupancy is what ptxas gives
        line = next(line for line in lines if line.startswith(f"gqa decode {kv} "))
        assert f"resident={DECODE_TILES[DEFAULT_TILES[kv]].programs_per_sm}" in line, line


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("seq_lens", "Hq", "Hkv"), [([1, 300, 4097, 1000], 96, 8), ([2000] * 8, 32, 8)])
def test_bf16_on_gpu(seq_lens: list[int], Hq: int, Hkv: int, kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) + Hq)
    batch = make_batch(seq_lens, Hq, Hkv, 128, 16, kv_dtype, torch.bfloat16, gen)
    batch["page_tags"][int(batch["page_table"][-1, 1])] += 1
    out, ref, flags, ref_flags = run_both(batch)
    assert not out.isnan().any()
    assert torch.equal(flags, ref_flags) and flags[-1]
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_nan_page_at_every_position_is_dropped(kv_dtype: torch.dtype) -> None:
    """Issue 27 on the compiled kernel (default tiles and splits, inline PTX, FP8 V as byte pairs; the
    interpreter's e4m3 loses NaN): a reallocated page with NaN bytes at every position of a 2049-token
    sequence leaves no NaN and the reference's output, and flags that sequence only."""
    gen = torch.Generator().manual_seed(27)
    batch = make_batch([2049, 300], 32, 8, 128, 16, kv_dtype, torch.bfloat16, gen)
    for i in range(math.ceil(2049 / 16)):
        out, ref, flags, ref_flags = run_both(tamper(batch, int(batch["page_table"][0, i])))
        assert flags.tolist() == [True, False] == ref_flags.tolist(), i
        assert not out.isnan().any() and rel_err(out, ref) < 1e-2, i


@pytest.mark.gpu
def test_gpu_tampered_page_is_caught_in_a_cuda_graph_replay() -> None:
    """The decode graphs' path (`backend/engine/decode_graphs.py`) for GQA: the launch captured once, then
    replayed on new queries copied into the same buffers; a page reallocated (tag bumped, FP8 NaN bytes)
    between replays is flagged inside the replay and dropped, as the eager call and the reference do."""
    gen = torch.Generator().manual_seed(27)
    batch = to(make_batch([2049, 300, 17], 32, 8, 128, 16, torch.float8_e4m3fn, torch.bfloat16, gen), "cuda")

    def step() -> torch.Tensor:
        return paged_decode_gqa(**batch)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    bad = int(batch["page_table"][0, 70])
    for trial in range(2):
        batch["q"].copy_(torch.randn_like(batch["q"]))
        if trial == 1:  # sequence 0's page reallocated between steps
            batch["page_tags"][bad] += 1
            batch["k_cache"][bad] = batch["v_cache"][bad] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
        batch["tag_mismatch"].zero_()
        graph.replay()
        flags = batch["tag_mismatch"].clone()
        ref_in = {**batch, "tag_mismatch": torch.zeros_like(flags)}
        ref = paged_decode_gqa_ref(**ref_in)
        assert flags.tolist() == [trial == 1, False, False] == ref_in["tag_mismatch"].tolist()
        assert not out.isnan().any() and rel_err(out, ref) < 1e-2
        batch["tag_mismatch"].zero_()
        assert torch.equal(step(), out)  # the replay computes what an eager call does
