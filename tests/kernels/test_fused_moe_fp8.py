"""Fused FP8 MoE (kernels/fused_moe_fp8.py) against its pure-torch reference (FP8 dequantized with its
scales to fp32, SiLU-gated MLP, weighted sum), and against the CPU loop of the layer that calls it
(`backend.quant.experts.QuantExperts`, whose dequantizers come from kernels/formats/fp8.py).

CPU CI runs the kernels under TRITON_INTERPRET=1 (fp32/fp16 activations: bf16 `tl.dot` is broken in
the interpreter). The weights are e4m3 bytes made by torch's cast, so the kernel reads exactly what
the reference dequantizes; the kernel's only e4m3 step is the upcast (exact), so the interpreter's
fp32 -> e4m3 rounding bug (docs/README.md) cannot touch these tests. Shapes: E = 8 experts (6, 7
never routed), k = 2, H = 80 and I = 48 (neither a multiple of the 32-wide K tile), block scales
16 × 32 (non-square, so a swapped index fails; edge blocks partial in both directions), ids -1 and E
(another rank's experts) in some slots, one token with no local expert at all. Every float buffer the
launcher allocates is filled with NaN first (`poisoned`): a row it forgets to write shows.

Tolerances (relative Frobenius): fp32 1e-5 (fp32 accumulation, ieee dots); fp16 3e-3 (act and y
rounded to fp16 once each, ~2^-11); bf16 1.5e-2 (the same at 2^-8), as for the INT4 kernel.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402

from backend.quant.experts import QuantExperts  # noqa: E402
from backend.quant.scheme import QuantScheme  # noqa: E402
from kernels.fused_moe_fp8 import FP8, fused_moe_fp8, fused_moe_fp8_ref  # noqa: E402
from kernels.moe_routing import MoEConfig  # noqa: E402
from tests.kernels.sm90_compile import compiled_lines  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

E, H, I, TOP_K = 8, 80, 48, 2
BLOCK = (16, 32)  # (rows, K) per scale
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
GEMV = MoEConfig(block_m=0, block_n=32, block_k=32, split_k=1)
GEMV_SPLIT = MoEConfig(block_m=0, block_n=32, block_k=32, split_k=3)  # I: 2 K tiles, so one split is empty
TILES = MoEConfig(block_m=16, block_n=32, block_k=32)
TILES_WIDE_K = MoEConfig(block_m=16, block_n=32, block_k=64)  # block scales clamp BK to 32
FP8Experts = tuple[torch.Tensor, ...]  # w13, w2, gate_scale, up_scale, down_scale


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fp8_codes(shape: tuple[int, ...], gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """e4m3 weights spread over the format's range (|w| up to 440), no NaN bytes."""
    return (torch.randn(shape, generator=gen, device=device) * 64).clamp(-440, 440).to(FP8)


