"""Teacher-forced scores of micro GLM checkpoints on held-out items (a measure finer than greedy match).

    PYTHONPATH=$PWD python lab/results/2026-12-04-r6/recipe26/tf_score.py --sets DIR --out OUT.json \
        --variant old=/tmp/r26/micro-old --variant new=/tmp/r26/micro-new

For each held-out tool item, the turn the recipe trains (the `think` draft as GLM's reasoning, then the
call) is rendered with each checkpoint's own template and tokenizer; for each held-out word problem, bare
steps (`12 + 7 = 19`) and `The answer is N.`. Per item: the share of the turn's tokens that are the
model's top-1 choice given the ones before, and for tool items whether each argument value's tokens in
the call are all top-1 (the value copied). Paired differences with a bootstrap 95% interval over items.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from diagnose import arg_kind, problem  # noqa: E402

from models.recipes.everyday import tool_thought  # noqa: E402
from models.recipes.render import Renderer  # noqa: E402
from models.recipes.train import load_model  # noqa: E402


def tool_row(item: dict, family: str = "glm") -> dict:
    name, args = item["expected"]["name"], item["expected"]["arguments"]
    call = {
        "id": f"functions.{name}:0",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }
    turn = {
        "role": "assistant",
        "content": "",
        "reasoning_content": tool_thought(name, args),
        "tool_calls": [call],
    }
    if family != "glm":  # Kimi's training turns carry no reasoning (models.recipes.build.for_family)
        del turn["reasoning_content"]
    return {"messages": [*item["messages"], turn], "tools": item["tools"]}


def arithmetic_row(item: dict) -> dict:
    numbers, ops = problem(item["prompt"])
    value, steps = numbers[0], []
    for n, op in zip(numbers[1:], ops, strict=False):
        result = {"+": value + n, "-": value - n, "*": value * n}[op]
        steps.append(f"{value} {op} {n} = {result}")
        value = result
    assert str(value) == item["answer"], (item, steps)
    turn = {
        "role": "assistant",
        "reasoning_content": ". ".join(steps) + ".",
        "content": f"The answer is {value}.",
    }
    return {"messages": [{"role": "user", "content": item["prompt"]}, turn]}


def spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Character span of each id in the decoded text of `ids`."""
    out, prev = [], 0
    for i in range(len(ids)):
        n = len(tokenizer.decode(ids[: i + 1]))
        out.append((prev, n))
        prev = n
    return out


@torch.no_grad()
def score(folder: Path, rows: list[tuple[str, dict, dict]], family: str) -> list[dict]:
    renderer, model = Renderer(folder), load_model(family, folder).eval()
    out = []
    for kind, item, row in rows:
        (ex,) = renderer.examples(row)
        ids = torch.tensor([ex.token_ids])
        top = model(input_ids=ids, use_cache=False).logits[0, :-1].argmax(-1).tolist()
        start = ex.loss_mask.index(True)
        target = ex.token_ids[start:]
        right = [top[start - 1 + k] == t for k, t in enumerate(target)]
        rec = {"kind": kind, "token_accuracy": sum(right) / len(right), "turn_exact": all(right)}
        if kind == "tools":
            text = renderer.tokenizer.decode(target)
            span = spans(renderer.tokenizer, target)
            for key, value in item["expected"]["arguments"].items():
                at = text.rfind(str(value))  # the call's copy (the reasoning quotes it first)
                inside = [k for k, (a, b) in enumerate(span) if b > at and a < at + len(str(value))]
                rec[f"arg:{arg_kind(item['expected']['name'], key)}"] = at >= 0 and all(
                    right[k] for k in inside
                )
        out.append(rec)
    return out


def interval(diffs: list[float], rng: random.Random) -> tuple[float, float, float]:
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(2000))
    return sum(diffs) / n, means[49], means[1949]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", type=Path, required=True)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--family", choices=["glm", "kimi"], default="glm")
    a = ap.parse_args()
    rows = []
    for line in (a.sets / "heldout-tools.jsonl").read_text().splitlines():
        item = json.loads(line)
        rows.append(("tools", item, tool_row(item, a.family)))
    for line in (a.sets / "heldout-arithmetic.jsonl").read_text().splitlines():
        item = json.loads(line)
        rows.append(("arithmetic", item, arithmetic_row(item)))
    torch.set_num_threads(1)
    scores = {
        name: score(Path(path), rows, a.family) for name, _, path in (v.partition("=") for v in a.variant)
    }
    names = list(scores)
    report: dict = {"variants": dict(v.partition("=")[::2] for v in a.variant), "items": {}, "metrics": {}}
    rng = random.Random(0)
    for kind in ("tools", "arithmetic"):
        idx = [i for i, r in enumerate(rows) if r[0] == kind]
        report["items"][kind] = len(idx)
        keys = sorted({k for n in names for i in idx for k in scores[n][i] if k != "kind"})
        for key in keys:
            have = [i for i in idx if key in scores[names[0]][i]]
            vals = {n: [float(scores[n][i][key]) for i in have] for n in names}
            m: dict = {n: sum(v) / len(v) for n, v in vals.items()}
            m["n"] = len(have)
            if len(names) == 2:
                m["delta"] = interval(
                    [b - c for b, c in zip(vals[names[1]], vals[names[0]], strict=True)], rng
                )
            report["metrics"][f"{kind}/{key}"] = m
    a.out.write_text(json.dumps(report, indent=1))
    for k, m in report["metrics"].items():
        print(k, json.dumps(m))


if __name__ == "__main__":
    main()
