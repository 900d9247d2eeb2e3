"""Same-input Linears fused after loading (backend/models/layers/fused.py): the fused model against
the unfused one (the checkpoint's modules, each its own product), in every weight format, for the
decoder layers and the MTP draft layer; fewer matmuls per decode step; the stacking rules.

On the CPU every product is the torch reference (dense, or dequantize then dense), row by row the
same sums, so fused and unfused agree to the bit. The conformance against transformers runs
through `load_model`, which fuses: tests/backend/models/test_models_{deepseek_v3,glm_moe_dsa}.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from backend.models.layers.fused import FusedLinear, fuse_group
from backend.models.layers.linear import Linear
from backend.quant.linear import Fp8Linear, Int4Linear
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.weights import build_random_model
from kernels.formats.fp8 import dequantize_fp8, quantize_fp8_block, quantize_fp8_channel
from kernels.formats.int4 import dequantize_int4, quantize_int4
from tests.backend.paged_driver import PagedDriver

FORMATS = [
    ("bf16", "fp8-block"),
    ("int4-all", "fp8-block"),
    ("fp8-all", "fp8-channel"),
    ("int4", "fp8-block"),
]
PROMPTS = [[5, 9, 200, 31, 7, 7, 64], [3, 1, 4, 1, 5]]
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class MatmulCount(TorchDispatchMode):
    """Counts the matmul kernels (aten mm / addmm / bmm / baddbmm) a region dispatches, and the
    output widths of its 2-D products (mm / addmm: a Linear's rows read)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.widths: Counter[int] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in MATMULS:
            self.calls[name] += 1
        if name in ("mm", "addmm"):
            self.widths[out.shape[-1]] += 1
        return out


def models(
    fmt: str, fp8_method: str, index_topk: int = 64, device: str = "cpu"
) -> tuple[nn.Module, nn.Module]:
    """The unfused and the fused tiny GLM-5 (random weights, one MTP layer) in `fmt`."""
    g = make_geometry("glm-5.2", 3, tiny=True)  # one dense layer, two MoE layers, every layer "full"
    g = dataclasses.replace(g, text=g.text | {"index_topk": index_topk})
    return tuple(  # type: ignore[return-value]
        build_random_model(
            g,
            fmt,
            device=device,
            dtype=torch.float32,
            fp8_method=fp8_method,
            num_mtp_layers=1,
            fuse_projections=fuse,
            seed=2,
        )  # fmt: skip
        for fuse in (False, True)
    )


def decode_and_draft(
    model: nn.Module, device: str = "cpu"
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, MatmulCount]:
    """Prefill logits, then one decode step's target and MTP draft logits, and the decode forward's
    matmuls."""
    driver = PagedDriver(model, device=device)
    seqs, logits = driver.prefill(PROMPTS, 4)
    for s, lg in zip(seqs, logits, strict=True):
        s.tokens.append(int(lg[-1].argmax()))
    batch = driver.batch(seqs, [1, 1])
    with MatmulCount() as count:
        target, hidden = model.forward_spec(batch)  # type: ignore[operator]
    # the draft reads the tokens after the decoded positions (their hidden states) at those positions
    after = dataclasses.replace(batch, input_ids=target.argmax(-1))
    draft, _ = model.forward_mtp(after, hidden, 0)  # type: ignore[operator]
    return logits, target, draft, count


def num_linears(model: nn.Module) -> int:
    return sum(isinstance(m, Linear | Int4Linear | Fp8Linear) for m in model.modules())


@pytest.mark.parametrize("index_topk", [64, 4], ids=["dense", "scoring"])
@pytest.mark.parametrize(("fmt", "fp8_method"), FORMATS)
def test_fused_model_equals_the_unfused_one_and_runs_fewer_matmuls(
    fmt: str, fp8_method: str, index_topk: int
) -> None:
    """Contexts of 6-8 tokens: index_topk 64 keeps every key (no step scores, q_b_proj alone is
    asked of its stack with wq_b), 4 scores the decode step and the prefill's later chunks."""
    plain, fused = models(fmt, fp8_method, index_topk)
    a, b = decode_and_draft(plain), decode_and_draft(fused)
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # target decode, MTP draft
    # per decoder layer: q_a + kv_a + wk → 1, and when the step scores q_b + wq_b → 1 (three "full"
    # DSA layers); gate + up → 1 in the dense layer's MLP and in both MoE layers' shared experts
    is_scoring = index_topk < min(map(len, PROMPTS)) + 1
    saved = 3 * 2 + 3 * 1 + (3 if is_scoring else 0)
    assert a[3].calls.total() - b[3].calls.total() == saved, (a[3].calls, b[3].calls)
    # q_b_proj's rows [Hl·(N + Dr)], stacked with wq_b's [Hi·Di]: a step scoring nothing reads q_b's alone
    c = fused.config  # type: ignore[union-attr]
    q_b = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    both = q_b + c.index_n_heads * c.index_head_dim
    assert b[3].widths[both] == (3 if is_scoring else 0) and a[3].widths[both] == 0
    assert b[3].widths[q_b] == a[3].widths[q_b] - (3 if is_scoring else 0)
    # Linears gone in each of four layers (three decoder, one MTP): qkv_a 3 → 1, q_b 2 → 1, gate_up 2 → 1
    assert num_linears(plain) - num_linears(fused) == 4 * (2 + 1 + 1)
    mtp = fused.mtp[0]  # type: ignore[index]
    assert mtp.self_attn.fused_qkv_a_proj is not None and not hasattr(mtp.self_attn, "q_a_proj")
    assert mtp.self_attn.fused_q_b_proj is not None and not hasattr(mtp.self_attn.indexer, "wq_b")
    assert mtp.mlp.shared_experts.gate_up_proj is not None


def test_fusing_twice_changes_nothing() -> None:
    from backend.models.layers.fused import fuse_projections

    _, fused = models("int4-all", "fp8-block")
    assert fuse_projections(fused) == 0


def fp8_block_part(rows: int, gen: torch.Generator, bias: bool = False) -> Fp8Linear:
    w = torch.randn(rows, 256, generator=gen) * 0.05
    b = torch.randn(rows, generator=gen) if bias else None
    part = Fp8Linear.from_weight(w, b, block=(128, 128))
    part.dense_dtype = torch.float32  # as a loaded model's (from_weight says bf16 without a bias)
    return part


def test_fp8_blocks_stack_with_the_ragged_part_last() -> None:
    """kv_a (80 rows, ending inside a block) asked first, then whole-block parts: stacked as
    [256 | 128 | 80], each output its own part's, a view of the one product."""
    gen = torch.Generator().manual_seed(0)
    parts = [fp8_block_part(80, gen, bias=True), fp8_block_part(256, gen), fp8_block_part(128, gen)]
    fused = FusedLinear.of(list(parts))
    assert fused.num_products == 1 and fused.rows == [[256, 128, 80]]
    x = torch.randn(3, 256, generator=gen)
    outs = fused(x)
    for part, out in zip(parts, outs, strict=True):
        assert torch.equal(out, part(x))
    assert outs[0].data_ptr() - outs[1].data_ptr() == (256 + 128) * outs[0].element_size()  # views


def test_two_ragged_fp8_block_parts_are_not_fused() -> None:
    gen = torch.Generator().manual_seed(1)
    owner = nn.Module()
    owner.a, owner.b = fp8_block_part(80, gen), fp8_block_part(48, gen)
    assert not fuse_group(owner, ["a", "b"], "ab") and hasattr(owner, "a")


def test_parts_of_different_formats_stack_by_format() -> None:
    gen = torch.Generator().manual_seed(2)
    dense = [Linear(64, n, dtype=torch.float32) for n in (16, 24)]
    for d in dense:
        d.weight.data.normal_(generator=gen)
    int4 = [Int4Linear.from_weight(torch.randn(n, 64, generator=gen), group_size=32) for n in (8, 40)]
    parts: list[nn.Module] = [int4[0], dense[0], int4[1], dense[1]]
    fused = FusedLinear.of(parts)
    assert fused.num_products == 2
    x = torch.randn(2, 64, generator=gen)
    for part, out in zip(parts, fused(x), strict=True):
        assert torch.equal(out, part(x))


def test_row_parallel_linears_never_stack() -> None:
    parts = [Linear(64, 16, dtype=torch.float32, in_range=(0, 32)) for _ in range(2)]
    assert FusedLinear.of(list(parts)).num_products == 2


def column_part(fmt: str, full: torch.Tensor, out_range: tuple[int, int]) -> tuple[nn.Module, torch.Tensor]:
    """`full` [N, K]'s rows `out_range` as a column-parallel Linear of `fmt`, and the dense weight
    those rows stand for (dequantized from the whole tensor's quantization, as a checkpoint's)."""
    N, K = full.shape
    if fmt == "bf16":
        part: Any = Linear(K, N, dtype=torch.float32, out_range=out_range)
        part.load_param("weight", full)
        return part, full[out_range[0] : out_range[1]]
    if fmt == "int4":
        part = Int4Linear(K, N, group_size=32, out_range=out_range)
        packed, scale = quantize_int4(full, 32)
        part.load_param("weight_packed", packed)
        part.load_param("weight_scale", scale)
        dense = dequantize_int4(packed, scale, K, 32, torch.float32)
    else:
        block = (128, 128) if fmt == "fp8-block" else None
        part = Fp8Linear(K, N, block=block, out_range=out_range)
        q, s = quantize_fp8_channel(full) if block is None else quantize_fp8_block(full, block)
        part.load_param("weight", q)
        part.load_param("weight_scale" if block is None else part.block_scale_name, s)
        dense = dequantize_fp8(q, s, block, torch.float32)
    part.dense_dtype = torch.float32  # as a loaded model's
    return part, dense[out_range[0] : out_range[1]]


@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp8-channel", "fp8-block"])
def test_a_column_parallel_part_stacks_with_a_replicated_one_and_is_asked_alone(fmt: str) -> None:
    """q_b_proj's rows of rank 1 of 2 (256 of 512) stacked with a replicated wq_b (128 rows): both
    outputs from one product; the first alone reads its own rows only (a row-prefix view)."""
    gen = torch.Generator().manual_seed(3)
    (q_b, w_q), (wq_b, w_i) = (column_part(fmt, torch.randn(n, 256, generator=gen) * 0.05, r) for n, r in
                               ((512, (256, 512)), (128, (0, 128))))  # fmt: skip
    fused = FusedLinear.of([q_b, wq_b])
    assert fused.num_products == 1 and fused.rows == [[256, 128]]
    x = torch.randn(3, 256, generator=gen)
    both = fused(x)
    with MatmulCount() as count:
        (alone,) = fused(x, num_parts=1)
    assert count.widths == Counter({256: 1})
    assert torch.equal(both[0], q_b(x)) and torch.equal(both[1], wq_b(x)) and torch.equal(alone, q_b(x))
    for out, w in ((alone, w_q), (both[1], w_i)):  # against the dense weights the rows stand for
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)
