"""`plan_greedy`'s parts timed inside the engine (a copy of it with timestamps between its lines), over
150 greedy steps: `OMP_NUM_THREADS=1 PYTHONPATH=. python <this file> glm`. One run."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch

import backend.engine.speculative.decoder as decoder
from backend.engine.forward_batch import HostBatch
from backend.engine.speculative.greedy import guard_rows
from lab.diagnostics.spec_host import MODELS, Meter, engines, measure

NAMES = ["tokens", "starts/rows", "positions+gather", "slots", "guard_rows", "HostBatch"]
spent = [0.0] * len(NAMES)
calls = [0]


def plan_greedy(rows: list[Any], k: int, block_manager: Any, vocab_size: int) -> HostBatch:
    marks = [time.perf_counter()]
    L, S, B = k + 1, block_manager.page_size, len(rows)
    seqs = [r.sched.seq for r in rows]
    tokens = np.array([[s.token_ids[-1], *r.drafts] for s, r in zip(seqs, rows, strict=True)], dtype=np.int64)
    marks.append(time.perf_counter())
    per_seq = [
        (
            s.num_computed_tokens,
            s.page_table.row,
            s.page_table.length,
            (s.num_computed_tokens + L + k - 2) // S + 1,
        )
        for s in seqs
    ]
    starts, table_rows, lengths, num_pages = np.array(per_seq, dtype=np.int64).T
    marks.append(time.perf_counter())
    positions = starts[:, None] + np.arange(L)
    ids, tags = block_manager.page_tables.gather(table_rows, lengths, num_pages)
    marks.append(time.perf_counter())
    slots = ids[np.arange(B)[:, None], positions // S] * np.int64(S) + positions % S
    rows_of = np.arange(B * L)
    marks.append(time.perf_counter())
    guards = guard_rows([s.guard for s in seqs], [r.drafts for r in rows], vocab_size)
    marks.append(time.perf_counter())
    host = HostBatch(
        input_ids=tokens.reshape(-1), positions=positions.reshape(-1), slots=slots.reshape(-1),
        seq_index=rows_of // L, query_start=np.arange(0, B * L + 1, L, dtype=np.int32),
        seq_lens=(starts + L).astype(np.int32), logits_indices=rows_of, page_table=ids, expected_tags=tags,
        rows_per_seq=L, guards=guards,
    )  # fmt: skip
    marks.append(time.perf_counter())
    for i in range(len(NAMES)):
        spent[i] += marks[i + 1] - marks[i]
    calls[0] += 1
    return host


def main() -> None:
    torch.set_num_threads(1)
    decoder.plan_greedy = plan_greedy  # type: ignore[assignment]
    meter = Meter()
    engine = engines(MODELS[sys.argv[1]], meter, sides=(("greedy", 3),))["greedy"]
    prompt = torch.randint(
        0, engine.runner.vocab_size, (48,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    measure(engine, meter, "greedy", prompt, 8, False)  # warm
    spent[:] = [0.0] * len(NAMES)
    calls[0] = 0
    measure(engine, meter, "greedy", prompt, 150, False)
    for name, seconds in zip(NAMES, spent, strict=True):
        print(f"{name:20s} {1e6 * seconds / calls[0]:8.1f} us")


if __name__ == "__main__":
    main()
