"""Triton row norms (one launch for up to three) against their references: each RMSNorm within a
rounding of `rms_norm_ref` (the mean sums in another order), each LayerNorm within a rounding of
`F.layer_norm`; a DSA layer's three norms at shrunken shapes, strided slices of one projection as
inputs, a slice of the latent line as an output.

CPU CI runs the kernel under TRITON_INTERPRET=1 (whose float32 -> bfloat16 cast truncates, where the
GPU rounds to nearest even: one more unit in the last place there)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.op_args import RowNorm  # noqa: E402
from kernels.rms_norm import rms_norm_ref  # noqa: E402
from kernels.row_norms import RowNormsArgs, row_norms  # noqa: E402
from kernels.row_norms_triton import row_norms_triton  # noqa: E402
from tests.kernels.test_rms_norm import DEV, close, pytestmark  # noqa: E402, F401 (RMSNorm's tolerances)


def rand(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale + shift).bfloat16().to(DEV)


@pytest.mark.parametrize("N", [1, 3])
def test_dsa_layer_norms_in_one_launch(N: int) -> None:
    """q_a [N, Q] and c [N, R] RMS-normed, the indexer key [N, Di] layer-normed (with bias, off-centre
    rows), all three column slices of one fused product; c's norm written into the latent line."""
    g = torch.Generator().manual_seed(N)
    Q, R, Dr, Di = 96, 40, 8, 20
    fused = rand(g, N, Q + R + Dr + Di, scale=3.0, shift=0.5)
    q_a, c, k = fused[:, :Q], fused[:, Q : Q + R], fused[:, Q + R + Dr :]
    w_q, w_c = rand(g, Q, shift=1.0), rand(g, R, shift=1.0)
    w_k, b_k = rand(g, Di, shift=1.0), rand(g, Di, scale=0.3)
    latent = torch.full((N, R + Dr), 7.0, dtype=torch.bfloat16, device=DEV)
    norms = [
        RowNorm(q_a, w_q, 1e-6),
        RowNorm(c, w_c, 1e-6, out=latent[:, :R]),
        RowNorm(k, w_k, 1e-6, b_k, is_layer_norm=True),
    ]
    q_resid, c_normed, k_normed = row_norms_triton(norms)
    close(q_resid, rms_norm_ref(q_a, w_q, 1e-6)[0])
    close(c_normed, rms_norm_ref(c, w_c, 1e-6)[0])
    assert c_normed.data_ptr() == latent.data_ptr() and torch.all(latent[:, R:] == 7.0)
    close(k_normed, F.layer_norm(k, (Di,), w_k, b_k, 1e-6))
    # the op's entry: the same outputs (the references on the CPU, the kernel on CUDA)
    for a, b in zip(row_norms(RowNormsArgs(tuple(norms))), (q_resid, c_normed, k_normed), strict=True):
        close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_layer_norm", [False, True])
def test_one_norm_matches_its_reference(dtype: torch.dtype, is_layer_norm: bool) -> None:
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 100, generator=g) * 4 + 1).to(dtype).to(DEV)
    w = (torch.rand(100, generator=g) + 0.5).to(dtype).to(DEV)
    b = torch.randn(100, generator=g).to(dtype).to(DEV)
    (out,) = row_norms_triton([RowNorm(x, w, 1e-5, b if is_layer_norm else None, is_layer_norm)])
    ref = F.layer_norm(x, (100,), w, b, 1e-5) if is_layer_norm else rms_norm_ref(x, w, 1e-5)[0]
    assert out.dtype == ref.dtype
    close(out, ref)


def test_mtp_input_norms_with_the_embedding_lookup_in_the_launch() -> None:
    """An MTP depth's two input norms: norm 0 reads the embedding table's rows `ids` (a gather, in the
    same launch), norm 1 the hidden states; each writes its half of one [N, 2H] buffer. The gathered
    norm equals the norm of `F.embedding`'s rows, and the op's entry (the references on the CPU) too."""
    g = torch.Generator().manual_seed(3)
    V, H, N = 50, 96, 5
    table, hidden = rand(g, V, H, scale=2.0), rand(g, N, H)
    w_e, w_h = rand(g, H, shift=1.0), rand(g, H, shift=1.0)
    ids = torch.tensor([7, 0, 49, 7, 12], device=DEV)  # a repeat, the first and the last row
    both = torch.full((N, 2 * H), 5.0, dtype=torch.bfloat16, device=DEV)
    norms = [
        RowNorm(table, w_e, 1e-6, out=both[:, :H], rows=ids),
        RowNorm(hidden, w_h, 1e-6, out=both[:, H:]),
    ]
    e_normed, h_normed = row_norms_triton(norms)
    assert e_normed.data_ptr() == both.data_ptr() and e_normed.shape == (N, H)
    close(e_normed, rms_norm_ref(F.embedding(ids, table), w_e, 1e-6)[0])
    close(h_normed, rms_norm_ref(hidden, w_h, 1e-6)[0])
    assert torch.equal(e_normed[0], e_normed[3])
    (ref,) = row_norms(RowNormsArgs((RowNorm(table, w_e, 1e-6, rows=ids.int()),)))
    close(ref, e_normed)
    with pytest.raises(ValueError, match="rows must be"):
        row_norms_triton([RowNorm(table, w_e, 1e-6, rows=ids.float())])


def test_bad_arguments_raise() -> None:
    x = torch.randn(2, 8, device=DEV)
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="bias"):
        row_norms_triton([RowNorm(x, w, 1e-6, is_layer_norm=True)])
    with pytest.raises(ValueError, match="x must be"):
        row_norms_triton([RowNorm(x, w, 1e-6), RowNorm(torch.randn(3, 8, device=DEV), w, 1e-6)])
    with pytest.raises(ValueError, match="1 to 3"):
        row_norms_triton([RowNorm(x, w, 1e-6)] * 4)
