"""Tile configs of the paged MLA kernel (`kernels/mla_decode.py`) and the slice count they imply.

A tile has `rows` = queries × heads: 64 is one wgmma warpgroup's M, run by two warpgroups that split
the 512 value columns (the fp32 accumulator is then 128 registers a thread, the most that fits);
32 and 16 run mma.sync. `TILES[(mode, rows, fp8)]` is the launchers' default; `VARIANTS` what
`benchmarks/kernels/bench_mla_decode.py --sweep` times against it (the default first), which is the
table to update after an H200 run. `python -m tests.kernels.sm90_compile --all` prints, for each,
ptxas's registers and spills, the shared memory and the CTAs an SM holds; `ctas_per_sm` must not
exceed the latter.

Pipeline depth: the token loop's loads form a chain (page id -> line; sparse: position -> page id ->
line) and Triton's pipeliner splits `num_stages - 1` between its links, so dense tiles need
num_stages 5 to keep two steps of lines in flight, sparse ones 7; below that each step waits for
its own lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from kernels.split_k_merge import MERGE_BLOCK_S


@dataclass(frozen=True, slots=True)
class MlaTiles:
    """Heads per program, tokens per step, latent columns per chunk, warps, pipeline depth, and the
    CTAs an SM holds at once (registers and shared memory allowing), which the slice count aims at;
    `swap`: tokens as the dots' rows (wgmma's 64 whatever the heads); `fp8_shift`: FP8 lines converted
    by moving bits (`e4m3_to_f16_shifted`) rather than by the conversion unit; `fp8_dot`: FP8 lines
    read as they are by e4m3 dots, q and the softmax weights rounded to e4m3 (a change of numerics:
    not a default before `kumo eval` passes it)."""

    block_h: int
    block_n: int
    block_rc: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int
    swap: bool = False
    fp8_shift: bool = False
    fp8_dot: bool = False

    def label(self) -> str:
        """`16x64/64 w4 s3 swap dot8`: heads x tokens / latent columns, warps, stages, flags."""
        flags = (" swap" if self.swap else "") + (" shift" if self.fp8_shift else "")
        flags += " dot8" if self.fp8_dot else ""
        return f"{self.block_h}x{self.block_n}/{self.block_rc} w{self.num_warps} s{self.num_stages}{flags}"


# (mode, rows, FP8 cache) -> tiles; mode "decode" (dense), "sparse" (decode or prefill), "prefill".
# Chosen from the sm90 compile (no spills; registers and shared memory for the CTAs an SM holds) and
# the in-flight bytes an SM needs to stream HBM. The H200 sweep of 2026-12-01 timed prefill's 64x64/64 w8
# s3 at 0.79 of these tiles' time with a BF16 cache, 0.65 with FP8, but it spills (48 / 8 bytes), so it
# stays a variant until a spill-free form of it is timed; the decode variants did not compile there.
TILES: dict[tuple[str, int, bool], MlaTiles] = {
    ("decode", 64, False): MlaTiles(64, 32, 64, 8, 5, 1),
    ("decode", 64, True): MlaTiles(64, 32, 64, 8, 5, 1),
    ("decode", 32, False): MlaTiles(32, 64, 64, 8, 3, 1),
    ("decode", 32, True): MlaTiles(32, 64, 64, 8, 3, 1),
    ("decode", 16, False): MlaTiles(16, 64, 64, 4, 3, 2),
    ("decode", 16, True): MlaTiles(16, 32, 64, 4, 5, 2),
    ("sparse", 64, False): MlaTiles(64, 32, 64, 8, 7, 1),
    ("sparse", 64, True): MlaTiles(64, 32, 64, 8, 7, 1),
    ("sparse", 32, False): MlaTiles(32, 64, 64, 8, 3, 1),
    ("sparse", 32, True): MlaTiles(32, 64, 64, 8, 3, 1),
    ("sparse", 16, False): MlaTiles(16, 64, 64, 4, 5, 2),
    ("sparse", 16, True): MlaTiles(16, 64, 64, 4, 5, 1),
    ("prefill", 64, False): MlaTiles(64, 32, 64, 8, 5, 1),
    ("prefill", 64, True): MlaTiles(64, 32, 64, 8, 5, 1),
}

# The FP8-dot path (`MlaTiles.fp8_dot`, issue 24's "QK and PV on FP8 tensor cores"): a change of
# numerics, so not in TILES; these are the tiles `resolve_tiles(fp8_dot=True)` gives (`kumo eval`'s
# `mla=fp8-dot`), and they are VARIANTS of the FP8 keys for the H200 A/B. The sm90 compile
# (`python -m tests.kernels.sm90_compile --fp8-dot`, lab/results/2026-12-05-mla-fp8-dot-sass.md): under
# 64 rows Triton 3.6 runs an e4m3 dot on mma.sync as fp16 (sm90 has no 8-bit mma.sync in Triton), so
# 8-32 heads take the swapped dots (tokens as wgmma's 64 rows); an 8-row swapped tile (8 heads, N = 8)
# falls back the same way. fp8 wgmma takes K-major operands only, so the value dot's tile (tokens x
# latent, latent-major in the cache) is transposed through shared memory every step, by Triton one byte
# at a time (LDS.U8 + PRMT, ~16 + 12 warp instructions a token): the round trip the FP8 lines'
# conversion paid, in another form. 64 rows spill (~170 bytes at 255 registers: each step's value dot
# takes its own fp32 accumulator).
FP8_DOT_TILES: dict[tuple[str, int], MlaTiles] = {
    ("decode", 64): MlaTiles(64, 64, 64, 8, 3, 1, fp8_dot=True),
    ("decode", 32): MlaTiles(32, 64, 64, 8, 3, 1, swap=True, fp8_dot=True),
    ("decode", 16): MlaTiles(16, 64, 64, 4, 3, 2, swap=True, fp8_dot=True),
    ("sparse", 64): MlaTiles(64, 64, 64, 8, 3, 1, fp8_dot=True),
    ("sparse", 32): MlaTiles(32, 64, 64, 8, 3, 1, swap=True, fp8_dot=True),
    ("sparse", 16): MlaTiles(16, 64, 64, 4, 3, 2, swap=True, fp8_dot=True),
    ("prefill", 64): MlaTiles(64, 64, 64, 8, 3, 1, fp8_dot=True),
}

# what the benchmark's sweep times after the default (block_h is the rows' for decode; prefill tiles
# take 64 // block_h queries)
VARIANTS: dict[tuple[str, int, bool], list[MlaTiles]] = {
    ("decode", 64, False): [
        MlaTiles(64, 64, 64, 8, 3, 1), MlaTiles(64, 32, 128, 8, 5, 1), MlaTiles(64, 32, 64, 8, 4, 1),
    ],
    ("decode", 64, True): [
        MlaTiles(64, 64, 64, 8, 3, 1), MlaTiles(64, 32, 64, 8, 7, 1), MlaTiles(64, 32, 64, 8, 4, 1),
        MlaTiles(64, 32, 64, 8, 5, 1, fp8_shift=True), FP8_DOT_TILES[("decode", 64)],
        MlaTiles(64, 32, 64, 8, 5, 1, fp8_dot=True),
    ],
    ("decode", 16, False): [
        MlaTiles(16, 32, 64, 4, 5, 2), MlaTiles(16, 64, 64, 4, 5, 1), MlaTiles(16, 64, 128, 4, 3, 2),
        MlaTiles(16, 32, 64, 8, 5, 2), MlaTiles(16, 64, 64, 4, 3, 1, swap=True),
        MlaTiles(16, 64, 128, 8, 3, 1, swap=True),
    ],
    # round 3 (2026-12-04, sm90 compile: registers -> CTAs an SM): shifted conversion 16x32/64 w4 152 -> 2,
    # w8 127 -> 2, 16x32/128 w4 155 -> 3, 16x16 157 / 150 -> 3; swapped w4 224 -> 2, w8 218 -> 1
    ("decode", 16, True): [
        MlaTiles(16, 64, 64, 4, 3, 1), MlaTiles(16, 64, 64, 4, 5, 1), MlaTiles(16, 32, 64, 4, 7, 2),
        MlaTiles(16, 32, 64, 4, 5, 2, fp8_shift=True), MlaTiles(16, 32, 64, 8, 5, 2, fp8_shift=True),
        MlaTiles(16, 32, 128, 4, 4, 3, fp8_shift=True), MlaTiles(16, 16, 64, 4, 6, 3, fp8_shift=True),
        MlaTiles(16, 16, 128, 4, 5, 3, fp8_shift=True), MlaTiles(16, 32, 64, 4, 4, 2, swap=True, fp8_shift=True),
        MlaTiles(16, 64, 128, 8, 3, 1, swap=True, fp8_shift=True), FP8_DOT_TILES[("decode", 16)],
        MlaTiles(16, 128, 64, 8, 3, 1, swap=True, fp8_dot=True),
    ],
    ("sparse", 64, False): [MlaTiles(64, 32, 64, 8, 5, 1), MlaTiles(64, 16, 64, 8, 7, 1)],
    ("sparse", 64, True): [MlaTiles(64, 32, 64, 8, 5, 1), MlaTiles(64, 16, 64, 8, 7, 1)],
    ("prefill", 64, False): [MlaTiles(64, 64, 64, 8, 3, 1), MlaTiles(64, 32, 64, 8, 4, 1)],
    ("prefill", 64, True): [MlaTiles(64, 64, 64, 8, 3, 1), MlaTiles(64, 32, 64, 8, 7, 1)],
}  # fmt: skip


def tile_rows(rows: int) -> int:
    """The table's row count for a tile of `rows` (decode: the heads): 64 from 33 on, else 32 or 16."""
    return 64 if rows > 32 else 32 if rows > 16 else 16


