"""A greedy verify's tail (`kernels/verify_accept.py`): the two-launch kernel against the torch
reference (under TRITON_INTERPRET=1 in CI, on the GPU through the device tool), and the reference
against the acceptance written out by hand."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.verify_accept import VerifyAcceptArgs, verify_accept_ref  # noqa: E402
from kernels.verify_accept_triton import slices_per_row, verify_accept_triton  # noqa: E402
from tests.backend.engine.test_speculative import loaded  # noqa: E402

__all__ = ["loaded"]  # the fixture

DEV = "cuda" if torch.cuda.is_available() else "cpu"
S = 12  # backend.engine.speculative.greedy.MAX_BANNED
# the interpreter reads a runtime loop bound as a 1-element array (numpy's deprecation)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def verify(B: int, L: int, V: int, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """B sequences of L rows: logits with ties (values on a coarse grid), guards banning 0-12 ids a
    row (-1 padded, repeats and the argmax among them), drafts that match the masked argmax for a
    random number of leading rows, then differ."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-40, 40, (B * L, V), generator=g).float() / 8).to(dtype)  # ties likely
    guards = torch.full((B, L, S), -1, dtype=torch.int64)
    for b in range(B):
        for i in range(L):
            n = int(torch.randint(0, S + 1, (1,), generator=g))
            ids = torch.randint(0, V, (n,), generator=g)
            if n and torch.rand(1, generator=g) < 0.5:
                ids[0] = int(logits[b * L + i].float().argmax())  # ban the row's best
            guards[b, i, :n] = ids
    query_start = torch.arange(B + 1, dtype=torch.int32) * L
    no_drafts = torch.zeros(B * L, dtype=torch.int64)
    best = verify_accept_ref(VerifyAcceptArgs(logits.float().clone(), guards, no_drafts, query_start)).targets
    ids = torch.randint(0, V, (B, L), generator=g)
    for b in range(B):
        agree = int(torch.randint(0, L, (1,), generator=g))
        ids[b, 1 : agree + 1] = best[b, :agree]  # d_{i+1} = t_i for the first `agree` drafts
        if agree + 1 < L:
            ids[b, agree + 1] = (best[b, agree] + 1) % V  # then one that differs
    return dict(
        logits=logits,
        guards=guards,
        input_ids=ids.reshape(-1),
        query_start=query_start,
    )


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_the_acceptance_by_hand(impl: str) -> None:
    """Masked rows' first maximum (a row with every id banned: 0, as torch's argmax), the leading
    drafts that equal it, the last accepted row."""
    logits = torch.tensor(
        [[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 0.0], [0.0, 0.0, 0.0, 2.0],  # sequence 0
         [1.0, 1.0, 1.0, 1.0], [9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 7.0, 0.0]]  # sequence 1
    )  # fmt: skip
    guards = torch.full((2, 3, S), -1, dtype=torch.int64)
    guards[0, 1, 0] = 0  # row 1's 5.0 at id 0 banned: id 2 remains
    guards[1, 0, :4] = torch.tensor([0, 1, 2, 3])  # every id banned
    ids = torch.tensor([7, 1, 2, 7, 0, 9])  # sequence 0: d1 == t0, d2 == t1; sequence 1: d1 == t0, d2 != t1
    query_start = torch.tensor([0, 3, 6], dtype=torch.int32)
    if impl == "reference":
        got = verify_accept_ref(VerifyAcceptArgs(logits, guards, ids, query_start))
        targets, accepted, last = got.targets, got.accepted, got.last
    else:
        targets, accepted, last = verify_accept_triton(
            *(t.to(DEV) for t in (logits, guards, ids, query_start))
        )
    assert targets.tolist() == [[1, 2, 3], [0, 0, 2]]
    assert accepted.tolist() == [2, 1] and last.tolist() == [2, 4]


@pytest.mark.parametrize(
    ("B", "L", "V", "dtype"),
    [
        (1, 4, 5000, torch.float32),  # one sequence: the vocabulary in slices
        (3, 2, 700, torch.bfloat16),  # a vocabulary under a block
        (40, 4, 2100, torch.float32),  # many rows: one slice a row
        (2, 1, 300, torch.float32),  # k = 0: no draft, a = 0
    ],
)
def test_two_launches_are_the_reference(B: int, L: int, V: int, dtype: torch.dtype) -> None:
    b = verify(B, L, V, seed=B * 100 + L, dtype=dtype)
    want = verify_accept_ref(
        VerifyAcceptArgs(b["logits"].clone(), b["guards"], b["input_ids"], b["query_start"])
    )
    on = {k: v.to(DEV) for k, v in b.items()}
    logits_before = on["logits"].clone()
    targets, accepted, last = verify_accept_triton(
        on["logits"], on["guards"], on["input_ids"], on["query_start"]
    )
    assert torch.equal(targets.cpu(), want.targets) and torch.equal(accepted.cpu(), want.accepted)
    assert torch.equal(last.cpu(), want.last) and last.dtype == torch.int64
    assert torch.equal(on["logits"], logits_before)  # the kernel leaves the logits as they were
    assert sorted(set(want.accepted.tolist())) != [0] or L == 1  # some drafts accepted


