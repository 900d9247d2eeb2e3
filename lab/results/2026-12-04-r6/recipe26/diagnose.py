"""Break down what the nano models get wrong on the held-out tool and arithmetic sets.

    PYTHONPATH=$PWD python lab/results/2026-12-04-r6/recipe26/diagnose.py lab/results/2026-12-04-heldout-api/after2-glm-f32.json ...

Reads the per-item replies that lab/diagnostics/heldout_api.py recorded and tallies the error kinds.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

from models.recipes import everyday

TRAIN_STRINGS = set(everyday.CITIES) | set(everyday.NAMES) | set(everyday.MESSAGES) | set(everyday.REMINDERS)
KIND = {"city": "city", "to": "person", "restaurant": "restaurant", "text": "free text", "date": "date",
        "amount": "number", "minutes": "number", "people": "number", "unit": "enum"}  # fmt: skip
STEP = re.compile(r"(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)")
MOVE = [("added", "+"), ("turned up", "+"), ("taken away", "-"), ("thrown out", "-"), ("times larger", "*")]


def arg_kind(name: str, key: str) -> str:
    if name == "convert_currency" and key in ("from", "to"):
        return "currency code"
    return KIND[key]


def value_error(want, got) -> str:
    if got is None:
        return "missing"
    if str(got) == str(want):
        return "ok"
    if isinstance(want, int):
        return "wrong number"
    if got in TRAIN_STRINGS or any(str(got).startswith(f"{k} ") for k in ("Chez",)):
        return "a training value"
    if str(got)[:1].lower() == str(want)[:1].lower():
        return "garbled copy (same first letter)"
    return "other string"


def tools(samples: list[dict]) -> dict:
    verdict: Counter = Counter()
    args: dict[str, Counter] = {}
    words: dict[str, Counter] = {}
    for s in samples:
        want = s["expected"]
        calls = s["calls"]
        if not calls:
            verdict["no call"] += 1
            continue
        name, raw = calls[0]
        if name != want["name"]:
            verdict["wrong tool"] += 1
            continue
        verdict["right tool"] += 1
        try:
            got = json.loads(raw)
        except json.JSONDecodeError:
            got = {}
        for key, value in want["arguments"].items():
            kind = arg_kind(want["name"], key)
            err = value_error(value, got.get(key))
            args.setdefault(kind, Counter())[err] += 1
            if isinstance(value, str) and kind not in ("enum", "currency code"):
                n = len(value.split())
                words.setdefault(f"{n} word{'s' if n > 1 else ''}", Counter())[err == "ok"] += 1
        if got == want["arguments"]:
            verdict["right tool, all arguments right"] += 1
    return {"verdict": dict(verdict), "arguments": {k: dict(v) for k, v in args.items()},
            "strings by words (True = copied)": {k: dict(v) for k, v in words.items()}}  # fmt: skip


def problem(prompt: str) -> tuple[list[int], list[str]]:
    """The numbers in order and the operations of a held-out problem (one-liners: [a, b], ['+'])."""
    numbers = [int(x) for x in re.findall(r"\d+", prompt)]
    if prompt.startswith("Add "):
        return numbers, ["+"]
    ops = []
    for sentence in prompt.split(". ")[1:]:
        ops += [op for phrase, op in MOVE if phrase in sentence]
    return numbers, ops


def arithmetic(samples: list[dict]) -> dict:
    c: Counter = Counter()
    for s in samples:
        numbers, ops = problem(s["ask"])
        text = (s.get("reasoning") or "") + " " + (s.get("content") or "")
        steps = [(int(a), op, int(b), int(r)) for a, op, b, r in STEP.findall(text)]
        kind = "one-liner" if s["ask"].startswith("Add ") else "story"
        c[f"{kind}: items"] += 1
        c[f"{kind}: correct"] += s["correct"]
        if not steps:
            c[f"{kind}: no step written"] += 1
            continue
        c[f"{kind}: first operand copied"] += steps[0][0] == numbers[0]
        c[f"{kind}: step count right"] += len(steps) == len(ops)
        for i, (a, op, b, r) in enumerate(steps[: len(ops)]):
            c[f"{kind}: steps"] += 1
            c[f"{kind}: step operation right"] += op == ops[i]
            c[f"{kind}: step second operand copied"] += b == numbers[i + 1]
            c[f"{kind}: step sum right for its own operands"] += r == {"+": a + b, "-": a - b, "*": a * b,
                                                                     "/": a // b if b else 0}[op]  # fmt: skip
            if i:
                c[f"{kind}: step chains the previous result"] += a == steps[i - 1][3]
        digits = [len(str(n)) for n in numbers]
        c[f"{kind}: {'all numbers < 100' if max(digits) <= 2 else 'a number >= 100'}: items"] += 1
        c[
            f"{kind}: {'all numbers < 100' if max(digits) <= 2 else 'a number >= 100'}: first operand copied"
        ] += steps[0][0] == numbers[0]
        final = re.search(r"(-?\d+)\D*$", s.get("content") or "")
        c[f"{kind}: answer = last step's result"] += bool(final) and int(final.group(1)) == steps[-1][3]
    return dict(sorted(c.items()))


def main(paths: list[str]) -> None:
    out = {}
    for path in paths:
        sets = json.loads(Path(path).read_text())["sets"]
        out[path] = {
            "tools": tools(sets["heldout-tools"]["samples"]),
            "arithmetic": arithmetic(sets["heldout-arithmetic"]["samples"]),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
