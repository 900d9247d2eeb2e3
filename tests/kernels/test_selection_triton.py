"""top_positions_triton against the reference's unsorted top_positions: the same positions in the
same order (the same int64 keys into the same `topk`), ties, -0.0 and -inf included.

CPU CI runs the key kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.selection import top_positions  # noqa: E402
from kernels.selection_triton import top_positions_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize(("R", "L", "k"), [(1, 2100, 2048), (3, 40, 7), (4, 1500, 1500), (2, 9, 1)])
def test_same_positions_as_the_reference(R: int, L: int, k: int) -> None:
    g = torch.Generator().manual_seed(L + k)
    scores = torch.randint(-4, 5, (R, L), generator=g).float() * 0.5  # many exact ties
    scores[scores == -2.0] = float("-inf")
    scores[scores == 0.5] = -0.0  # -0.0 ties with 0.0
    n = L // 3
    scores[:, L - n :] += torch.randn(R, n, generator=g)  # and distinct ones
    scores = scores.to(DEV)
    got = top_positions_triton(scores, k)
    assert torch.equal(got, top_positions(scores, k, best_first=False))
    assert torch.equal(got.sort(dim=1).values, top_positions(scores, k).sort(dim=1).values)


def test_rows_with_few_visible_tokens_get_minus_one() -> None:
    scores = torch.full((2, 50), float("-inf"), device=DEV)
    scores[0, [3, 17]] = torch.tensor([1.0, -0.0], device=DEV)
    got = top_positions_triton(scores, 5)
    assert sorted(got[0].tolist()) == [-1, -1, -1, 3, 17] and (got[1] == -1).all()


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="k must"):
        top_positions_triton(torch.zeros(1, 4, device=DEV), 5)
    with pytest.raises(ValueError, match="float32"):
        top_positions_triton(torch.zeros(1, 4, device=DEV).half(), 2)