def test_a_row_of_the_verify_buffer_reads_only_its_own_columns() -> None:
    """The logits of a captured graph are a view of a wider buffer (row stride > V): the columns
    past V never count."""
    b = verify(2, 3, 1500, seed=7)
    wide = torch.full((6, 2100), 1e9, device=DEV)
    wide[:, :1500] = b["logits"].to(DEV)
    got = verify_accept_triton(
        wide[:, :1500], *(b[k].to(DEV) for k in ("guards", "input_ids", "query_start"))
    )
    want = verify_accept_ref(
        VerifyAcceptArgs(b["logits"].clone(), b["guards"], b["input_ids"], b["query_start"])
    )
    assert torch.equal(got[0].cpu(), want.targets) and torch.equal(got[1].cpu(), want.accepted)


def test_the_slices_spread_a_few_rows_over_the_device() -> None:
    """Whole blocks a slice, none empty: one GLM-5 sequence at k = 3 (4 rows of 154,880 ids) in
    51 slices of 3,072 (the 66 wanted, rounded to blocks), a large batch in few."""
    assert slices_per_row(4, 154_880) == (51, 3072)
    assert slices_per_row(256, 154_880) == (2, 77_824)
    assert slices_per_row(4, 2_900) == (3, 1024)  # never more slices than blocks of the vocabulary
    assert slices_per_row(1_000, 2_900) == (1, 3072)
    for rows, vocab in ((4, 154_880), (1, 1), (3, 1025), (64, 163_840), (2, 20_001)):
        p, size = slices_per_row(rows, vocab)
        assert (p - 1) * size < vocab <= p * size and size % 1024 == 0


def test_the_guards_of_a_verify_graph_are_a_slice_of_a_wider_buffer() -> None:
    """A verify graph for k drafts under `--speculative mtp:K` reads its guards as `[:B, :k + 1]` of
    a `[n, K + 1, S]` buffer: not contiguous for k < K (a contiguity check there refused every
    greedy graph at K >= 2, a review found)."""
    b = verify(3, 2, 1500, seed=11)
    wide = torch.full((5, 4, S), -1, dtype=torch.int64)
    wide[:3, :2] = b["guards"]
    guards = wide[:3, :2].to(DEV)
    assert not guards.is_contiguous()
    got = verify_accept_triton(b["logits"].to(DEV), guards, b["input_ids"].to(DEV), b["query_start"].to(DEV))
    want = verify_accept_ref(
        VerifyAcceptArgs(b["logits"].clone(), b["guards"], b["input_ids"], b["query_start"])
    )
    assert torch.equal(got[0].cpu(), want.targets) and torch.equal(got[1].cpu(), want.accepted)
    assert (b["guards"] >= 0).any()


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_graphs_capture_and_decode_with_the_kernel(
    loaded: dict[str, Any], k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's greedy steps over the verify graphs' buffers with the two-launch kernel in place
    of the reference (the CUDA branch, here under the interpreter): every (k, bucket) graph keeps its
    greedy replay at `mtp:K` (the slices of the guards buffer they read), and the tokens are plain
    decoding's."""
    from backend.engine.speculative import greedy
    from kernels.verify_accept import VerifyAccept
    from tests.backend.engine.test_speculative import engine_for, prompts
    from tests.backend.engine.test_speculative_greedy import graphed
    from tests.backend.engine_helpers import request, run_all

    def kernel(args: VerifyAcceptArgs) -> VerifyAccept:
        return VerifyAccept(*verify_accept_triton(args.logits, args.guards, args.input_ids, args.query_start))

    monkeypatch.setattr(greedy, "verify_accept", kernel)
    model = loaded["deepseek_v3"]
    reqs = [
        request(f"r{i}", p, max_tokens=12 + i)
        for i, p in enumerate(prompts(2, model.config.vocab_size, seed=k))
    ]
    engine = graphed(model, k, cuda_graph_batch_sizes=(1, 2))
    graphs = engine.runner.spec_forwards.graphs
    assert graphs is not None and graphs.has_greedy, graphs.greedy_disabled_reason if graphs else None
    got = run_all(engine, reqs)
    assert engine.spec is not None and engine.spec.num_greedy_steps > 0
    plain = run_all(engine_for(model, 0), reqs)
    assert {rid: r.token_ids for rid, r in got.items()} == {rid: r.token_ids for rid, r in plain.items()}