def resolve_tiles(
    mode: str,
    rows: int,
    fp8: bool,
    block_h: int | None,
    block_n: int | None,
    block_rc: int | None,
    num_warps: int | None,
    num_stages: int | None,
    base: MlaTiles | None = None,
    fp8_dot: bool = False,
) -> MlaTiles:
    """`base`, or else TILES' entry for `mode` and a tile of `rows` (a prefill tile under 64 rows:
    decode's; `fp8_dot` with an FP8 cache: FP8_DOT_TILES'), with any of its fields given explicitly."""
    key = tile_rows(rows)
    if base is None and fp8 and fp8_dot:
        base = FP8_DOT_TILES.get((mode, key)) or FP8_DOT_TILES[("decode", key)]
    d = base or TILES.get((mode, key, fp8)) or TILES[("decode", key, fp8)]
    return MlaTiles(
        block_h or d.block_h, block_n or d.block_n, block_rc or d.block_rc, num_warps or d.num_warps,
        num_stages or d.num_stages, d.ctas_per_sm, d.swap, d.fp8_shift, d.fp8_dot,
    )  # fmt: skip


MAX_SPLITS = MERGE_BLOCK_S  # the merge reads every slice's LSE at once, in one compiled kernel
SLICE_FIXED_ITEMS = 64  # a slice's own cost (q, the tag check's pass, the epilogue), in items read
IDLE_SLICE_ITEMS = 1  # what one more slice costs a mostly idle GPU, in items of one program's walk
IDLE_SHARE = 8  # the tiles alone occupy at most 1/IDLE_SHARE of the SMs: the GPU is mostly idle


