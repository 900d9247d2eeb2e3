"""The runner's step inputs, from the incremental page tables, equal the ones a step used to build
token by token and page by page from each sequence's `PageRef`s, on every step of random workloads
(chunked prefill, decode, preemption, prefix hits, prompt log-probs, images, scribbled entries)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.scheduler import ScheduledSeq
from schemas.backend import ImageSpan
from tests.backend.engine_faults import FaultInjector
from tests.backend.engine_helpers import TENANT_A, TENANT_B, make_engine, prompt_of, request


def reference(scheduled: list[ScheduledSeq], S: int) -> dict[str, Any]:
    """The step's inputs as the list-building runner made them (ForwardBatch's padding: 0 / -1)."""
    ids, pos, slots, seq_index, query_start, seq_lens, logits, pages, tags = ([] for _ in range(9))
    query_start.append(0)
    for b, s in enumerate(scheduled):
        seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        base = len(ids)
        ids += seq.token_ids[start : start + n]
        pos += range(start, start + n)
        slots += [seq.page_table[p // S].page_id * S + p % S for p in range(start, start + n)]
        seq_index += [b] * n
        query_start.append(len(ids))
        seq_lens.append(start + n)
        refs = list(seq.page_table)[: -(-(start + n) // S)]
        pages.append([r.page_id for r in refs])
        tags.append([r.tag for r in refs])
        if seq.wants_prompt_logprobs:
            first = max(start, len(seq.prompt_logprobs) - 1)
            logits += [base + p - start for p in range(first, min(start + n, seq.num_prompt_tokens - 1))]
        if s.needs_sample:
            logits.append(base + n - 1)
    width = max(len(p) for p in pages)
    return {
        "input_ids": ids,
        "positions": pos,
        "slots": slots,
        "seq_index": seq_index,
        "query_start": query_start,
        "seq_lens": seq_lens,
        "logits_indices": logits,
        "page_table": [p + [0] * (width - len(p)) for p in pages],
        "expected_tags": [t + [-1] * (width - len(t)) for t in tags],
    }


def checked(engine: Engine) -> list[int]:
    """Compare every step's plan with `reference`; returns the number of steps checked per kind."""
    planner, counts = engine.runner.planner, [0, 0]
    plan = planner.plan

    def plan_and_check(scheduled: list[ScheduledSeq]) -> Any:
        host, rows = plan(scheduled)
        want = reference(scheduled, engine.config.page_size)
        for name, values in want.items():
            got: np.ndarray = getattr(host, name)
            assert got.tolist() == values, name
        assert host.page_table.dtype == np.int32 and host.expected_tags.dtype == np.int64
        B = len(scheduled)
        is_decode = len(want["input_ids"]) == B and want["logits_indices"] == list(range(B))
        assert host.is_pure_decode == (is_decode and not host.image_rows)
        counts[host.is_pure_decode] += 1
        return host, rows

    planner.plan = plan_and_check  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_every_step_plans_what_the_page_refs_say(seed: int) -> None:
    rng = random.Random(seed)
    is_tight = seed % 2 == 0  # a pool this small preempts
    engine = make_engine(num_pages=8 if is_tight else 64, max_num_batched_tokens=rng.choice((16, 40)))
    counts = checked(engine)
    injector = FaultInjector(engine)
    pending = []
    for i in range(14):
        length = rng.randrange(1, 45)
        kw: dict[str, Any] = {
            "max_tokens": rng.randrange(2, 14),
            "temperature": rng.choice((0.0, 0.9)),
            "seed": i,
        }
        if rng.random() < 0.2:
            kw |= {"prompt_logprobs": True}
        req = request(
            f"r{i}", prompt_of(rng.randrange(4), length), tenant=rng.choice((TENANT_A, TENANT_B)), **kw
        )
        embeds = None
        if length > 6 and rng.random() < 0.3:
            req.image_spans = [ImageSpan(offset=2, length=4, image_hash=f"{i:02x}" * 32)]
            embeds = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        pending.append((req, embeds))
    step = 0
    while pending or engine.has_unfinished:
        while pending and rng.random() < 0.4:
            req, embeds = pending.pop(0)
            engine.add_request(req, image_embeds=embeds)
        running = [s for s in engine.scheduler.running if len(s.page_table) > 1]
        if step % 17 == 5 and len(running) >= 2:  # scribbled entries are planned as written
            injector.corrupt_page_table_entry(running[0].request_id, running[1].request_id)
        engine.step()
        step += 1
        assert step < 1000
    assert counts[0] > 0 and counts[1] > 0  # mixed steps and pure-decode steps both checked
    assert engine.stats.preemptions > 0 or not is_tight
