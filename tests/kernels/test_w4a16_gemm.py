"""W4A16 GEMM/GEMV against an independent reference.

The checkpoint is built with compressed-tensors' own packer (the published format), the expected
output with a float64 matmul of the unpacked weights. CPU CI runs the Triton kernels under
TRITON_INTERPRET=1 (fp16/fp32 activations: bf16 tl.dot is broken in the interpreter); the
`gpu` tests run bf16 on real shapes on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import kernels.w4a16_config as w4a16_config  # noqa: E402
import kernels.w4a16_gemm as w4a16_module  # noqa: E402
from kernels.formats.int4 import repack_int4, unpack  # noqa: E402
from kernels.int4_dequant import int4_dequant_triton  # noqa: E402
from kernels.w4a16_config import W4A16Config  # noqa: E402
from kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref  # noqa: E402
from kernels.w4a16_gemv import tma_fits  # noqa: E402
from tests.kernels.sm90_compile import compiled_lines  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# triton 3.6's interpreter turns 1-element arrays into loop bounds with int(); numpy < 2.4 only warns
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 in [-8, 7] -> [N, K/8] int32, nibble j of word i = q[8i + j] + 8 (checked below
    against compressed-tensors' packer; the device image has no compressed-tensors)."""
    nib = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)  # [N, K/8, 8]
    words = (nib << torch.arange(0, 32, 4)).sum(-1)  # [N, K/8] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def make_checkpoint(
    N: int, K: int, group: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight_packed [N, K/8] int32, weight_scale [N, K/G] bf16, q [N, K] int8) in the published format."""
    q = torch.randint(-8, 8, (N, K), generator=gen, dtype=torch.int8)
    packed = pack_int4(q)
    scale = (torch.rand(N, K // group, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    return packed, scale, q


def expected(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    w = q.double() * scale.double().repeat_interleave(group, dim=1)  # [N, K]
    return x.double() @ w.t()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_packing_matches_compressed_tensors() -> None:
    pytest.importorskip("compressed_tensors")  # an independent reference; the H200 image lacks it
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    gen = torch.Generator().manual_seed(0)
    packed, _, q = make_checkpoint(24, 96, 32, gen)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack(packed), q)
    assert torch.equal(unpack_from_int32(packed, 4, q.shape), q)


def test_reference_matches_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    packed, scale, q = make_checkpoint(40, 128, 32, gen)
    x = torch.randn(3, 128, generator=gen)
    assert rel_err(w4a16_gemm_ref(x, packed, scale), expected(x, q, scale)) < 1e-6


CASES = [
    # M, N, K, group, config (None: the launcher's own choice)
    (1, 72, 96, 32, None),  # GEMV, N not a multiple of the tile, K not a multiple of BLOCK_K
    (1, 200, 384, 128, W4A16Config(0, 64, 256, split_k=2)),  # GEMV + split-K, group > BLOCK_K/8 rows
    (2, 56, 160, 32, W4A16Config(0, 32, 64, split_k=3)),  # GEMV, two rows, uneven split
    (1, 56, 320, 32, W4A16Config(0, 32, 64, split_k=2, lift=True)),  # GEMV on lifted rows (a launch before)
    (1, 72, 448, 32, W4A16Config(0, 32, 64, split_k=1, loop_stages=3)),  # pipelined K loop, 7 tiles, N edge
    (2, 56, 320, 64, W4A16Config(0, 32, 64, split_k=2, loop_stages=4, lift=True)),  # pipelined, uneven split
    (
        1,
        72,
        448,
        32,
        W4A16Config(0, 32, 64, split_k=2, prefetch=True),
    ),  # register prefetch, uneven split, N edge
    (2, 40, 384, 128, W4A16Config(0, 16, 64, split_k=2, prefetch=True)),  # prefetch, group > BLOCK_K, 6 tiles
    (1, 72, 448, 32, W4A16Config(0, 32, 64, split_k=3, tma_stages=3)),  # TMA ring, N edge, uneven split
    (
        2,
        56,
        320,
        64,
        W4A16Config(0, 16, 64, split_k=1, tma_stages=4),
    ),  # TMA, two rows, ring deeper than the loop
    (3, 40, 256, 128, W4A16Config(0, 16, 128, split_k=2, tma_stages=2)),  # TMA, three rows, group = BLOCK_K
    (1, 24, 96, 32, W4A16Config(0, 32, 64, split_k=1, tma_stages=3)),  # TMA boxes past N and past K
    (2, 72, 448, 32, None),  # the launcher's decode pick at two rows: one word stream for both
    (3, 40, 384, 64, W4A16Config(0, 16, 64, split_k=2, tma_stages=3, gemv_rows=2)),  # a pair, then one row
    (3, 72, 96, 32, None),  # tensor-core path, M below the tile
    (17, 40, 256, 64, W4A16Config(16, 32, 32, split_k=4)),  # BLOCK_K < group, split-K
    (33, 48, 192, 32, W4A16Config(32, 16, 128, split_k=1)),  # BLOCK_K > group
    (17, 72, 256, 64, W4A16Config(16, 64, 64, split_k=2, swap_xw=True)),  # transposed tile, N and M edges
    (70, 24, 64, 32, None),  # prefill default: dequantize + matmul
    (65, 40, 192, 64, W4A16Config(0, 16, 128, dense=True)),  # dequant tiles across N and K edges
    (130, 40, 64, 32, W4A16Config(128, 32, 64, num_warps=8)),  # the fused tensor-core tiles at large M
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("M", "N", "K", "group", "config"), CASES)
def test_kernel_matches_reference(
    M: int, N: int, K: int, group: int, config: W4A16Config | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    packed, scale, q = make_checkpoint(N, K, group, gen)
    w, s, g = repack_int4(packed, scale)
    assert g == group
    x = torch.randn(M, K, generator=gen).to(dtype)
    out = w4a16_gemm(x.to(DEV), w.to(DEV), s.to(DEV), g, config=config)
    assert out.dtype == dtype and out.shape == (M, N)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert rel_err(out.cpu(), expected(x, q, scale)) < tol


WIDEN_CASES = [
    (1, 72, 448, 32, W4A16Config(0, 32, 64, split_k=3)),  # plain GEMV, N edge, uneven split
    (2, 56, 320, 64, W4A16Config(0, 32, 64, split_k=2, lift=True)),  # lifted rows
    (1, 72, 448, 32, W4A16Config(0, 32, 64, split_k=2, prefetch=True)),  # register prefetch
    (1, 72, 448, 32, W4A16Config(0, 32, 64, split_k=3, tma_stages=3)),  # TMA ring
    (3, 72, 96, 32, None),  # tiles: the launcher widens x first
    (70, 24, 64, 32, None),  # prefill: the same
]


@pytest.mark.parametrize(("M", "N", "K", "group", "config"), WIDEN_CASES)
def test_a_float32_product_of_a_narrow_x_is_the_widened_x_product(
    M: int, N: int, K: int, group: int, config: W4A16Config | None
) -> None:
    """`out_dtype=float32` with an fp16 x (bf16 on the device: the DSA indexer's weights_proj) is
    `x.float()`'s product to the bit: the GEMV widens x as it loads it, the other paths widen x
    before they run."""
    gen = torch.Generator().manual_seed(M * 100 + N + K)
    packed, scale, q = make_checkpoint(N, K, group, gen)
    w, s = (t.to(DEV) for t in repack_int4(packed, scale)[:2])
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16 if DEV == "cuda" else torch.float16).to(DEV)
    out = w4a16_gemm(x, w, s, group, config=config, out_dtype=torch.float32)
    widened = w4a16_gemm(x.float(), w, s, group, config=config)
    assert out.dtype == torch.float32 and torch.equal(out, widened)
    assert rel_err(out.cpu(), expected(x.cpu(), q, scale)) < 1e-5
    with pytest.raises(ValueError):
        w4a16_gemm(x.float(), w, s, group, config=config, out_dtype=torch.float16)


def test_dequantize_matches_unpacked_weights() -> None:
    gen = torch.Generator().manual_seed(4)
    packed, scale, q = make_checkpoint(20, 160, 32, gen)
    dense = int4_dequant_triton(packed.to(DEV), scale.to(DEV), 32, torch.float32).cpu()
    assert torch.equal(dense, q.float() * scale.float().repeat_interleave(32, dim=1))


def test_dense_product_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight wider than the scratch budget is dequantized and multiplied chunk by chunk."""
    monkeypatch.setattr(w4a16_module, "_DENSE_CHUNK_BYTES", 16 * 64 * 4)  # 16 rows of K=64 fp32
    gen = torch.Generator().manual_seed(12)
    packed, scale, q = make_checkpoint(40, 64, 32, gen)
    x = torch.randn(3, 64, generator=gen)
    out = w4a16_gemm(x.to(DEV), packed.to(DEV), scale.to(DEV), 32, config=W4A16Config(0, 16, 64, dense=True))
    assert rel_err(out.cpu(), expected(x, q, scale)) < 1e-5


@pytest.mark.parametrize(
    "cfg", [W4A16Config(0, 32, 64, split_k=4), W4A16Config(0, 32, 64, split_k=4, tma_stages=3)]
)
def test_split_k_counters_reset_and_results_repeat(cfg: W4A16Config) -> None:
    """A second call with the same split-K tiles must see reset counters and give identical bits."""
    gen = torch.Generator().manual_seed(7)
    packed, scale, q = make_checkpoint(64, 256, 32, gen)
    w, s, g = repack_int4(packed, scale)
    x = torch.randn(1, 256, generator=gen, dtype=torch.float32).to(DEV)
    first = w4a16_gemm(x, w.to(DEV), s.to(DEV), g, config=cfg)
    second = w4a16_gemm(x, w.to(DEV), s.to(DEV), g, config=cfg)
    assert torch.equal(first, second)
    assert rel_err(first.cpu(), expected(x.cpu(), q, scale)) < 1e-5


def test_decode_gemv_by_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows take the plain GEMV (the TMA ring lost the H200 sweep); with the TMA GEMV as the
    default, its K split aims at `TMA_PROGRAMS_PER_SM` programs per SM with two or more K tiles each,
    narrower tiles for a narrow weight; a weight TMA cannot stream (a strided view) takes the plain
    GEMV."""
    plain = w4a16_config.pick_config(1, 8192, 8192, 132, 128)
    assert plain.block_m == 0 and plain.tma_stages == 0 and plain.split_k >= 1
    assert w4a16_config.pick_config(1, 576, 6144, 132, 32).tma_stages == 0
    monkeypatch.setattr(w4a16_config, "GEMV_DEFAULT", w4a16_config.GEMV_TMA)
    cfg = w4a16_config.pick_config(1, 8192, 8192, 132, 128)
    assert cfg.block_m == 0 and cfg.tma_stages > 1
    programs = 8192 // cfg.block_n * cfg.split_k
    k_tiles = 8192 // cfg.block_k
    assert -(-k_tiles // cfg.split_k) >= 2
    target = w4a16_config.TMA_PROGRAMS_PER_SM * 132 * 4 // cfg.num_warps
    assert programs <= 2 * target and (cfg.split_k == 16 or programs * 2 >= target)
    assert w4a16_config.pick_config(16, 8192, 8192, 132, 128).block_m == 16  # tiles from M = 3
    assert w4a16_config.pick_config(2, 8192, 8192, 132, 128).gemv_rows == 2
    narrow = w4a16_config.pick_config(1, 576, 6144, 132, 32)  # GLM's kv_a: 5 tiles of 128 rows
    assert narrow.block_n < cfg.block_n and narrow.tma_stages > 1
    assert 576 // narrow.block_n * narrow.split_k > 5 * 16 and 6144 // narrow.block_k >= 2 * narrow.split_k
    gen = torch.Generator().manual_seed(8)
    packed, scale, q = make_checkpoint(48, 256, 32, gen)
    wide = torch.zeros(48, 2 * packed.shape[1], dtype=torch.int32)
    wide[:, ::2] = packed  # every other word: a strided view the descriptor cannot take
    view = wide[:, ::2]
    assert not tma_fits(view, W4A16Config(0, 32, 64, tma_stages=3))
    x = torch.randn(1, 256, generator=gen, dtype=torch.float32)
    out = w4a16_gemm(
        x.to(DEV), view.to(DEV), scale.to(DEV), 32, config=W4A16Config(0, 32, 64, split_k=2, tma_stages=3)
    )
    assert rel_err(out.cpu(), expected(x, q, scale)) < 1e-5


def test_leading_dims_and_shape_errors() -> None:
    gen = torch.Generator().manual_seed(3)
    packed, scale, q = make_checkpoint(16, 64, 32, gen)
    w, s, g = repack_int4(packed.to(DEV), scale.to(DEV))
    x = torch.randn(2, 1, 64, generator=gen, dtype=torch.float32)
    out = w4a16_gemm(x.to(DEV), w, s, g)
    assert out.shape == (2, 1, 16)
    assert rel_err(out.reshape(2, 16).cpu(), expected(x.reshape(2, 64), q, scale)) < 1e-5
    with pytest.raises(ValueError):
        w4a16_gemm(torch.randn(1, 72, device=DEV), w, s, g)
    with pytest.raises(TypeError):
        w4a16_gemm(torch.randn(1, 64, dtype=torch.float64, device=DEV), w, s, g)
    with pytest.raises(ValueError):
        w4a16_gemm(torch.randn(1, 64, device=DEV), w, s[:1], g)


def test_int4_kernels_compile_for_sm90() -> None:
    """The W4A16 and INT4 MoE kernels (and the MoE alignment) compile for the H200 at the launchers' defaults (Triton +
    ptxas + cuobjdump, no GPU; a process without TRITON_INTERPRET): no spills, and the GEMVs' K loop
    stays near two instructions per weight (`kernels/triton_lib.py`) and either loads its words into
    registers with no barrier (the plain loop) or only through shared memory (cp.async with
    `loop_stages` > 1, TMA with `tma_stages` > 1)."""
    lines = compiled_lines("tests.kernels.sm90_compile_int4")
    assert len(lines) == 16 and all(" 0 bytes spill stores" in line for line in lines), lines
    for line in (line for line in lines if "| loop" in line):
        per_nibble = float(line.split("| loop ")[1].split()[0])
        assert per_nibble < 4.0 and ("BAR 0 LDS 0" in line or "LDG.128 0 " in line), line


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("M", "config"),
    [(1, None), (1, W4A16Config(0, 64, 256, split_k=3, lift=True)), (2, W4A16Config(0, 64, 256, split_k=7)),
     (1, W4A16Config(0, 128, 256, split_k=4, loop_stages=3)), (1, W4A16Config(0, 64, 512, split_k=2, loop_stages=4)),
     (1, W4A16Config(0, 128, 256, split_k=5, tma_stages=4)), (2, W4A16Config(0, 64, 256, split_k=3, tma_stages=6)),
     (1, W4A16Config(0, 256, 256, num_warps=8, split_k=2, tma_stages=3)), (1, W4A16Config(0, 128, 256, split_k=3, prefetch=True)),
     (1, W4A16Config(0, 128, 256, split_k=13, tma_stages=6)),  # splits shorter than the ring, empty ones at K=4096
     (2, W4A16Config(0, 64, 256, split_k=5, tma_stages=4, gemv_rows=2)), (2, W4A16Config(0, 128, 256, split_k=1, prefetch=True)),
     (5, None), (16, None), (64, None), (300, None), (2048, None),
     (16, W4A16Config(16, 64, 128, split_k=4, num_stages=4, swap_xw=True)),
     (40, W4A16Config(64, 64, 128, split_k=2, num_stages=4, swap_xw=True))],
)  # fmt: skip
@pytest.mark.parametrize(("N", "K", "group"), [(4096, 7168, 32), (2048, 4096, 128)])
def test_bf16_on_gpu(M: int, config: W4A16Config | None, N: int, K: int, group: int) -> None:
    gen = torch.Generator().manual_seed(M + N)
    packed, scale, q = make_checkpoint(N, K, group, gen)
    w, s, g = repack_int4(packed.cuda(), scale.cuda())
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    w4a16_gemm(x.cuda(), w, s, g, config=config, out=out)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), expected(x, q, scale)) < 1e-2
