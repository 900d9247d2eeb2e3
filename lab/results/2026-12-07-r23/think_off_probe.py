"""Session 23: with reasoning off, how often the nano models still write a think marker
(`PYTHONPATH=.:lab/results/2026-12-07-r23 python think_off_probe.py glm-5.2-nano kimi-k2.6-nano`)."""

import sys

from unoffered_probe import prepared

from schemas.backend import Reasoning
from tests.backend.engine.test_reasoning_guard import EVERYDAY
from tests.backend.engine_helpers import run_all

PROMPTS = [
    *EVERYDAY,
    "What's the weather in Paris?",
    "Explain why the sky is blue.",
    "Think step by step: what is 17+25?",
]

for name in sys.argv[1:]:
    served, engine, reqs = prepared(name, PROMPTS, reasoning=Reasoning(enabled=False))
    think = served.think
    res = run_all(engine, reqs)
    n = 0
    for r, t in zip(reqs, PROMPTS, strict=True):
        ids = res[r.request_id].token_ids
        if think and (think.start_id in ids or think.end_id in ids):
            n += 1
            print(f"  {t!r}: {served.tokenizer.decode(ids)[:120]!r}")
    print(name, n, "of", len(PROMPTS), "wrote think markers with reasoning off")
