"""Decode steps replayed from CUDA graphs captured with PDL on (`kernels/triton_lib.py`) compute what
the graphs captured with it off compute, bit for bit (device tool only).

GLM 5.2's tiny geometry with every Linear quantized, INT4 or FP8, so that a step runs the W4A16 or FP8
GEMV (one sequence) and tiles (several), the fused MoE's GEMV and, at 16 sequences (4 pairs an
expert), its tiles after `moe_align`, RMSNorm, rotary, the router, kv_write, the DSA indexer's scoring
and selection (contexts past `index_topk`, and the dense graphs below it), sparse MLA and its merge.
PDL changes when a kernel starts, never what it computes: a difference is a kernel that read or wrote
before its wait. The graphs' edges themselves: tests/kernels/test_pdl.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.weights import build_random_model
from kernels import triton_lib
from tests.backend.engine_helpers import Result, prompt_of, request, run_all

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24


@pytest.fixture
def restore_pdl() -> Iterator[None]:
    was = triton_lib.PDL_ENABLED
    yield
    triton_lib.set_pdl(was)


def decode(model: Any, vocab: int, context_window: int, pdl: bool) -> tuple[dict[str, Result], int]:
    """One engine built (its graphs captured) and run with PDL `pdl`: a request alone whose context
    crosses `index_topk` (64) while it decodes, then 16 at once; (results, graph replays). Two graph
    buckets, 1 and 16 (fewer kernel variants to compile: a device call's minutes)."""
    triton_lib.set_pdl(pdl)
    config = EngineConfig.build(
        num_pages=256, page_size=16, max_num_seqs=16, max_num_batched_tokens=512, context_window=256,
        enable_prefix_cache=False, cuda_graphs=True, cuda_graph_batch_sizes=(1, 16),
    )  # fmt: skip
    engine = Engine(
        model, config, vocab_size=vocab, context_window=context_window, model_dtype=torch.bfloat16, device="cuda"
    )  # fmt: skip
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.is_enabled, graphs and graphs.disabled_reason
    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": True, "top_logprobs": 4}
    results = run_all(engine, [request("solo", prompt_of(1, 50, vocab), **sampling)])
    batch = [request(f"r{i}", prompt_of(10 + i, 60 + 3 * i, vocab), **sampling) for i in range(16)]
    return results | run_all(engine, batch), graphs.num_replays


@pytest.mark.parametrize("fmt", ["int4-all", "fp8-all"])
def test_pdl_on_decodes_what_pdl_off_decodes_bit_for_bit(fmt: str, restore_pdl: None) -> None:
    if not triton_lib.pdl_args(torch.device("cuda"))["PDL"]:
        pytest.skip("PDL needs compute capability 9 or later")
    geometry = make_geometry("glm-5.2", 3, tiny=True)
    config = geometry.model_config
    model = build_random_model(geometry, fmt, device="cuda")  # type: ignore[arg-type]
    off, replays_off = decode(model, config.vocab_size, config.max_position_embeddings, pdl=False)
    on, replays_on = decode(model, config.vocab_size, config.max_position_embeddings, pdl=True)
    assert replays_on == replays_off >= MAX_TOKENS  # the decode steps ran from the graphs
    assert all(len(r.token_ids) == MAX_TOKENS and r.error is None for r in on.values())
    assert {k: (r.token_ids, r.logprobs) for k, r in on.items()} == {
        k: (r.token_ids, r.logprobs) for k, r in off.items()
    }
