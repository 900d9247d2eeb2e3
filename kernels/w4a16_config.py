"""The W4A16 op's launch configuration (`kernels/w4a16_gemm.py`): the tile shape and launch
parameters of one call (`W4A16Config`), the defaults by M, N and K (`pick_config`) and the split of K
that fills the GPU (`with_split_k`). `benchmarks/kernels/bench_w4a16.py` sweeps the candidates and
prints the table these defaults come from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

__all__ = [
    "GEMV_DEFAULT",
    "GEMV_MAX_M",
    "GEMV_NARROW",
    "GEMV_PROGRAMS_PER_SM",
    "GEMV_TMA",
    "PREFILL_DEFAULT",
    "TILE_DEFAULTS",
    "TMA_PROGRAMS_PER_SM",
    "W4A16Config",
    "pick_config",
    "with_split_k",
]


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """Tile shape and launch parameters; `block_m == 0` selects the GEMV kernel; `dense` dequantizes
    the weight to the activation dtype (tiles of block_n × block_k) and hands the product to cuBLAS."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    dense: bool = False
    lift: bool = False  # GEMV: activations lifted by a separate launch (`lift_rows`), not in the kernel
    # GEMV: >1 pipelines its K loop (`tl.range` stages: word tiles in flight through cp.async)
    loop_stages: int = 1
    # GEMV: the next K tile's words held in registers while this one's dots run (ptxas may sink the
    # loads towards the loop's end: see `bench_w4a16`'s sweep before making it a default)
    prefetch: bool = False
    # GEMV: > 1 streams the word tiles by TMA through a ring of that many stages (`kernels/w4a16_gemv.py`)
    tma_stages: int = 0
    gemv_rows: int = 1  # TMA GEMV: activation rows (1 or 2) a program runs against one word stream
    swap_xw: bool = False  # tiles: out^T = w x^T, the dequantized w straight from registers into wgmma


# Launcher defaults (from `bench_w4a16 --quick` on the H200; update them from its printed table): the
# GEMV's tiles, how many of its programs split K aims for per SM and the rows up to which it runs;
# the tensor-core tiles by the largest M they serve (split K at 4 programs per SM); the prefill path.
# The TMA GEMV (`tma_stages` > 1) lost to the plain one on every decode shape of the H200 sweep
# (`lab.diagnostics.w4a16_decode_sweep`, 2026-12-04, lab/results/2026-12-04-r6/w4a16_decode.log: one
# GLM 5.2 layer's matrices 74.2 vs 68.3 us), so the default stays the plain GEMV; the TMA ring is a
# sweep candidate (GEMV_TMA)
GEMV_DEFAULT = W4A16Config(block_m=0, block_n=128, block_k=256, num_warps=4)
GEMV_TMA = replace(GEMV_DEFAULT, tma_stages=4)
GEMV_PROGRAMS_PER_SM = 12  # the plain GEMV: several waves (a last wave of a few runs latency-bound)
# the TMA GEMV's programs hold their bytes in flight in shared memory (48 KB at 128x256, 4 stages:
# 4 fit an SM): about one wave of them, each with several K tiles to stream
TMA_PROGRAMS_PER_SM = 4
# a weight too narrow for GEMV_DEFAULT's tiles to fill half that wave (at most 16 splits of 2+ K
# tiles): rows in half the tiles (24 KB of ring, 8 programs an SM), twice the programs streaming
GEMV_NARROW = (W4A16Config(block_m=0, block_n=64, block_k=256, num_warps=4, tma_stages=4), 8)
GEMV_MAX_M = 2  # the GEMV reads the weights once per row: past a few rows the tiles win
TILE_DEFAULTS = (
    (16, W4A16Config(block_m=16, block_n=64, block_k=128, num_stages=4)),
    (32, W4A16Config(block_m=32, block_n=64, block_k=128, num_stages=4)),
    (64, W4A16Config(block_m=64, block_n=64, block_k=128, num_stages=4)),
)
# prefill: one dequantizing pass (~N·K·2.5 bytes) then cuBLAS beat the fused tiles 2× on H200
PREFILL_DEFAULT = W4A16Config(block_m=0, block_n=32, block_k=256, num_warps=4, dense=True)


def pick_config(M: int, N: int, K: int, num_sms: int, group_size: int = 32) -> W4A16Config:
    """By M from the tables above: the GEMV (by N, narrow or not), the first tiles whose bound holds,
    else prefill."""
    if M <= GEMV_MAX_M and group_size >= 32:  # decode: both rows of M = 2 against one word stream
        rows = min(M, 2)
        cfg = with_split_k(replace(GEMV_DEFAULT, gemv_rows=rows), M, N, K, num_sms)
        wave = TMA_PROGRAMS_PER_SM * num_sms * 4 // cfg.num_warps
        if cfg.tma_stages > 1 and 2 * triton.cdiv(N, cfg.block_n) * cfg.split_k < wave:
            return with_split_k(replace(GEMV_NARROW[0], gemv_rows=rows), M, N, K, num_sms, GEMV_NARROW[1])
        return cfg
    cfg = next((cfg for bound, cfg in TILE_DEFAULTS if bound >= M), None)
    return PREFILL_DEFAULT if cfg is None else with_split_k(cfg, M, N, K, num_sms)


def with_split_k(
    cfg: W4A16Config, M: int, N: int, K: int, num_sms: int, per_sm: int | None = None
) -> W4A16Config:
    """Split K until there are about `per_sm` programs per SM (default: 4, the GEMV
    `GEMV_PROGRAMS_PER_SM` of 4 warps, the TMA GEMV `TMA_PROGRAMS_PER_SM`), to the nearest split (at
    most 16, of 4+ K tiles each; GEMV 2+; every split with work)."""
    rows = (
        triton.cdiv(M, cfg.gemv_rows if cfg.tma_stages > 1 else 1)
        if cfg.block_m == 0
        else triton.cdiv(M, cfg.block_m)
    )
    tiles = triton.cdiv(N, cfg.block_n) * rows
    k_tiles = triton.cdiv(K, cfg.block_k)
    if cfg.block_m == 0:
        default = TMA_PROGRAMS_PER_SM if cfg.tma_stages > 1 else GEMV_PROGRAMS_PER_SM
        target, min_tiles = (per_sm or default) * num_sms * 4 // cfg.num_warps, 2
    else:
        target, min_tiles = (per_sm or 4) * num_sms, 4
    split = max(1, min(k_tiles // min_tiles, round(target / tiles), 16))
    return replace(cfg, split_k=triton.cdiv(k_tiles, triton.cdiv(k_tiles, split)))  # every split with work
