"""Fused INT4 MoE against two independent computations: a float64 per-token loop over the unpacked
words, and the CPU MoE layer's own expert computation (`backend.quant.experts.QuantExperts`).

CPU CI runs the Triton kernels under TRITON_INTERPRET=1 on tiny shapes (fp16/fp32 activations: bf16
tl.dot is broken in the interpreter): E = 8 experts, k = 2, H = 96 (K not a multiple of BLOCK_K),
I = 64, group 32, experts 6 and 7 never routed. The `gpu` tests run bf16 on Kimi K2's expert shapes.
Tolerances are relative Frobenius errors: fp32 1e-5 (ieee dots, fp32 accumulation); fp16 3e-3 (act
and y rounded to fp16 once each, ~2^-11 each); bf16 1.5e-2 (the same two roundings at 2^-8).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402

from backend.quant.experts import QuantExperts  # noqa: E402
from backend.quant.scheme import QuantScheme  # noqa: E402
from kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref, moe_align, pick_moe_config  # noqa: E402
from kernels.moe_align import moe_align_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

E, H, I, G, TOP_K = 8, 96, 64, 32, 2
ExpertTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, s13, w2, s2
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
GEMV = MoEConfig(block_m=0, block_n=64, block_k=64)
TILES = MoEConfig(block_m=16, block_n=32, block_k=64)
GROUPED = MoEConfig(block_m=4, block_n=32, block_k=64, lift=True, grouped=True)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., K] int8 in [-8, 7] -> [..., K/8] int32, nibble j of word i = q[8i + j] + 8 (the
    compressed-tensors layout; checked against its packer in test_w4a16_gemm.py)."""
    nib = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], -1, 8)
    words = (nib << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Experts:
    """Random INT4 experts in the published layout, plus their integer grid for the float64 check."""

    def __init__(self, num_experts: int, hidden: int, inter: int, gen: torch.Generator) -> None:
        self.q13 = torch.randint(-8, 8, (num_experts, 2 * inter, hidden), generator=gen, dtype=torch.int8)
        self.q2 = torch.randint(-8, 8, (num_experts, hidden, inter), generator=gen, dtype=torch.int8)
        self.w13, self.w2 = pack_int4(self.q13), pack_int4(self.q2)
        self.s13 = (torch.rand(num_experts, 2 * inter, hidden // G, generator=gen) * 0.02 + 0.005).bfloat16()
        self.s2 = (torch.rand(num_experts, hidden, inter // G, generator=gen) * 0.02 + 0.005).bfloat16()

    def tensors(self, device: str = DEV) -> ExpertTensors:
        return self.w13.to(device), self.s13.to(device), self.w2.to(device), self.s2.to(device)


def routing(M: int, gen: torch.Generator, num_used: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token among the first `num_used` (the rest unused); weights in (0.1, 1.1)."""
    ids = torch.stack([torch.randperm(num_used, generator=gen)[:TOP_K] for _ in range(M)])
    return ids, torch.rand(M, TOP_K, generator=gen) + 0.1


def float64_moe(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, ex: Experts) -> torch.Tensor:
    """Token by token, slot by slot, in float64 from the integer grid."""
    inter = ex.q13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < ex.q13.shape[0]:
                continue
            gu = ex.q13[e].double() * ex.s13[e].double().repeat_interleave(G, dim=1)
            down = ex.q2[e].double() * ex.s2[e].double().repeat_interleave(G, dim=1)
            h = gu @ x[t].double()
            out[t] += wts[t, j].double() * (down @ (F.silu(h[:inter]) * h[inter:]))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def test_align_groups_pairs_by_expert() -> None:
    gen = torch.Generator().manual_seed(0)
    ids, _ = routing(13, gen)
    ids[3, 1] = -1  # another rank's experts (local ids outside [0, E))
    ids[7, 0] = E
    BM = 4
    sorted_ids, block_expert, num_padded = (t.cpu() for t in moe_align(ids.to(DEV), E, BM))
    P = ids.numel()
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < P]
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    assert int(num_padded) % BM == 0 and int(num_padded) <= sorted_ids.numel()
    assert bool((sorted_ids[int(num_padded) :] == P).all())
    for b in range(int(num_padded) // BM):
        pairs = sorted_ids[b * BM : (b + 1) * BM]
        pairs = pairs[pairs < P]
        assert pairs.numel() > 0  # no block is all padding
        e = int(block_expert[b])
        want = {e} if e >= 0 else {-1, E}
        assert set(flat[pairs.long()].tolist()) <= want
        assert pairs.tolist() == sorted(pairs.tolist())  # token order within an expert
    assert set(block_expert[: int(num_padded) // BM].tolist()) == {0, 1, 2, 3, 4, 5, -1}  # 6, 7 unused


@pytest.mark.gpu
def test_align_compiles_two_variants_whatever_the_token_count() -> None:
    """The warm-up (`backend/server/warmup.py`) cannot reach every token count, so nothing the
    kernel compiles may depend on one beyond `align_chunk`'s two sizes: every (tokens, BM) here,
    views at odd offsets included, shares two compiled variants."""
    from kernels.moe_align import _moe_align_kernel

    dev = torch.cuda.current_device()
    _moe_align_kernel.device_caches[dev][0].clear()  # other tests' variants (int32 ids) aside
    for M in (1, 3, 16, 17, 100, 129, 700, 1000, 2047):
        for BM in (1, 16, 32, 64):
            ids = torch.randint(-1, 386, (M + 1, 8), device="cuda")[1:]  # a view at an odd offset
            moe_align(ids, 384, BM)
    assert len(_moe_align_kernel.device_caches[dev][0]) == 2


@pytest.mark.parametrize(
    ("M", "k", "num_experts", "BM", "dtype"),
    [
        (1, 8, 384, 16, torch.int64),  # Kimi decode: 8 pairs, 385 buckets
        (3, 2, 8, 1, torch.int32),  # BM 1: no padding at all
        (64, 8, 384, 16, torch.int64),
        (150, 8, 16, 64, torch.int32),  # 1200 pairs: two chunks of the sort, many blocks per expert
        (7, 3, 5, 4, torch.int64),
        (16, 8, 8, 16, torch.int64),  # 128 pairs: the small chunk's last size
        (17, 8, 8, 16, torch.int64),  # 136 pairs: the first on the large chunk
        (300, 8, 16, 32, torch.int64),  # 2400 pairs: three chunks, the last partial
    ],
)
def test_align_kernel_equals_torch_reference(
    M: int, k: int, num_experts: int, BM: int, dtype: torch.dtype
) -> None:
    """The one-launch kernel returns exactly the torch formulation's blocks (stable, padded, -1s)."""
    gen = torch.Generator().manual_seed(M * k + BM)
    ids = torch.stack([torch.randperm(num_experts + 2, generator=gen)[:k] - 1 for _ in range(M)]).to(dtype)
    got = moe_align(ids.to(DEV), num_experts, BM)  # ids -1 and E: another rank's
    want = moe_align_ref(ids, num_experts, BM)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


def test_reference_matches_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    ex = Experts(E, H, I, gen)
    x = torch.randn(9, H, generator=gen)
    ids, wts = routing(9, gen)
    ref = fused_moe_ref(x, ids, wts, ex.w13, ex.s13, ex.w2, ex.s2, G)
    assert rel_err(ref, float64_moe(x, ids, wts, ex)) < 1e-6


F16, F32 = torch.float16, torch.float32
CASES = [  # M, config (None: the launcher's choice, the GEMV when P <= E), dtype
    (1, None, F16),
    (1, None, F32),
    (1, TILES, F16),  # one block per expert, 15 of 16 rows padding
    (3, None, F32),
    (1, MoEConfig(block_m=0, block_n=32, block_k=32, split_k=2), F32),  # split K: 3 and 2 tiles, uneven
    (3, MoEConfig(block_m=0, block_n=64, block_k=32, split_k=4), F16),  # splits with no K tile at all
    (3, TILES, F16),
    (17, None, F16),
    (17, None, F32),
    (64, None, F16),
    (64, MoEConfig(block_m=32, block_n=64, block_k=32), F32),  # BLOCK_K == group, N tile wider than I
    (17, GROUPED, F32),  # blocks of 4 pairs of one expert, one unpacking for all
    (5, MoEConfig(block_m=2, block_n=32, block_k=64, split_k=2, lift=True, grouped=True), F16),
    # the pipelined K loop (`loop_stages`): all of K (3 tiles, 2 for down) in one split, uneven splits,
    # splits with no K tile
    (1, MoEConfig(block_m=0, block_n=32, block_k=32, split_k=1, loop_stages=3), F32),
    (3, MoEConfig(block_m=0, block_n=64, block_k=32, split_k=2, loop_stages=4, lift=True), F16),
    (3, MoEConfig(block_m=0, block_n=64, block_k=32, split_k=4, loop_stages=2), F16),
    (17, MoEConfig(block_m=4, block_n=32, block_k=32, lift=True, grouped=True, loop_stages=3), F32),
    # one pair a program in expert order (blocks of one pair): plain and pipelined
    (17, MoEConfig(block_m=1, block_n=64, block_k=64, lift=True, grouped=True), F16),
    (9, MoEConfig(block_m=1, block_n=32, block_k=32, split_k=2, lift=True, grouped=True, loop_stages=3), F32),
]


@pytest.mark.parametrize(("M", "config", "dtype"), CASES)
def test_kernel_matches_float64(M: int, config: MoEConfig | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(100 + M)
    ex = Experts(E, H, I, gen)
    x = torch.randn(M, H, generator=gen)
    ids, wts = routing(M, gen)
    out = fused_moe(x.to(dtype).to(DEV), ids.to(DEV), wts.to(DEV), *ex.tensors(), G, config=config)
    assert out.dtype == dtype and out.shape == (M, H)
    assert rel_err(out, float64_moe(x.to(dtype), ids, wts, ex)) < TOL[dtype]
    if M == 1 and config is None:
        assert pick_moe_config(M * TOP_K, E).block_m == 0  # the decode path was the one tested


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        (GEMV, F32),
        (MoEConfig(block_m=0, block_n=64, block_k=32, split_k=2), F16),
        (TILES, F16),
        (GROUPED, F32),
    ],
)
def test_matches_cpu_moe_layer(config: MoEConfig, dtype: torch.dtype) -> None:
    """The layer's experts and the kernel on the same weights, sharded: this rank holds experts 2..4,
    so local ids fall below 0 (experts 0, 1) and at or above El (expert 5): those pairs add nothing."""
    gen = torch.Generator().manual_seed(7)
    ex = Experts(E, H, I, gen)
    e0, e1 = 2, 5
    layer = QuantExperts(
        QuantScheme(method="int4", group_size=G), e0=e0, e1=e1, hidden=H, intermediate=I, act=F.silu
    )
    layer.gate_up_packed.copy_(ex.w13[e0:e1])
    layer.gate_up_scale.copy_(ex.s13[e0:e1])
    layer.down_packed.copy_(ex.w2[e0:e1])
    layer.down_scale.copy_(ex.s2[e0:e1])
    M = 5
    x = torch.randn(M, H, generator=gen).to(dtype)
    ids, wts = routing(M, gen)
    assert bool((ids < e0).any() and (ids >= e1).any())
    want = layer(x, wts, ids)
    local = (ids - e0).to(DEV)
    w13, s13, w2, s2 = (t[e0:e1] for t in ex.tensors())
    out = fused_moe(x.to(DEV), local, wts.to(DEV), w13, s13, w2, s2, G, config=config)
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("config", [GEMV, TILES])
def test_dropped_expert_contributes_nothing(config: MoEConfig) -> None:
    """A slot with weight 0 (here on an expert with large scales) leaves each token's sum bit-identical."""
    gen = torch.Generator().manual_seed(11)
    ex = Experts(E, H, I, gen)
    ex.s13[5] = 0.25  # ~20× the others, still finite in fp16
    ex.s2[5] = 0.25
    M = 3
    x = torch.randn(M, H, generator=gen).to(torch.float16)
    ids = torch.tensor([[0, 5], [1, 5], [5, 2]])
    wts = torch.tensor([[0.7, 0.0], [0.4, 0.0], [0.0, 0.9]])
    out = fused_moe(x.to(DEV), ids.to(DEV), wts.to(DEV), *ex.tensors(), G, config=config)
    keep = torch.tensor([0, 0, 1])
    alone = fused_moe(
        x.to(DEV),
        ids.gather(1, keep[:, None]).to(DEV),
        wts.gather(1, keep[:, None]).to(DEV),
        *ex.tensors(),
        G,
        config=config,
    )
    assert torch.equal(out, alone)


@pytest.mark.parametrize(
    "config", [GEMV, MoEConfig(block_m=0, block_n=64, block_k=32, split_k=3), TILES, GROUPED]
)
def test_deterministic(config: MoEConfig) -> None:
    gen = torch.Generator().manual_seed(5)
    ex = Experts(E, H, I, gen)
    x = torch.randn(3, H, generator=gen).to(torch.float16).to(DEV)
    ids, wts = routing(3, gen)
    ids, wts = ids.to(DEV), wts.to(DEV)
    first = fused_moe(x, ids, wts, *ex.tensors(), G, config=config)
    assert all(torch.equal(fused_moe(x, ids, wts, *ex.tensors(), G, config=config), first) for _ in range(2))


def test_launcher_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    ex = Experts(E, H, I, gen)
    x = torch.randn(2, H, generator=gen)
    ids, wts = routing(2, gen)
    w13, s13, w2, s2 = ex.tensors("cpu")
    with pytest.raises(ValueError, match="w2 packed"):
        fused_moe(x, ids, wts, w13, s13, w2[:, :, :-1], s2, G)
    with pytest.raises(ValueError, match="scales"):
        fused_moe(x, ids, wts, w13, s13[:, :, :1], w2, s2, G)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, ids[:1], wts, w13, s13, w2, s2, G)
    with pytest.raises(TypeError, match="x must be"):
        fused_moe(x.to(torch.int32), ids, wts, w13, s13, w2, s2, G)


# --- device: the expert shapes, bf16 ----------------------------------------------------

KIMI = (384, 7168, 2048)  # experts, hidden, expert intermediate (top-8, group 32)
GLM_AIR = (128, 4096, 1408)


@functools.lru_cache(maxsize=1)
def device_experts(num_experts: int, hidden: int, inter: int) -> ExpertTensors:
    """Random words and bf16 scales on the GPU (Kimi: 9.5 GB, kept for the next test of that shape)."""
    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    lo, hi = -(2**31), 2**31 - 1
    w13 = torch.randint(
        lo, hi, (num_experts, 2 * inter, hidden // 8), generator=gen, dtype=torch.int32, device="cuda"
    )
    w2 = torch.randint(
        lo, hi, (num_experts, hidden, inter // 8), generator=gen, dtype=torch.int32, device="cuda"
    )
    s13 = torch.rand(num_experts, 2 * inter, hidden // G, device="cuda", generator=gen) * 0.004 + 0.001
    s2 = torch.rand(num_experts, hidden, inter // G, device="cuda", generator=gen) * 0.004 + 0.001
    return w13, s13.bfloat16(), w2, s2.bfloat16()


def device_routing(
    M: int, num_experts: int, hidden: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(M, num_experts, device="cuda").topk(8, dim=-1).indices
    return x, ids, torch.rand(M, 8, device="cuda") + 0.1


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "M"), [(KIMI, 1), (KIMI, 8), (KIMI, 64), (KIMI, 512), (GLM_AIR, 1), (GLM_AIR, 64)]
)
def test_real_shapes_bf16(shape: tuple[int, int, int], M: int) -> None:
    """Every path the launcher picks, plus a GEMV and a tile variant, on real sizes; bit-identical reruns."""
    weights = device_experts(*shape)
    x, ids, wts = device_routing(M, shape[0], shape[1], seed=M)
    ref = fused_moe_ref(x.float(), ids, wts, *weights, G)
    for cfg in (
        None,
        MoEConfig(0, 32, 256, split_k=1),
        MoEConfig(0, 32, 128, split_k=4),
        MoEConfig(0, 64, 256, lift=True),
        MoEConfig(0, 64, 256, programs_per_sm=4, loop_stages=3),
        MoEConfig(0, 128, 256, programs_per_sm=2, loop_stages=4, lift=True),
        MoEConfig(2, 32, 256, lift=True, grouped=True),
        MoEConfig(2, 32, 256, lift=True, grouped=True, loop_stages=3),
        MoEConfig(1, 64, 256, lift=True, grouped=True, loop_stages=3, programs_per_sm=4),
        MoEConfig(16, 64, 128),
    ):
        out = fused_moe(x, ids, wts, *weights, G, config=cfg)
        assert not out.isnan().any()
        assert rel_err(out, ref) < TOL[torch.bfloat16], cfg
        assert torch.equal(fused_moe(x, ids, wts, *weights, G, config=cfg), out)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64])
def test_cuda_graph_replay(M: int) -> None:
    """No host sync anywhere: captured once, replayed on new inputs, equal to an eager call on them."""
    weights = device_experts(*KIMI)
    x, ids, wts = device_routing(M, KIMI[0], KIMI[1], seed=1)
    fused_moe(x, ids, wts, *weights, G)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, ids, wts, *weights, G)
    x2, ids2, wts2 = device_routing(M, KIMI[0], KIMI[1], seed=2)
    x.copy_(x2)
    ids.copy_(ids2)
    wts.copy_(wts2)
    graph.replay()
    assert torch.equal(out, fused_moe(x2, ids2, wts2, *weights, G))


def _filled_layer(e0: int, e1: int, hidden: int, inter: int, gen: torch.Generator) -> QuantExperts:
    layer = QuantExperts(
        QuantScheme(method="int4", group_size=G), e0=e0, e1=e1, hidden=hidden, intermediate=inter, act=F.silu
    )
    ex = Experts(e1 - e0, hidden, inter, gen)
    for name, t in zip(
        ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"), ex.tensors("cpu"), strict=True
    ):
        getattr(layer, name).copy_(t)
    return layer


def test_layer_fuses_only_what_the_kernel_computes() -> None:
    gen = torch.Generator().manual_seed(8)
    assert _filled_layer(0, 2, H, I, gen)._can_fuse()
    gelu = QuantExperts(
        QuantScheme(method="int4", group_size=G), e0=0, e1=2, hidden=H, intermediate=I, act=F.gelu
    )
    assert not gelu._can_fuse()


@pytest.mark.gpu
def test_layer_on_cuda_matches_its_cpu_loop() -> None:
    """QuantExperts dispatches to the fused kernel on CUDA; its CPU loop is the reference (fp32)."""
    gen = torch.Generator().manual_seed(9)
    layer = _filled_layer(16, 48, 1024, 256, gen)  # this rank: experts 16..47 of 64
    x = torch.randn(33, 1024, generator=gen)
    ids = torch.rand(33, 64, generator=gen).topk(6, dim=-1).indices
    wts = torch.rand(33, 6, generator=gen)
    want = layer(x, wts, ids)
    got = layer.cuda()(x.cuda(), wts.cuda(), ids.cuda())
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize(
    "config", [GEMV, MoEConfig(block_m=0, block_n=64, block_k=32, split_k=3), TILES, GROUPED]
)
def test_add_is_torchs_add_of_the_routed_sum(config: MoEConfig) -> None:
    """`add` (the shared experts' output) comes out as torch's `routed + add`, byte for byte: the GEMV
    adds it in its down epilogue after rounding the sum (split K or not, grouped or not), the tiles
    by torch after theirs; one token's k slots all another rank's (nothing routed) still gets it."""
    gen = torch.Generator().manual_seed(7)
    ex = Experts(E, H, I, gen)
    x = torch.randn(3, H, generator=gen).to(torch.float16).to(DEV)
    ids, wts = routing(3, gen)
    ids[2] = E + 1  # another rank's experts only
    ids, wts = ids.to(DEV), wts.to(DEV)
    add = (torch.randn(3, H, generator=gen) * 0.05).to(torch.float16).to(DEV)
    routed = fused_moe(x, ids, wts, *ex.tensors(), G, config=config)
    assert torch.equal(fused_moe(x, ids, wts, *ex.tensors(), G, config=config, add=add), routed + add)
    assert torch.equal(routed[2], torch.zeros_like(routed[2]))


@pytest.mark.parametrize("config", [GEMV, MoEConfig(block_m=0, block_n=64, block_k=32, split_k=3), GROUPED])
def test_no_kernel_reads_what_nobody_wrote(config: MoEConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer `run_moe` allocates starts as +inf here (torch.empty's garbage made loud): the answer is
    unchanged and, interpreted, no lane multiplies an unwritten element (inf · 0 warns, and warnings are
    errors). The grouped down GEMV's padding lanes once read another rank's pair's act row, never written
    (CI, 2026-12-06: a NaN in that garbage failed the run); padding now reads its block's first pair."""
    import kernels.moe_routing as routing_mod

    real_empty = torch.empty

    def loud_empty(*shape: object, **kw: object) -> torch.Tensor:
        t = real_empty(*shape, **kw)  # type: ignore[call-overload]
        return t.fill_(float("inf")) if t.is_floating_point() else t

    gen = torch.Generator().manual_seed(11)
    ex = Experts(E, H, I, gen)
    x = torch.randn(5, H, generator=gen).to(torch.float16).to(DEV)
    ids, wts = routing(5, gen)
    ids[4] = E + 1  # the last pairs another rank's: the grouped blocks' padding pointed at them
    ids[1, 0] = -1
    ids, wts = ids.to(DEV), wts.to(DEV)
    want = fused_moe(x, ids, wts, *ex.tensors(), G, config=config)
    monkeypatch.setattr(routing_mod.torch, "empty", loud_empty)
    got = fused_moe(x, ids, wts, *ex.tensors(), G, config=config)
    monkeypatch.undo()
    assert torch.equal(got, want)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    "config",
    [
        GEMV,
        MoEConfig(block_m=0, block_n=64, block_k=32, split_k=3),
        GROUPED,
        MoEConfig(block_m=2, block_n=32, block_k=64, split_k=2, lift=True, grouped=True),
    ],
)
def test_pairs_of_other_ranks_take_no_part(config: MoEConfig) -> None:
    """Expert parallel: a rank none of whose pairs is local (ids -1 and E: another rank's) writes
    zeros, or add's rows, though its programs park and count nothing; with token 0 routed elsewhere
    only, token 1 half here, tokens 2-4 all here, the sum is the torch reference's over the local
    slots (+ add). The launcher's buffers start as NaN: a row left unwritten, or a partial or act row
    read that no program wrote, shows."""
    from tests.kernels.test_fused_moe_fp8 import poisoned

    gen = torch.Generator().manual_seed(13)
    ex = Experts(E, H, I, gen)
    M = 5
    x = torch.randn(M, H, generator=gen)
    ids, wts = routing(M, gen)
    add = torch.randn(M, H, generator=gen) * 0.05
    elsewhere = torch.tensor([-1, E]).repeat(M, 1)
    some = ids.clone()
    some[0], some[1, 0] = elsewhere[0], E + 3
    for a in (None, add):
        on_dev = None if a is None else a.to(DEV)
        with poisoned():
            got = fused_moe(
                x.to(DEV), elsewhere.to(DEV), wts.to(DEV), *ex.tensors(), G, config=config, add=on_dev
            )
        assert torch.equal(got.cpu(), torch.zeros_like(x) if a is None else a)
        with poisoned():
            got = fused_moe(x.to(DEV), some.to(DEV), wts.to(DEV), *ex.tensors(), G, config=config, add=on_dev)
        want = fused_moe_ref(x, some, wts, *ex.tensors("cpu"), G) + (0 if a is None else a)
        assert rel_err(got, want) < TOL[torch.float32]
        assert torch.equal(got[0].cpu(), want[0])  # nothing routed here: zeros (+ add) exactly


def test_splits_sized_for_the_pairs_on_this_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert parallel, one rank of 8: `local_share` 1/8 sizes the GEMV's K splits for the ~1 pair in
    8 whose expert is here (the other ranks' pairs load nothing), not for all of them; the sum is the
    reference's either way, and the layer passes its share (E local / E in all)."""
    from kernels import moe_routing

    gen = torch.Generator().manual_seed(17)
    ex = Experts(E, H, I, gen)
    M = 2
    x = torch.randn(M, H, generator=gen)
    ids, wts = routing(M, gen)
    ids[:, 1:] = E + 5  # one slot a token here, the rest another rank's
    splits: list[tuple[int, int]] = []
    real = moe_routing.gemv_split_k

    def spy(num_pairs: int, N: int, K: int, cfg: MoEConfig, num_sms: int) -> int:
        splits.append((num_pairs, real(num_pairs, N, K, cfg, num_sms)))
        return splits[-1][1]

    monkeypatch.setattr(moe_routing, "gemv_split_k", spy)
    want = fused_moe_ref(x, ids, wts, *ex.tensors("cpu"), G)
    for share in (1.0, 1 / 8):
        splits.clear()
        got = fused_moe(x.to(DEV), ids.to(DEV), wts.to(DEV), *ex.tensors(), G, config=GEMV, local_share=share)
        assert rel_err(got, want) < TOL[torch.float32], share
        assert [n for n, _ in splits] == [M * 2 if share == 1.0 else 1] * 2  # gate/up, down
    experts = QuantExperts(
        QuantScheme.build("int4", group_size=G), e0=8, e1=16, hidden=H, intermediate=I, act=F.silu,
        num_global_experts=64,
    )  # fmt: skip
    assert experts.local_share == 1 / 8
