"""The models' calls into the decode path's multi-tensor launches, checked on the CPU: the Triton
launchers of rope (up to four tensors), row norms (up to three) and kv_write (two caches) run under
TRITON_INTERPRET=1 in place of the references the CPU dispatch picks, over the strided views the
models pass (slices of the fused projection, of the latent line, of the absorbed query), and a paged
prefill plus decode computes what the reference path does, in float32 (the norms' sums in another
order: within 1e-4). The GPU runs them for real in test_models_cuda.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from backend.models import deepseek_v3  # noqa: E402
from backend.models.layers import rotary, step  # noqa: E402
from backend.models.loader import load_model  # noqa: E402
from backend.tools.random_checkpoint import KINDS, write_random_checkpoint  # noqa: E402
from kernels.kv_write import KvWriteArgs  # noqa: E402
from kernels.kv_write_triton import kv_write_triton  # noqa: E402
from kernels.rope import RopeArgs  # noqa: E402
from kernels.rope_triton import rope_many_triton  # noqa: E402
from kernels.row_norms import RowNormsArgs  # noqa: E402
from kernels.row_norms_triton import row_norms_triton  # noqa: E402
from tests.backend.conformance import prompts  # noqa: E402
from tests.backend.paged_driver import PagedDriver  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    # the launchers take the CPU model's tensors only under the interpreter (a CUDA machine compiles them)
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU only: test_models_cuda.py runs the kernels on CUDA"
    ),
]


CALLS: dict[str, set[int]] = {}  # op → the tensors (norms, caches) its launches took


def rope_triton_op(a: RopeArgs) -> list[torch.Tensor]:
    CALLS.setdefault("rope", set()).add(len(a.xs))
    outs = list(a.outs) if a.outs is not None else [None] * len(a.xs)
    return rope_many_triton(list(a.xs), a.cos, a.sin, a.dim, a.is_interleaved, outs)


def kv_write_triton_op(a: KvWriteArgs) -> None:
    CALLS.setdefault("kv_write", set()).add(1 + (a.second is not None))
    kv_write_triton(
        a.cache, a.values, a.slot_mapping, a.scale, a.page_tags, a.token_expected_tags, a.token_seq,
        a.tag_mismatch, a.second,
    )  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_triton_launches_match_the_references_in_a_model(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_random_checkpoint(kind, tmp_path / kind, dtype=torch.float32)
    loaded = load_model(path, dtype=torch.float32)
    ps = prompts(loaded.config.vocab_size, (9, 70))  # past glm-5.2's index_topk (64): steps that score
    _, expected = PagedDriver(loaded.model).prefill(ps, 16)
    greedy = PagedDriver(loaded.model).greedy(ps, 3, 16)
    monkeypatch.setattr(rotary, "rope", rope_triton_op)
    monkeypatch.setattr(step, "kv_write", kv_write_triton_op)
    monkeypatch.setattr(deepseek_v3, "row_norms", row_norms_triton_op)
    CALLS.clear()
    driver = PagedDriver(loaded.model)
    _, got = driver.prefill(ps, 16)
    assert not driver.last_mismatch.any()
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert PagedDriver(loaded.model).greedy(ps, 3, 16) == greedy
    # what each model's layers launch: one rope and one kv_write a layer, one norm launch an MLA layer
    assert LAUNCHES[kind] == CALLS, CALLS


LAUNCHES = {
    # MLA: q_a and kv_a norms; q_pe and k_pe; the latent
    "kimi-k2.6": {"row_norms": {2}, "rope": {2}, "kv_write": {1}},
    # + the indexer's key LayerNorm, key and query (3 tensors while no sequence is longer than
    # index_topk: no query, 4 once one is), index_k beside the latent
    "glm-5.2": {"row_norms": {3}, "rope": {3, 4}, "kv_write": {2}},
    # GQA: q and k; K and V
    "glm-4.5": {"rope": {2}, "kv_write": {2}},
}


def row_norms_triton_op(a: RowNormsArgs) -> list[torch.Tensor]:
    CALLS.setdefault("row_norms", set()).add(len(a.norms))
    return row_norms_triton(list(a.norms))
