"""The FP8-dot MLA tiles of 64 rows (`FP8_DOT_TILES`' decode and prefill entries: 64 heads, or 8 queries x
8 heads, unswapped dots over two warpgroups, 64-token steps), which on an H100 (2026-12-05) gave garbage
at 64 heads with four slices of ragged lengths and zero outputs in a prefill chunk, where the 16-row
swapped tiles and a batch of full-length sequences did not.

On the CPU the same tiles, slice counts and chunk geometry match the torch emulation and the exact op
(below): the slicing, the empty slices, the partial last steps, the merge, the causal rows and the
query tiles are right in the interpreter, so what fails is in the GPU's compile of these tiles. The GPU
test runs the failing batch through tiles that each drop one suspect, so its table names the fault.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.mla_attention import mla_attention_ref
from kernels.mla_decode import mla_decode
from kernels.mla_prefill import mla_prefill
from kernels.mla_tiles import FP8_DOT_TILES, MlaTiles
from tests.kernels.paged_layout import poison_allocator, query_starts
from tests.kernels.test_mla_decode import DEV, FP8, gpu_batch, make_batch, rel_err, run_both
from tests.kernels.test_mla_fp8_dot import E4M3_U, differences, fp8_dot_emulation

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
ROWS_64 = FP8_DOT_TILES[("decode", 64)]


def test_64_row_tiles_with_empty_slices_match_emulation() -> None:
    """64 heads through the default 64-row tile (64-token steps) in four slices: 17 tokens leave three
    slices empty (two of them starting past the end), 130 and 300 end in a partial step. Equal to the
    emulation to fp32 rounding, every sequence, and within u of the exact op."""
    ctx = [300, 17, 130, 200]
    batch, _ = make_batch(ctx, H=64, R=64, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=11)
    out, ref, flags, _ = run_both(batch, num_splits=4, tiles=ROWS_64)
    emulated = fp8_dot_emulation(batch, ROWS_64.block_n, 4).to(out.dtype)
    assert not flags.any() and out.isfinite().all()
    rows = list(range(len(ctx)))
    assert rel_err(out, emulated) < 2e-5, differences(out, emulated, rows)
    assert rel_err(out, ref) < E4M3_U, differences(out, ref, rows)


@pytest.mark.parametrize("splits", [2, None])  # 2: what the launcher picks for the GPU test on 132 SMs
def test_prefill_chunk_default_tiles(splits: int | None) -> None:
    """The GPU prefill test's geometry at a smaller R: 8 heads (8 queries x 8 heads a 64-row tile, the
    default 64-token steps), chunks of 40 / 24 / 1 queries ending their sequences, the last one a lone
    query over 33 tokens (its second slice starts past the end). Within u of the exact op per sequence,
    no output left zero."""
    ctx, q_lens = [200, 70, 33], [40, 24, 1]
    batch, _ = make_batch(ctx, H=8, R=64, Dr=16, S=16, cache_dtype=FP8, q_dtype=torch.float16, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), 8, 80, generator=g).half()
    args = dict(batch, q=q, query_start=query_starts(q_lens))
    ref = mla_attention_ref(**{**args, "tag_mismatch": args["tag_mismatch"].clone()})
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = mla_prefill(**dev, fp8_dot=True, num_splits=splits).cpu()
    rows = [b for b, n in enumerate(q_lens) for _ in range(n)]
    report = differences(out, ref, rows)
    assert (out.float().abs().amax(-1) > 0).all() and rel_err(out, ref) > 5e-3, report
    for b in range(len(ctx)):
        seq = torch.tensor(rows) == b
        assert rel_err(out[seq], ref[seq]) < E4M3_U, report


# each drops one suspect of the 64-row tile: pipelining (one stage), the second warpgroup (4 warps: one
# wgmma warpgroup holds all 64 rows and every latent column), 64-token steps, the unswapped products
ISOLATING: dict[str, MlaTiles] = {
    "as FP8_DOT_TILES": ROWS_64,
    "no pipelining": replace(ROWS_64, num_stages=1),
    "one warpgroup": replace(ROWS_64, num_warps=4),
    "32-token steps": MlaTiles(64, 32, 64, 8, 5, 1, fp8_dot=True),
    "swapped dots": replace(ROWS_64, swap=True),
}


@pytest.mark.gpu
def test_gpu_64_row_variants_isolate_the_fault() -> None:
    """`test_gpu_kimi_shapes_32k[64]`'s batch (32768 / 17 / 4099 / 20000 tokens) through `ISOLATING`'s
    tiles, four slices and one: each within 3e-2 of the emulation (that test's drift bound). On failure
    the table (drift per sequence, largest |out|) tells which suspects carry the fault."""
    ctx = [32768, 17, 4099, 20000]
    batch = gpu_batch(len(ctx), ctx, FP8, H=64)
    emulations: dict[tuple[int, int], torch.Tensor] = {}
    table, failed = [], []
    for name, tiles in ISOLATING.items():
        for splits in (4, 1):
            key = (tiles.block_n, splits)
            if key not in emulations:
                emulations[key] = fp8_dot_emulation(batch, *key)
            emulated = emulations[key]
            poison_allocator()
            out = mla_decode(**batch, tiles=tiles, num_splits=splits).float()
            per_seq = " ".join(f"{rel_err(out[b], emulated[b]):.2e}" for b in range(len(ctx)))
            drift = rel_err(out, emulated)
            line = f"{name:<16} {tiles.label():<26} x{splits}: drift {drift:.2e} ({per_seq}) "
            table.append(line + f"max|out| {float(out.abs().max()):.3g}")
            if not (out.isfinite().all() and drift < 3e-2):
                failed.append(name)
    assert not failed, "\n".join([f"failed: {failed}", *table])


@pytest.mark.gpu
def test_gpu_prefill_variants_isolate_the_fault() -> None:
    """`test_gpu_prefill_chunk_through_dot_tiles`' chunks (8 heads: 8 queries x 8 heads a tile) through
    the default prefill tile and the same suspects dropped (launcher overrides), the launcher's slices
    and one: within u of the exact op; on failure, per variant, each sequence's error and zero rows."""
    ctx, q_lens = [4099, 700, 33], [300, 64, 1]
    batch = gpu_batch(len(ctx), ctx, FP8, H=8)
    g = torch.Generator(device="cuda").manual_seed(4)
    q = (torch.randn(sum(q_lens), 8, 576, device="cuda", generator=g) / 4).to(torch.bfloat16)
    args = dict(batch, q=q, query_start=query_starts(q_lens).cuda())
    ref = mla_attention_ref(**{**args, "tag_mismatch": args["tag_mismatch"].clone()}).float()
    rows = [b for b, n in enumerate(q_lens) for _ in range(n)]
    overrides = {
        "as FP8_DOT_TILES": {}, "no pipelining": {"num_stages": 1}, "one warpgroup": {"num_warps": 4},
        "32-token steps": {"block_n": 32, "num_stages": 5},
    }  # fmt: skip
    table, failed = [], []
    for name, kw in overrides.items():
        for splits in (None, 1):
            poison_allocator()
            out = mla_prefill(**args, fp8_dot=True, num_splits=splits, **kw).float()
            err = rel_err(out, ref)
            table.append(
                f"{name} {kw} slices {splits or 'launcher'}: err {err:.3g}\n{differences(out, ref, rows)}"
            )
            if not (out.isfinite().all() and err < E4M3_U):
                failed.append((name, splits))
    assert not failed, "\n".join([f"failed: {failed}", *table])
