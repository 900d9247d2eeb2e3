"""Teacher-forced: of each string argument's tokens in the call, is the first one top-1, and the later ones?

PYTHONPATH=$PWD python lab/results/2026-12-04-r6/recipe26/first_token.py SETS_DIR FOLDER...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tf_score import spans, tool_row  # noqa: E402

from models.recipes.render import Renderer  # noqa: E402
from models.recipes.train import load_model  # noqa: E402


@torch.no_grad()
def main(sets: Path, folders: list[str]) -> None:
    items = [json.loads(x) for x in (sets / "heldout-tools.jsonl").read_text().splitlines()]
    for folder in map(Path, folders):
        renderer, model = Renderer(folder), load_model("glm", folder).eval()
        first = later = n_first = n_later = 0
        for item in items:
            (ex,) = renderer.examples(tool_row(item))
            top = (
                model(input_ids=torch.tensor([ex.token_ids]), use_cache=False)
                .logits[0, :-1]
                .argmax(-1)
                .tolist()
            )
            start = ex.loss_mask.index(True)
            target = ex.token_ids[start:]
            right = [top[start - 1 + k] == t for k, t in enumerate(target)]
            text, span = renderer.tokenizer.decode(target), spans(renderer.tokenizer, target)
            for value in item["expected"]["arguments"].values():
                if not isinstance(value, str) or len(value) <= 3:
                    continue
                at = text.rfind(value)
                inside = [k for k, (a, b) in enumerate(span) if b > at and a < at + len(value)]
                first, n_first = first + right[inside[0]], n_first + 1
                later, n_later = later + sum(right[k] for k in inside[1:]), n_later + len(inside) - 1
        print(json.dumps({"model": str(folder), "first token top-1": [first, n_first],
                          "later tokens top-1": [later, n_later]}))  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
