"""Page reservations and tag-carrying steps over greedy speculative runs (CPU, tiny checkpoint).

PYTHONPATH=$PWD .venv/bin/python lab/diagnostics/r8_draft_tail_pages.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from backend.models.loader import load_model
from tests.backend.engine.test_speculative import engine_for, prompts
from tests.backend.engine_helpers import request
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

root = Path(tempfile.mkdtemp())
model = load_model(
    add_mtp_layers(make_tiny("deepseek_v3", root / "m")), dtype=torch.float32, num_mtp_layers=1
)
engine = engine_for(model, 3, speculative_adaptive=False)
bm = engine.block_manager
take = bm.take_tag_updates
carried = [0]


def taking():  # noqa: ANN202
    updates = take()
    carried[0] += bool(updates)
    return updates


bm.take_tag_updates = taking  # type: ignore[method-assign]
ps = prompts(4, model.config.vocab_size, seed=4)
for i, p in enumerate(ps):
    engine.add_request(request(f"r{i}", p, max_tokens=60))
window_pages = sum(bm.num_pages_for(len(p) + 60) for p in ps)
steps = greedy_with_updates = 0
while engine.has_unfinished:
    g, before = engine.spec.num_greedy_steps, carried[0]
    engine.step()
    steps += 1
    greedy_with_updates += engine.spec.num_greedy_steps > g and carried[0] > before
print(
    f"steps={steps} greedy={engine.spec.num_greedy_steps} greedy_with_tag_updates={greedy_with_updates}"
    f" steps_with_tag_updates={carried[0]} allocations={bm.stats.num_allocations}"
    f" window_pages={window_pages}"
)
