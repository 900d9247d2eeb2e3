"""Triton noaux_tc routing against route_ref: the same experts in the same order (best biased
score first), weights within float32 rounding; one group or several, a non-power-of-two expert
count, with and without renormalisation.

CPU CI runs the kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.router import route_ref  # noqa: E402
from kernels.router_triton import route_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize(
    ("T", "E", "k", "G", "TG", "norm"),
    [
        (1, 256, 8, 1, 1, True),
        (3, 384, 8, 1, 1, True),
        (5, 64, 6, 8, 3, True),
        (2, 32, 4, 4, 2, False),
        (4, 16, 16, 1, 1, True),
    ],
)
def test_matches_reference(T: int, E: int, k: int, G: int, TG: int, norm: bool) -> None:
    g = torch.Generator().manual_seed(E * 10 + k)
    logits = (torch.randn(T, E, generator=g) * 2).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEV)
    w, ids = route_triton(logits, bias, k, G, TG, norm, 2.5)
    ref_w, ref_ids = route_ref(logits, bias, k, G, TG, norm, 2.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-7)  # the GPU's exp is ex2.approx


def test_group_limit_excludes_experts_of_dropped_groups() -> None:
    """Group 0 holds the single best expert but a weak second; groups 1 and 2 win on their top-2 sum."""
    E, G = 16, 4
    logits = torch.full((1, E), -4.0)
    logits[0, 0] = 4.0  # group 0: best expert, weak partner
    logits[0, 4:6] = torch.tensor([2.0, 1.9])  # group 1
    logits[0, 8:10] = torch.tensor([1.5, 1.4])  # group 2
    logits, bias = logits.to(DEV), torch.zeros(E, device=DEV)
    _, ids = route_triton(logits, bias, 4, G, 2, True, 1.0)
    assert ids[0].tolist() == [4, 5, 8, 9]
    assert torch.equal(ids, route_ref(logits, bias, 4, G, 2, True, 1.0)[1])


def test_bad_arguments_raise() -> None:
    logits = torch.zeros(2, 24, device=DEV)
    with pytest.raises(ValueError, match="groups"):
        route_triton(logits, torch.zeros(24, device=DEV), 4, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="logits"):
        route_triton(logits.half(), torch.zeros(24, device=DEV), 4, 1, 1, True, 1.0)