def make_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    block: tuple[int, int] | None,
    gen: torch.Generator,
    device: str = "cpu",
) -> FP8Experts:
    """Weights and fp32 scales sized so that h and y stay O(1) (scale ~ 1 / (64 · sqrt(K)))."""
    w13 = fp8_codes((num_experts, 2 * inter, hidden), gen, device)
    w2 = fp8_codes((num_experts, hidden, inter), gen, device)

    def scales(n: int, k: int) -> torch.Tensor:
        shape = (num_experts, n, 1) if block is None else (num_experts, -(-n // block[0]), -(-k // block[1]))
        return (torch.rand(shape, generator=gen, device=device) + 0.5) / (64 * k**0.5)

    return w13, w2, scales(inter, hidden), scales(inter, hidden), scales(hidden, inter)


def routing(M: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts among the first 6 (6, 7 unused); slot 1 of every third token another rank's
    (-1 or E); token 1 (when there is one) has no local expert at all."""
    ids = torch.stack([torch.randperm(6, generator=gen)[:TOP_K] for _ in range(M)])
    ids[::3, 1] = torch.where(torch.arange(0, M, 3) % 2 == 0, -1, E)
    if M > 1:
        ids[1] = torch.tensor([E, -1])
    return ids, torch.rand(M, TOP_K, generator=gen) + 0.1


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Every float `torch.empty` inside comes back NaN-filled (the launcher's act, y and workspaces)."""
    empty = torch.empty

    def nan_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)  # type: ignore[call-overload]
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = empty


def _to(ex: FP8Experts, device: str) -> FP8Experts:
    return tuple(t.to(device) for t in ex)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize(
    ("M", "config", "dtype"),
    [
        (1, None, torch.float32),  # the launcher's own pick: GEMV, split K
        (3, GEMV_SPLIT, torch.float16),
        (3, GEMV, torch.float32),
        (17, TILES, torch.float32),
        (17, TILES_WIDE_K, torch.float16),
    ],
)
def test_kernel_matches_reference(
    block: tuple[int, int] | None, M: int, config: MoEConfig | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(M)
    ex = make_experts(E, H, I, block, gen)
    x = torch.randn(M, H, generator=gen).to(dtype)
    ids, wts = routing(M, gen)
    want = fused_moe_fp8_ref(x.float(), ids, wts, *ex, block=block)
    with poisoned():
        got = fused_moe_fp8(x.to(DEV), ids.to(DEV), wts.to(DEV), *_to(ex, DEV), block=block, config=config)
    assert got.dtype == dtype and got.shape == (M, H)
    assert not got.isnan().any()
    assert rel_err(got.cpu(), want) < TOL[dtype]
    if M > 1:  # no local expert: exactly nothing
        assert torch.equal(got[1].cpu(), torch.zeros(H, dtype=dtype))


def _layer(method: str, e0: int, e1: int, gen: torch.Generator) -> QuantExperts:
    """A QuantExperts of `method` holding random experts e0..e1-1, filled through its buffers."""
    scheme = QuantScheme(method=method, block=BLOCK)  # type: ignore[arg-type]
    layer = QuantExperts(scheme, e0=e0, e1=e1, hidden=H, intermediate=I, act=F.silu)
    w13, w2, gs, us, ds = make_experts(e1 - e0, H, I, None if method == "fp8-channel" else BLOCK, gen)
    layer.gate_up_proj.copy_(w13)
    layer.down_proj.copy_(w2)
    if method == "fp8-channel":
        layer.gate_up_scale.copy_(torch.cat([gs, us], dim=1))
        layer.down_scale.copy_(ds)
    else:
        layer.gate_scale_inv.copy_(gs)
        layer.up_scale_inv.copy_(us)
        layer.down_scale_inv.copy_(ds)
    return layer


@pytest.mark.parametrize("method", ["fp8-channel", "fp8-block"])
def test_layer_kernel_matches_its_cpu_loop(method: str) -> None:
    """The layer's fused call (under the interpreter on the CPU, else on the GPU) against its own dequantize-and-loop path,
    on rank experts 2..9 of 12: the scale formats are read as the loader stored them."""
    gen = torch.Generator().manual_seed(11)
    layer = _layer(method, 2, 10, gen)
    assert layer._can_fuse()
    x = torch.randn(5, H, generator=gen)
    ids = torch.rand(5, 12, generator=gen).topk(3, dim=-1).indices
    wts = torch.rand(5, 3, generator=gen)
    want = layer(x, wts, ids)  # CPU: the loop
    layer.to(DEV)  # the fused call where the kernels run: the interpreter on the CPU, else the GPU
    with poisoned():
        got = layer._fused(x.to(DEV), wts.to(DEV), (ids - 2).to(DEV))
    assert rel_err(got.cpu(), want) < TOL[torch.float32]
    add = torch.randn(5, H, generator=gen)  # the shared experts' output: both paths add it as torch does
    assert torch.equal(
        layer._fused(x.to(DEV), wts.to(DEV), (ids - 2).to(DEV), add.to(DEV)), got + add.to(DEV)
    )
    assert torch.equal(layer.cpu()(x, wts, ids, add=add), want + add)


def test_layer_fuses_fp8_with_silu_and_power_of_two_k_blocks() -> None:
    silu = {"act": F.silu, "e0": 0, "e1": 2, "hidden": H, "intermediate": I}
    assert QuantExperts(QuantScheme(method="fp8-channel"), **silu)._can_fuse()  # type: ignore[arg-type]
    assert QuantExperts(QuantScheme(method="fp8-block"), **silu)._can_fuse()  # type: ignore[arg-type]
    assert not QuantExperts(QuantScheme(method="fp8-block", block=(128, 96)), **silu)._can_fuse()  # type: ignore[arg-type]
    gelu = {**silu, "act": F.gelu}
    assert not QuantExperts(QuantScheme(method="fp8-channel"), **gelu)._can_fuse()  # type: ignore[arg-type]


def test_launcher_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    w13, w2, gs, us, ds = make_experts(E, H, I, BLOCK, gen)
    x = torch.randn(2, H, generator=gen)
    ids, wts = routing(2, gen)
    with pytest.raises(ValueError, match="w13 must be"):
        fused_moe_fp8(x, ids, wts, w13.float(), w2, gs, us, ds, block=BLOCK)
    with pytest.raises(ValueError, match="down_scale must be"):
        fused_moe_fp8(x, ids, wts, w13, w2, gs, us, ds[:, :1], block=BLOCK)
    with pytest.raises(ValueError, match="gate_scale must be"):
        fused_moe_fp8(x, ids, wts, w13, w2, gs, us, ds, block=None)  # block scales read as channel ones
    with pytest.raises(ValueError, match="power-of-two"):
        fused_moe_fp8(x, ids, wts, w13, w2, gs[:, :, :2], us[:, :, :2], ds, block=(16, 48))
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_fp8(x, ids[:1], wts, w13, w2, gs, us, ds, block=BLOCK)
    with pytest.raises(TypeError, match="x must be"):
        fused_moe_fp8(x.to(torch.int32), ids, wts, w13, w2, gs, us, ds, block=BLOCK)


def test_kernels_compile_for_sm90() -> None:
    """The FP8 kernels (both scale formats, decode and tile paths) compile for the H200 (Triton +
    ptxas, no GPU; a process without TRITON_INTERPRET) with the launchers' default tiles; none spills."""
    lines = compiled_lines("tests.kernels.sm90_compile_fused_moe")
    assert len(lines) == 8 and all(" 0 bytes spill stores" in line for line in lines), lines


# --- device: the expert shapes, bf16 ----------------------------------------------------

SHAPES = {  # experts, hidden, expert intermediate; top-8 each
    "kimi-k2": (384, 7168, 2048),
    "glm-5": (256, 6144, 2048),
    "glm-4.5-air": (128, 4096, 1408),
}


@functools.lru_cache(maxsize=1)
def device_experts(num_experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """Random e4m3 experts on the GPU (Kimi: 16.9 GB, kept for the next test of that shape) with both
    scale formats: (w13, w2, channel gate, up, down, block gate, up, down)."""
    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=FP8, device="cuda")
    w2 = torch.empty(num_experts, hidden, inter, dtype=FP8, device="cuda")
    for e in range(num_experts):  # one expert at a time: the fp32 draws of all would not fit
        w13[e] = fp8_codes((2 * inter, hidden), gen, "cuda")
        w2[e] = fp8_codes((hidden, inter), gen, "cuda")
    scales: list[torch.Tensor] = []
    for block in (None, (128, 128)):
        for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
            shape = (num_experts, n, 1) if block is None else (num_experts, -(-n // 128), -(-k // 128))
            scales.append((torch.rand(shape, generator=gen, device="cuda") + 0.5) / (64 * k**0.5))
    return (w13, w2, *scales)


def device_weights(name: str, block: tuple[int, int] | None) -> FP8Experts:
    t = device_experts(*SHAPES[name])
    return (t[0], t[1], *(t[2:5] if block is None else t[5:8]))


def device_routing(M: int, num_experts: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, hidden, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(M, num_experts, device="cuda", generator=gen).topk(8, dim=-1).indices
    return x, ids, torch.rand(M, 8, device="cuda", generator=gen) + 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shapes_bf16(name: str, M: int, block: tuple[int, int] | None) -> None:
    """The launcher's pick plus a GEMV and a tile variant, bf16, poisoned buffers; bit-identical reruns."""
    weights = device_weights(name, block)
    x, ids, wts = device_routing(M, SHAPES[name][0], SHAPES[name][1], seed=M)
    want = fused_moe_fp8_ref(x.float(), ids, wts, *weights, block=block)
    for cfg in (None, MoEConfig(0, 32, 128, split_k=4), MoEConfig(16, 64, 128, num_stages=4)):
        with poisoned():
            got = fused_moe_fp8(x, ids, wts, *weights, block=block, config=cfg)
        assert not got.isnan().any(), cfg
        assert rel_err(got, want) < TOL[torch.bfloat16], cfg
        assert torch.equal(fused_moe_fp8(x, ids, wts, *weights, block=block, config=cfg), got), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("M", [1, 64])
def test_cuda_graph_replay(M: int, block: tuple[int, int] | None) -> None:
    """No host sync (sync debug mode "error" on the eager call): captured once, replayed on new inputs,
    equal to an eager call on them."""
    weights = device_weights("kimi-k2", block)
    x, ids, wts = device_routing(M, 384, 7168, seed=1)
    fused_moe_fp8(x, ids, wts, *weights, block=block)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe_fp8(x, ids, wts, *weights, block=block)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_fp8(x, ids, wts, *weights, block=block)
    x2, ids2, wts2 = device_routing(M, 384, 7168, seed=2)
    x.copy_(x2)
    ids.copy_(ids2)
    wts.copy_(wts2)
    graph.replay()
    assert torch.equal(out, fused_moe_fp8(x2, ids2, wts2, *weights, block=block))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fp8-channel", "fp8-block"])
def test_layer_on_cuda_matches_its_cpu_loop(method: str) -> None:
    """QuantExperts dispatches FP8 experts to the fused kernel on CUDA; its CPU loop is the reference."""
    gen = torch.Generator().manual_seed(9)
    layer = _layer(method, 2, 10, gen)
    x = torch.randn(33, H, generator=gen)
    ids = torch.rand(33, 12, generator=gen).topk(3, dim=-1).indices
    wts = torch.rand(33, 3, generator=gen)
    want = layer(x, wts, ids)
    got = layer.cuda()(x.cuda(), wts.cuda(), ids.cuda())
    assert rel_err(got.cpu(), want) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fp8-channel", "fp8-block"])
def test_layer_is_capture_safe_on_cuda(method: str) -> None:
    """What decode graphs need of the layer: inside `sync_free()` with sync debug mode "error" it runs
    (no host sync) and a graph of it replays; a layer with no fused kernel (GELU) raises, naming its scheme."""
    from backend.engine.sync_free import sync_free

    gen = torch.Generator().manual_seed(10)
    layer = _layer(method, 0, 8, gen).cuda()
    x = torch.randn(4, H, generator=gen).cuda()
    ids = torch.rand(4, 8, generator=gen).topk(2, dim=-1).indices.cuda()
    wts = torch.rand(4, 2, generator=gen).cuda()
    want = layer(x, wts, ids)
    torch.cuda.synchronize()
    with sync_free():
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = layer(x, wts, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want)  # outside: torch.equal itself syncs
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, wts, ids)
        graph.replay()
        assert torch.equal(out, want)
        layer.act = F.gelu
        with pytest.raises(RuntimeError, match=f"{method} experts .* no fused kernel"):
            layer(x, wts, ids)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize(("M", "config"), [(3, GEMV), (3, GEMV_SPLIT), (17, TILES)])
def test_add_is_torchs_add_of_the_routed_sum(
    block: tuple[int, int] | None, M: int, config: MoEConfig
) -> None:
    """`add` (the shared experts' output) comes out as torch's `routed + add`, byte for byte: in the
    GEMV's down epilogue after the sum is rounded (token 1, no local expert, gets `add` alone), after
    the tiles by torch."""
    gen = torch.Generator().manual_seed(M + 40)
    ex = _to(make_experts(E, H, I, block, gen), DEV)
    x = torch.randn(M, H, generator=gen).half().to(DEV)
    ids, wts = (t.to(DEV) for t in routing(M, gen))
    add = (torch.randn(M, H, generator=gen) * 0.05).half().to(DEV)
    routed = fused_moe_fp8(x, ids, wts, *ex, block=block, config=config)
    with poisoned():
        got = fused_moe_fp8(x, ids, wts, *ex, block=block, config=config, add=add)
    assert torch.equal(got, routed + add) and torch.equal(got[1], add[1])
