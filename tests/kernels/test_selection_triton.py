"""top_positions_triton against the reference's top_positions: the same chosen set per row (the radix
path writes it in column order), ties, -0.0 and -inf included; the keys + topk path (rows past
RADIX_MAX_COLS, `set_select_method("topk")`, or off CUDA) the same positions in the same order.

CPU CI runs the kernels under TRITON_INTERPRET=1, where `top_positions_triton` takes keys + topk:
these tests call the radix path themselves, streamed (`resident=False`, or small `block`s so that it
loops over several chunks and its tail on short rows) and resident (the row's keys held in
registers, one trip of the next power of two)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import kernels.selection_triton as selection  # noqa: E402
from kernels.selection import top_positions  # noqa: E402
from kernels.selection_triton import (  # noqa: E402
    top_positions_keys,
    top_positions_radix,
    top_positions_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def tied_scores(R: int, L: int, seed: int) -> torch.Tensor:
    """[R, L]: many exact ties, -inf, -0.0 beside 0.0, and a third of distinct values."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 5, (R, L), generator=g).float() * 0.5
    scores[scores == -2.0] = float("-inf")
    scores[scores == 0.5] = -0.0
    n = L // 3
    scores[:, L - n :] += torch.randn(R, n, generator=g)
    return scores.to(DEV)


def same_set(got: torch.Tensor, scores: torch.Tensor, k: int) -> bool:
    return torch.equal(got.sort(dim=1).values, top_positions(scores, k).sort(dim=1).values)


STREAMED = partial(top_positions_radix, resident=False)
RESIDENT = partial(top_positions_radix, resident=True)
RESIDENT8 = partial(top_positions_radix, resident=True, digit_bits=8)  # 4 rounds of 256 bins


@pytest.mark.parametrize(
    "path",
    [top_positions_triton, STREAMED, RESIDENT, RESIDENT8],
    ids=["entry", "streamed", "resident", "resident8"],
)
@pytest.mark.parametrize(
    ("R", "L", "k"),
    [(1, 2100, 2048), (3, 40, 7), (4, 1500, 1500), (2, 9, 1), (2, 64, 64), (3, 229, 1), (1, 8000, 2048)],
)
def test_same_set_as_the_reference(
    path: Callable[[torch.Tensor, int], torch.Tensor], R: int, L: int, k: int
) -> None:
    scores = tied_scores(R, L, L + k)
    assert same_set(path(scores, k), scores, k)


@pytest.mark.parametrize(("R", "L", "k"), [(1, 2100, 2048), (3, 40, 7)])
def test_keys_path_same_positions_as_the_reference(R: int, L: int, k: int) -> None:
    scores = tied_scores(R, L, L + k)
    assert torch.equal(top_positions_keys(scores, k), top_positions(scores, k, best_first=False))


