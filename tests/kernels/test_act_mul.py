"""SiLU(gate) · up in one Triton launch against `F.silu(gate) * up`: within a rounding of bf16 (the
kernel's exp is Triton's), exact in float32 up to the exp; gate and up as the two halves of one
[T, 2I] product (the gated MLP's views), widths past one block, and the op's entry falling back to
torch for other activations.

CPU CI runs the kernel under TRITON_INTERPRET=1 (whose float32 -> bfloat16 cast truncates, where the
GPU rounds to nearest even: one more unit in the last place there)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.act_mul import ActMulArgs, act_mul, act_mul_ref, weigh_by_route  # noqa: E402
from kernels.act_mul_triton import silu_mul_triton  # noqa: E402
from kernels.op_args import ExpertRoute  # noqa: E402
from tests.backend.engine.test_speculative import loaded  # noqa: E402

__all__ = ["loaded"]  # the fixture

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("T", "I"), [(1, 64), (3, 1000), (2, 2304)])
def test_matches_torch_on_the_halves_of_one_product(dtype: torch.dtype, T: int, I: int) -> None:
    g = torch.Generator().manual_seed(T * I)
    gate_up = (torch.randn(T, 2 * I, generator=g) * 4).to(dtype).to(DEV)
    gate, up = gate_up[:, :I], gate_up[:, I:]  # strided rows: the fused gate_up_proj's views
    out = silu_mul_triton(gate, up)
    ref = F.silu(gate) * up
    assert out.shape == (T, I) and out.dtype == dtype and out.is_contiguous()
    tol = {torch.bfloat16: 1.6e-2, torch.float32: 2e-6}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if dtype == torch.bfloat16 and DEV == "cuda":  # most are torch's to the bit (the interpreter truncates)
        assert (out == ref).float().mean() > 0.9


def test_the_entry_runs_the_kernel_on_cuda_and_torch_elsewhere() -> None:
    g = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(2, 2, 48, generator=g).bfloat16().to(DEV)).unbind(0)
    torch.testing.assert_close(
        act_mul(ActMulArgs(gate, up, F.silu)), F.silu(gate) * up, rtol=1.6e-2, atol=1.6e-2
    )
    gelu = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731  no kernel: the reference runs
    assert torch.equal(act_mul(ActMulArgs(gate, up, gelu)), act_mul_ref(gate, up, gelu))


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="unit stride"):
        silu_mul_triton(x.t(), x.t())
    with pytest.raises(ValueError, match="dtype"):
        silu_mul_triton(x, x.double())


def routed(
    N: int, El: int, K: int, e0: int, I: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, ExpertRoute]:
    """Expert-major gate and up rows [El·N, I] (views of one [El, N, 2I] product) and each token's k
    distinct experts among 0 … e0 + El + 2 (some another rank's)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(El, N, 2 * I, generator=g) * 4).bfloat16()
    ids = torch.stack([torch.randperm(e0 + El + 3, generator=g)[:K] for _ in range(N)])
    weights = torch.rand(N, K, generator=g)
    return gate_up[..., :I].reshape(-1, I), gate_up[..., I:].reshape(-1, I), ExpertRoute(ids, weights, e0)


def test_the_route_weighs_each_row_by_its_expert_for_its_token() -> None:
    """Row e·N + t is (act(gate) · up) rounded, times expert e0 + e's weight for token t in float32
    (0 where t did not choose it), rounded: the dense routing matrix's product, by hand."""
    gate, up, route = routed(N=3, El=4, K=2, e0=2, I=8, seed=1)
    route = ExpertRoute(torch.tensor([[2, 7], [5, 3], [0, 8]]), route.weights, 2)  # token 2: another rank's
    got = weigh_by_route(act_mul_ref(gate, up, F.silu), route)
    plain = act_mul_ref(gate, up, F.silu)
    for e in range(4):
        for t in range(3):
            chosen = (route.ids[t] == 2 + e).nonzero()
            w = float(route.weights[t, chosen[0, 0]]) if len(chosen) else 0.0
            want = (plain[e * 3 + t].float() * w).bfloat16()
            assert torch.equal(got[e * 3 + t], want), (e, t)
    assert (got.abs().sum(1) == 0).any() and (got.abs().sum(1) > 0).any()


@pytest.mark.parametrize(
    ("N", "El", "K", "e0", "I"), [(1, 8, 2, 0, 128), (3, 5, 3, 4, 1100), (4, 2, 1, 1, 64)]
)
def test_the_routed_kernel_is_the_reference(N: int, El: int, K: int, e0: int, I: int) -> None:
    gate, up, route = routed(N, El, K, e0, I, seed=N * El)
    want = weigh_by_route(act_mul_ref(gate, up, F.silu), route)
    on = ExpertRoute(route.ids.to(DEV), route.weights.to(DEV), e0)
    got = silu_mul_triton(gate.to(DEV), up.to(DEV), on)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # two roundings, each a unit of bf16 (the interpreter truncates both), and Triton's exp
    torch.testing.assert_close(got.cpu(), want, rtol=3.2e-2, atol=1.6e-2)
    assert torch.equal(got.cpu() == 0, want == 0)  # the same rows weigh 0
    if DEV == "cuda":  # most are torch's to the bit (the interpreter truncates)
        assert (got.cpu() == want).float().mean() > 0.9
    torch.testing.assert_close(
        act_mul(ActMulArgs(gate.to(DEV), up.to(DEV), F.silu, on)).cpu(), want, rtol=1.6e-2, atol=1.6e-2
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_the_every_expert_path_with_the_kernel_sums_what_the_loop_does(
    loaded: dict[str, Any], sharded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Experts.forward_every_expert` with the routed kernel in place of the reference (the CUDA
    branch, under the interpreter): the loop's sum over the chosen experts; holding some experts
    (`sharded`: ids >= E stand for another rank's), theirs drop out."""
    from backend.models.layers import moe
    from tests.backend.engine.test_decode_graphs import routed_tokens

    def kernel(args: ActMulArgs) -> torch.Tensor:
        return silu_mul_triton(args.gate, args.up, args.route)

    experts, x, weights, ids = routed_tokens(loaded["deepseek_v3"].model, sharded, seed=3)
    want = experts(x, weights, ids)  # the loop over the experts in use
    monkeypatch.setattr(moe, "act_mul", kernel)
    got = experts.forward_every_expert(x, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[2].abs().max() == 0) == sharded and got[0].abs().max() > 0


def test_a_route_of_no_token_and_a_bad_one() -> None:
    """No token: an empty product (the reference once failed to reshape it); ids not unit-strided in
    k are refused rather than read wrong."""
    gate, up, route = routed(N=2, El=3, K=2, e0=0, I=16, seed=4)
    empty = ExpertRoute(route.ids[:0], route.weights[:0], 0)
    assert weigh_by_route(act_mul_ref(gate[:0], up[:0], F.silu), empty).shape == (0, 16)
    assert silu_mul_triton(
        gate[:0].to(DEV), up[:0].to(DEV), ExpertRoute(empty.ids.to(DEV), empty.weights.to(DEV), 0)
    ).shape == (0, 16)
    strided = ExpertRoute(route.ids.t().contiguous().t().to(DEV), route.weights.to(DEV), 0)
    with pytest.raises(ValueError, match="unit stride in k"):
        silu_mul_triton(gate.to(DEV), up.to(DEV), strided)
