"""Print what a nano model answers to held-out items (issue 26): request, raw output, parsed answer.

PYTHONPATH=. .venv/bin/python lab/diagnostics/heldout_samples.py models/glm-5.2-nano glm heldout-tools 12
"""

import sys
import tempfile
from pathlib import Path

from backend.tools.eval import Evaluator, Variant
from backend.tools.eval_heldout import write_sets
from backend.tools.eval_tasks import ToolItem, call_matches, generation_correct, load_items

model, family, task, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
folder = Path(tempfile.mkdtemp())
path = next(p for p in write_sets(folder, family, count) if p.stem == task)
_, items = load_items(path)
ev = Evaluator([Variant("m", model)], 96, batch_size=64)
requests = [ev.prompts.generation(it) for it in items]
outs = ev.runners[0].generate([r[0].prompt for r in requests], 96, ev.prompts.stop_ids)
for it, r, out in zip(items, requests, outs, strict=True):
    ans = ev.prompts.read(r[0], out)
    ok = (
        call_matches(ans.calls, it.expected)
        if isinstance(it, ToolItem)
        else generation_correct(ans.content, it)
    )
    ask = it.messages[-1].content if getattr(it, "messages", None) else it.prompt
    if not isinstance(ask, str):
        ask = [c for c in ask if getattr(c, "type", "") == "text"]
    print("=" * 60, "OK" if ok else "WRONG")
    print("ASK:", ask)
    print("EXPECT:", getattr(it, "expected", None) or getattr(it, "answer", None))
    print("RAW:", repr(ev.prompts.tokenizer.decode(out.token_ids)))
    print("CALLS:", [(c.name, c.arguments) for c in ans.calls], "CONTENT:", repr(ans.content[:200]))
