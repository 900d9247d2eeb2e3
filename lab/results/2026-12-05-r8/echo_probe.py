"""Does a model copy a value said once in the prompt (the copy drills' own form, fresh values)?

    PYTHONPATH=$PWD python lab/results/2026-12-05-r8/echo_probe.py FAMILY FOLDER [FOLDER...]

Teacher-forced on 100 fresh drills (seed 5, values never in training): the share whose value tokens
in the answer are all the model's top-1, and the share of the value's later tokens that are.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import torch

from models.recipes.build import for_family
from models.recipes.everyday import ECHO, echo
from models.recipes.render import Renderer
from models.recipes.train import load_model

ASKS = [re.compile(re.escape(a).replace(re.escape("{v}"), "(.+)") + "$") for a, *_ in ECHO]


@torch.no_grad()
def main() -> None:
    family, folders = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    rng = random.Random(5)
    drills = [for_family({**echo(rng), "seed": i}, family) for i in range(100)]  # GLM: some thinking-off
    for folder in folders:
        renderer, model = Renderer(Path(folder)), load_model(family, Path(folder)).eval()
        whole = later = later_n = 0
        for row in drills:
            (ex,) = renderer.examples(row)
            ids = torch.tensor([ex.token_ids])
            top = model(input_ids=ids, use_cache=False).logits[0, :-1].argmax(-1).tolist()
            start = ex.loss_mask.index(True)
            target = ex.token_ids[start:]
            right = [top[start - 1 + k] == t for k, t in enumerate(target)]
            ask = row["messages"][0]["content"]
            value = next(m.group(1) for m in (a.match(ask) for a in ASKS) if m)
            text = renderer.tokenizer.decode(target)
            at = text.find(value)
            inside, pos = [], 0
            for k in range(len(target)):
                end = len(renderer.tokenizer.decode(target[: k + 1]))
                if end > at and pos < at + len(value):
                    inside.append(k)
                pos = end
            whole += all(right[k] for k in inside) if inside else 0
            later += sum(right[k] for k in inside[1:])
            later_n += max(len(inside) - 1, 0)
        print(f"{folder}: value copied {whole}/100; later tokens top-1 {later}/{later_n}")


if __name__ == "__main__":
    main()