@pytest.mark.parametrize("resident", [False, True, 8], ids=["block64", "resident", "resident8"])
@pytest.mark.parametrize(("L", "k"), [(64 * 3 + 37, 100), (64 * 3 + 37, 1), (64 * 2, 128 - 5), (50, 49)])
def test_chunked_rows_with_ties_across_chunks(L: int, k: int, resident: bool | int) -> None:
    """block 64 (tail 16): the threshold's ties span chunk boundaries and the tail; which of them are
    chosen (the earliest) depends on the counts carried between chunks. Resident: one trip, the
    same earliest ties."""
    g = torch.Generator().manual_seed(L * k)
    scores = torch.full((3, L), 1.5)
    scores[0, torch.randperm(L, generator=g)[: k // 2]] = 7.0  # half of k above, the rest tied
    scores[1, ::3] = -0.0  # a third tied at the threshold, the rest above it
    scores[1, 1::3] = 2.0
    scores[2] = torch.randint(0, 3, (L,), generator=g).float()  # three values, every one tied
    scores = scores.to(DEV)
    if resident == 8:
        got = RESIDENT8(scores, k)
    elif resident:
        got = top_positions_radix(scores, k, resident=True)
    else:
        got = top_positions_radix(scores, k, block=64)
    assert same_set(got, scores, k)


def test_radix_writes_exactly_k_slots_a_row() -> None:
    """Into rows wider than k: the slots past k keep what was there (one tie too many would land
    in the next row's first slot, which that row's program overwrites)."""
    scores = tied_scores(3, 229, 4)
    k = 100
    out = torch.full((3, k + 8), -7, dtype=torch.int64, device=DEV)
    selection._radix_select_kernel[(3,)](
        scores, out, 229, k, scores.stride(0), out.stride(0), BLOCK=64, TAIL=16, PDL=False
    )
    assert same_set(out[:, :k], scores, k) and (out[:, k:] == -7).all()
    out.fill_(-7)
    selection._radix_resident_kernel[(3,)](
        scores, out, 229, k, scores.stride(0), out.stride(0), BLOCK=256, PDL=False
    )
    assert same_set(out[:, :k], scores, k) and (out[:, k:] == -7).all()


def test_resident_writes_in_column_order_as_streamed() -> None:
    """Both radix kernels write the chosen columns in column order (-1s where a chosen -inf's column
    was): the same tensor, not only the same set."""
    scores = tied_scores(3, 229, 8)
    for k in (1, 100, 229):
        streamed = top_positions_radix(scores, k, block=64)
        assert torch.equal(top_positions_radix(scores, k, resident=True), streamed)
        assert torch.equal(RESIDENT8(scores, k), streamed)


def test_rows_with_few_visible_tokens_get_minus_one() -> None:
    scores = torch.full((2, 50), float("-inf"), device=DEV)
    scores[0, [3, 17]] = torch.tensor([1.0, -0.0], device=DEV)
    got = top_positions_triton(scores, 5)
    assert sorted(got[0].tolist()) == [-1, -1, -1, 3, 17] and (got[1] == -1).all()


@pytest.mark.parametrize("k", [1, 33, 70])
def test_all_minus_inf_rows_choose_only_minus_one(k: int) -> None:
    scores = torch.full((2, 70), float("-inf"), device=DEV)
    assert (top_positions_radix(scores, k, block=32) == -1).all()
    assert (top_positions_radix(scores, k, resident=True) == -1).all()
    assert (RESIDENT8(scores, k) == -1).all()


def test_any_bit_pattern_matches_the_reference() -> None:
    """Every float32 bit pattern (NaNs of both signs, denormals, infinities): the key order is the
    reference's, so NaN is chosen where its key says, as there."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31, (3, 300), generator=g, dtype=torch.int64).to(torch.int32)
    bits[0, :40] = bits[0, 40]  # a run of one pattern
    scores = bits.view(torch.float32).to(DEV)
    for k in (1, 150, 299):
        assert same_set(top_positions_radix(scores, k, block=64), scores, k), k
        assert same_set(top_positions_radix(scores, k, resident=True), scores, k), k
        assert same_set(RESIDENT8(scores, k), scores, k), k


def test_no_rows() -> None:
    for path in (top_positions_triton, STREAMED, RESIDENT):
        assert path(torch.zeros(0, 40, device=DEV), 7).shape == (0, 7)


@pytest.mark.gpu
def test_gpu_prefill_rows_and_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of rows (a prefill chunk's), GLM-5's k, the widest row the radix path takes, and
    the decode row of issue 24's profile: the reference's sets."""
    monkeypatch.setattr(selection, "SELECT_METHOD", "radix")
    for R, L, k in [(5000, 3000, 2048), (3, 16384, 2048), (64, 8192, 2048), (1, 2176, 2048), (1, 4096, 2048)]:
        scores = tied_scores(R, L, R + L)
        assert selection.uses_radix(scores) == (selection.SELECT_METHOD == "radix")
        assert same_set(top_positions_triton(scores, k), scores, k), (R, L)
        if selection.radix_resident(R, L):  # the path not taken, on the same rows
            assert same_set(top_positions_radix(scores, k, resident=False), scores, k), (R, L)
            assert same_set(RESIDENT8(scores, k), scores, k), (R, L)


def test_default_block_wide_for_few_rows_narrow_for_many() -> None:
    """The default trips of the H200 timings (module docstring), and the widest one on the reference:
    one 4,096-column trip and its 512-column tail over a 4,700-column row."""
    assert [selection.radix_block(1, L) for L in (9, 40, 2176, 4096, 16384)] == [16, 32, 2048, 4096, 4096]
    assert [selection.radix_block(4096, L) for L in (40, 3000, 8192)] == [32, 512, 512]
    scores = tied_scores(1, 4700, 11)
    assert same_set(top_positions_radix(scores, 2048, resident=False), scores, 2048)


def test_resident_for_few_rows_that_fit() -> None:
    """Decode's few rows up to RADIX_RESIDENT_COLS held in registers, one trip of the next power of
    two; a prefill chunk's rows and longer rows streamed; an explicit `block` streams."""
    assert [selection.radix_resident(1, L) for L in (9, 2176, 8192, 8193)] == [True, True, True, False]
    assert [selection.radix_resident(R, 2176) for R in (16, 17, 64, 512)] == [True, False, False, False]
    assert [selection.resident_block(L) for L in (1, 9, 16, 17, 2176, 4096, 8192)] == [
        16,
        16,
        16,
        32,
        4096,
        4096,
        8192,
    ]


def test_radix_only_on_cuda() -> None:
    """The interpreter takes ~70 ms a row of the radix kernel (the DSA indexer's tests: minutes), so
    CPU rows take keys + topk."""
    assert not selection.uses_radix(torch.zeros(1, 40))


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of `kernels.selection_triton.<name>` made through top_positions_triton."""
    calls: list[int] = []
    path: Callable[..., torch.Tensor] = getattr(selection, name)

    def counted(scores: torch.Tensor, k: int) -> torch.Tensor:
        calls.append(scores.shape[1])
        return path(scores, k)

    monkeypatch.setattr(selection, name, counted)
    return calls


def test_rows_past_the_bound_take_keys_and_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selection, "RADIX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(selection, "SELECT_METHOD", "radix")
    monkeypatch.setattr(selection, "RADIX_MAX_COLS", 64)
    keys, radix = spy(monkeypatch, "top_positions_keys"), spy(monkeypatch, "top_positions_radix")
    short, long = tied_scores(2, 64, 1), tied_scores(2, 65, 2)
    assert same_set(top_positions_triton(short, 9), short, 9)
    got = top_positions_triton(long, 9)
    assert torch.equal(got, top_positions(long, 9, best_first=False))
    assert radix == [64] and keys == [65]


def test_select_method_topk_takes_keys_and_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selection, "RADIX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(selection, "SELECT_METHOD", "radix")  # restored after the test
    selection.set_select_method("topk")
    keys, radix = spy(monkeypatch, "top_positions_keys"), spy(monkeypatch, "top_positions_radix")
    top_positions_triton(tied_scores(1, 40, 3), 7)
    assert keys == [40] and not radix


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="k must"):
        top_positions_triton(torch.zeros(1, 4, device=DEV), 5)
    with pytest.raises(ValueError, match="float32"):
        top_positions_triton(torch.zeros(1, 4, device=DEV).half(), 2)
    with pytest.raises(ValueError, match="block"):
        top_positions_radix(torch.zeros(1, 40, device=DEV), 2, block=48)
    with pytest.raises(ValueError, match="resident rows"):
        top_positions_radix(torch.zeros(1, 8193, device=DEV), 2, resident=True)
    with pytest.raises(ValueError, match="select method"):
        selection.set_select_method("sort")