def slice_cost_items(rows: int, kv_lora_rank: int, line_bytes: int) -> int:
    """What one more slice costs, in items read: its fixed work and its partial output, written and read
    back by the merge (`rows` x R fp32 each way: 114 FP8 lines for a 16-row tile, 455 for 64 rows)."""
    return SLICE_FIXED_ITEMS + rows * kv_lora_rank * 8 // line_bytes


def pick_mla_splits(
    num_tiles: int,
    head_blocks: int,
    max_items: int,
    num_sms: int,
    ctas_per_sm: int,
    slice_cost: int,
    block_n: int,
) -> int:
    """Slices per tile, by how much of the device the tiles alone (`num_tiles` x `head_blocks`
    programs) occupy.

    Busy (more than an eighth of the SMs): the slices minimise the modelled time of the last wave of
    programs, waves x (items a slice + `slice_cost`), waves counted in CTA slots (`ctas_per_sm` an SM),
    ties to fewer slices. At batch 64 that is the fewest slices that fill the slots (64 heads, one CTA
    an SM: 2 slices, 128 of 132).

    Mostly idle (up to 16 sequences of 64 heads on the H200): `idle_splits`. For a long context both
    models fill the slots in one wave and agree (batch 8 or 16 at 32k tokens); they part where the
    busy one's floor of `slice_cost` items a slice binds first: few sequences, or a short context.
    """
    slots = num_sms * ctas_per_sm
    base = max(num_tiles * head_blocks, 1)
    if IDLE_SHARE * base <= num_sms:
        return idle_splits(base, max_items, slots, block_n)
    most = max(1, min(MAX_SPLITS, max_items // max(slice_cost, 1)))

    def cost(splits: int) -> int:
        return triton.cdiv(base * splits, slots) * (triton.cdiv(max_items, splits) + slice_cost)

    return min(range(1, most + 1), key=cost)


def idle_splits(num_programs: int, max_items: int, slots: int, block_n: int) -> int:
    """Slices per tile when `num_programs` tiles leave most of the `slots` idle. A program walking its
    slice alone is latency-bound: each step of `block_n` items waits on its loads (a 32-token BF16 step,
    37 KB, takes 2.9 µs: 132 SMs so would draw a third of HBM's rate), while one more slice only adds
    partials that an otherwise idle SM writes and the merge reads back in parallel. The H200 sweep at
    batch 1, 64 heads (`lab/diagnostics/mla_c1_splits.py`, 2026-12-04: 4 to 128 slices, 2,048 to
    8,192 items, dense and top-2,048, BF16 and FP8 caches) fits

        µs = a + b x steps a slice + 0.113 x slices  (0.34 µs rms, 1.5 µs at worst)

    with b = 2.9 µs a 32-token step (dense BF16), 4.2 (FP8), 3.9 / 4.8 (sparse): a slice costs what
    0.76 to 1.25 items cost the walk (`IDLE_SLICE_ITEMS`). So the slices minimise steps x `block_n` +
    slices x `IDLE_SLICE_ITEMS`, at least one step a slice and every program in one wave, ties to
    fewer slices. 2,048 items (GLM-5's top-k and its dense reach) in 32-token steps: 32 slices (the
    busy model: 7 with a BF16 cache, 3 with FP8, 39 / 103 µs; 32: 20 / 22 µs); 2,176: 34; 8,192: 86."""
    steps = triton.cdiv(max_items, block_n)  # of the whole context; a slice walks cdiv(steps, n)
    most = max(1, min(MAX_SPLITS, slots // max(num_programs, 1), steps))

    def cost(splits: int) -> int:
        return triton.cdiv(steps, splits) * block_n + splits * IDLE_SLICE_ITEMS

    return min(range(1, most + 1), key=cost)
