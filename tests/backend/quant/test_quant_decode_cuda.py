"""A quantized model's decode step on CUDA reads its quantized weights through the kernels (no weight
is dequantized per step, issue 24) and computes what the same model with every quantized Linear
dequantized once to a dense BF16 Linear computes, within bf16 rounding (device tool only).

The routers are pinned to the first top_k experts by their selection bias (used for selection only),
so a last-bit difference between the two paths cannot flip an expert choice and fail the comparison
for a reason that is not the kernels'.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from backend.models.layers.linear import Linear
from backend.quant.linear import Fp8Linear, Int4Linear
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.weights import build_random_model
from tests.backend.paged_driver import PagedDriver

pytestmark = pytest.mark.gpu

DEQUANTIZERS = (
    "dequantize_int4",
    "dequantize_fp8",
    "dequantize_fp8_block",
    "dequantize_fp8_channel",
    "int4_dequant_triton",
)


def count_dequantize(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every dequantizing function, wherever a Kumo module imported it, and the Linears' own
    `dequantized_weight`, wrapped to count its calls."""
    calls: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(("backend", "kernels")):
            continue
        for attr in DEQUANTIZERS:
            fn = getattr(module, attr, None)
            if callable(fn):
                monkeypatch.setattr(module, attr, counted(f"{module_name}.{attr}", fn))
    for cls in (Int4Linear, Fp8Linear):
        monkeypatch.setattr(
            cls, "dequantized_weight", counted(f"{cls.__name__}.dequantized_weight", cls.dequantized_weight)
        )
    return calls


@torch.no_grad()
def dequantized_copy(model: nn.Module) -> nn.Module:
    """The model with every quantized Linear replaced by a BF16 Linear of its dequantized weight."""
    dense_model = copy.deepcopy(model)
    for name, m in list(dense_model.named_modules()):
        if isinstance(m, Int4Linear | Fp8Linear):
            dense = Linear(m.in_features, m.out_features, dtype=m.dense_dtype, bias=m.bias is not None,
                           out_range=m.out_range, in_range=m.in_range, shard=m.shard).to(next(m.buffers()).device)  # fmt: skip
            dense.weight.copy_(m.dequantized_weight(m.dense_dtype))
            if m.bias is not None:
                dense.bias.copy_(m.bias)  # type: ignore[union-attr]
            parent, _, child = name.rpartition(".")
            setattr(dense_model.get_submodule(parent), child, dense)
    return dense_model


def pin_routers(model: nn.Module, top_k: int) -> None:
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()
            buf[:top_k] = 10.0


@pytest.mark.parametrize(
    ("fmt", "fp8_method"),
    [("int4-all", "fp8-block"), ("fp8-all", "fp8-block"), ("fp8-all", "fp8-channel"), ("int4", "fp8-block")],
)
def test_decode_step_runs_no_dequantize_and_matches_dense(
    fmt: str, fp8_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    geometry = make_geometry("glm-5.2", 3, tiny=True)
    model = build_random_model(geometry, fmt, device="cuda", fp8_method=fp8_method)  # type: ignore[arg-type]
    pin_routers(model, int(geometry.text["num_experts_per_tok"]))
    num_quant = sum(isinstance(m, Int4Linear | Fp8Linear) for m in model.modules())
    assert num_quant > 0 if fmt.endswith("-all") else num_quant == 0
    dense = dequantized_copy(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (17, 33)]
    quant_driver, dense_driver = PagedDriver(model, device="cuda"), PagedDriver(dense, device="cuda")
    seqs_q, logits_q = quant_driver.prefill(prompts, 16)
    seqs_d, _ = dense_driver.prefill(prompts, 16)
    for sq, sd, lg in zip(seqs_q, seqs_d, logits_q, strict=True):
        sq.tokens.append(int(lg[-1].argmax()))
        sd.tokens.append(sq.tokens[-1])
    calls = count_dequantize(monkeypatch)
    for _ in range(3):  # decode steps: one token per sequence
        got = quant_driver.run(seqs_q, [1, 1])
        assert not calls, dict(calls)
        want = dense_driver.run(seqs_d, [1, 1])
        for g, w, sq, sd in zip(got, want, seqs_q, seqs_d, strict=True):
            assert g.isfinite().all()
            err = float((g.double() - w.double()).norm() / w.double().norm())
            assert err < 2e-2, err
            sq.tokens.append(int(g[-1].argmax()))
            sd.tokens.append(sq.tokens[-1])
    assert not quant_driver.last_mismatch.any()


def test_absorbed_mla_copies_no_weight_per_step() -> None:
    """MLA's absorbed products read W_UK / W_UV as views of the dense kv_b_proj (made dense once at
    load): a decode step copies neither (the profiler's copy and clone ops see no weight-sized input)."""
    geometry = make_geometry("glm-5.2", 3, tiny=True)
    model = build_random_model(geometry, "int4-all", device="cuda")
    attn = model.attentions()[0]  # type: ignore[operator]
    weight_shapes = [[attn.num_local_heads, attn.N, attn.R], [attn.num_local_heads, attn.V, attn.R],
                     [attn.num_local_heads, attn.R, attn.V], [attn.num_local_heads, attn.R, attn.N]]  # fmt: skip
    driver = PagedDriver(model, device="cuda")
    seqs, logits = driver.prefill([[1, 2, 3, 4, 5]], 16)
    seqs[0].tokens.append(int(logits[0][-1].argmax()))
    driver.run(seqs, [1])  # one eager decode step before the profiled one
    seqs[0].tokens.append(7)
    with torch.profiler.profile(record_shapes=True, acc_events=True) as prof:
        driver.run(seqs, [1])
    copies = [
        (e.key, e.input_shapes)
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in ("aten::copy_", "aten::clone", "aten::contiguous")
        and any(shape in weight_shapes for shape in e.input_shapes)
    ]
    assert not copies, copies
