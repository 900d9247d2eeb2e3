"""Prints the one-user replay (tests/backend/engine/test_draft_policy_replay.py) per run: speedup
over plain decoding and drafting steps, for tool-call and chat acceptance, a few seeds."""

from __future__ import annotations

import sys

sys.path.insert(0, ".")
from tests.backend.engine.test_draft_policy_replay import CHAT, TOOL_CALL, bench  # noqa: E402

for name, acceptance in [("tool-call", TOOL_CALL), ("chat", CHAT)]:
    for seed in range(5):
        plain, fixed, runs = bench(acceptance, seed)
        cells = " ".join(f"{r.rate / plain:.2f}({r.num_drafting}/{len(r.ks)})" for r in runs)
        print(f"{name:9} seed {seed} fixed {fixed / plain:.2f} runs {cells}")
