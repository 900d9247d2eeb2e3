"""Write the training mixture and the held-out test sets as JSONL.

    python -m models.recipes.build --out DIR [--train-items 60000] [--test-items 2000] [--family kimi|glm]

Item seeds: training items use even seeds, test items odd ones, so the two never share a generator
draw (a test checks it), and the seed's parity is the item's split. The world of facts is shared on
purpose: tests ask about facts the training corpus states, but only (person, question) and (subject,
term) pairs that no training item asks (`World.is_held_out`; a test checks that too).

The mixture (`MIXTURE`) leans on arithmetic: each word problem is fresh, and multi-digit sums are
what the nano models learn slowest.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
from pathlib import Path

from models.recipes.images import image_caption, image_question, scene_caption, scene_question
from models.recipes.images import render as draw
from models.recipes.tasks import ANSWER_FORMAT, GENERATORS
from models.recipes.world import make_world

TEST_TASKS = ["gsm-nano", "arc-nano-easy", "arc-nano-challenge", "mmlu-nano", "tool-call"]
MC_TASKS = ("arc-nano-easy", "arc-nano-challenge", "mmlu-nano")
# share of the training items per task (the stated facts come on top); images for Kimi only
MIXTURE = {"gsm-nano": 0.34, "arc-nano-easy": 0.1, "arc-nano-challenge": 0.08, "mmlu-nano": 0.08,
           "tool-call": 0.16, "chat": 0.1, "image-qa": 0.08, "image-caption": 0.06}  # fmt: skip
MAX_TIER = 4
# the defaults: 60k, as the committed models had (120k on 2026-12-01 left each sequence ~600 batch tokens
# of training in one 7-minute call, against ~3,600 for the committed models' two stages: models/README.md)
TRAIN_ITEMS, TEST_ITEMS = 60_000, 2_000
FACT_PROMPTS = [
    "Tell me a fact.",
    "Tell me something about your world.",
    "What is one thing you know?",
    "Share a fact.",
]
SCENE_SHARE = 0.5  # of the training image items: scenes of any size (images.scene), the rest classic
# (0.85 in the first everyday retrain cost Kimi half its accuracy on the classic drawings)
IMAGE_ANSWER = r"^\s*(.*?)\.?\s*$"  # the image task's answer turn is `{answer}.`


def item(task: str, seed: int, world, fiction_share: float | None = None) -> dict:
    """The item of `seed`: a training item for an even seed, a test item for an odd one. `fiction_share`
    (multiple choice): the share of training items about a fictional world (default `FICTION_SHARE`)."""
    rng = random.Random(seed)
    tier = rng.randint(1, MAX_TIER)
    scenes = seed % 2 == 0 and rng.random() < SCENE_SHARE  # training items; the test set stays classic
    if task == "image-qa":
        out = scene_question(rng, tier) if scenes else image_question(rng, tier)
    elif task == "image-caption":
        out = scene_caption(rng, tier) if scenes else image_caption(rng, tier)
    else:
        split = "train" if seed % 2 == 0 else "test"
        extra = {"fiction_share": fiction_share} if fiction_share is not None and task in MC_TASKS else {}
        out = GENERATORS[task](rng, tier, world, split, **extra)
    return {"id": f"{task}-{seed}", "tier": tier, "seed": seed, **out}


NO_THINKING_SHARE = 0.15  # of GLM's items with a thinking trace: trained as `enable_thinking: false` asks


def for_family(row: dict, family: str) -> dict:
    """A generated item as `family` is trained on it. An assistant turn's `think` draft becomes GLM's
    `reasoning_content` (GLM-5 thinks by default; serving's reasoning parser reads the `<think>` block
    the template writes from it); Kimi's turns drop it. A seeded share of GLM's items that think is
    rendered as a thinking-off request (`enable_thinking: false`, `render.Renderer`): no reasoning, the
    answer straight after the prompt's `</think>`."""
    messages = []
    for m in row["messages"]:
        m = dict(m)
        think = m.pop("think", None)
        if family == "glm" and think and not m.get("reasoning_content"):
            m["reasoning_content"] = think
        messages.append(m)
    out = {**row, "messages": messages}
    thinks = any(m.get("reasoning_content") for m in messages)
    if (
        family == "glm"
        and thinks
        and random.Random(f"nothink-{row.get('seed')}").random() < NO_THINKING_SHARE
    ):
        out["enable_thinking"] = False
        out["messages"] = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    return out


def eval_row(row: dict) -> dict:
    """A test item in `kumo eval`'s task format (backend/tools/eval_tasks.py). The item's fields stay for
    reference, but `messages` keeps only the prompt, the turns before the first assistant one (the
    answer must not leak in), with each image drawn into its part as PNG bytes (base64 in JSON)."""
    first = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
    out = {**row, "messages": [_with_pixels(m, row) for m in row["messages"][:first]]}
    if "choices" in row:
        return {**out, "choice_format": ANSWER_FORMAT}
    if row["task"] == "gsm-nano":
        return {**out, "answer_regex": r"answer is (-?\d+)"}
    if row["task"] == "image-qa":
        return {**out, "answer_regex": IMAGE_ANSWER}
    return out


def _with_pixels(message: dict, row: dict) -> dict:
    if not isinstance(message.get("content"), list):
        return message
    image = {"type": "image", "data": base64.b64encode(draw(row["image_spec"])).decode()}
    return {**message, "content": [image if p["type"] == "image" else p for p in message["content"]]}


def split_seeds(split: str, task: str, count: int, start: int = 0) -> list[int]:
    """`count` seeds of `split` for `task` from the `start`-th on (training even, test odd: disjoint)."""
    base = random.Random(f"{task}").randrange(1 << 40) * 2
    parity = 0 if split == "train" else 1
    return [base + 2 * i + parity for i in range(start, start + count)]


def parse_mixture(spec: str) -> dict[str, float]:
    """`task=share,…` (e.g. `arc-nano-easy=0.3,gsm-nano=0.2`) -> shares; tasks of MIXTURE only."""
    out = {}
    for part in spec.split(","):
        task, _, share = part.partition("=")
        if task not in MIXTURE or not share:
            raise ValueError(f"mixture part {part!r}: expected TASK=SHARE with TASK one of {sorted(MIXTURE)}")
        out[task] = float(share)
    return out


def build(
    out: Path,
    *,
    family: str,
    train_items: int,
    test_items: int,
    world_seed: int = 0,
    mixture: dict[str, float] | None = None,
    first_item: int = 0,
    fiction_share: float | None = None,
) -> dict[str, int]:
    """The test sets and the training mixture (`mixture`, default MIXTURE) into `out`. `first_item`:
    the training items start at that index of each task's seeds, so a later stage can get items
    the earlier ones never saw (the test seeds are the same whatever it is). `fiction_share`: of the
    multiple-choice training items, the share about a fictional world, answerable only by reading."""
    mixture = MIXTURE if mixture is None else mixture
    world = make_world(world_seed)
    out.mkdir(parents=True, exist_ok=True)
    tasks = TEST_TASKS + (["image-qa"] if family == "kimi" else [])
    counts: dict[str, int] = {}
    for task in tasks:
        rows = [eval_row(item(task, s, world)) for s in split_seeds("test", task, test_items)]
        (out / f"{task}.test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts[f"{task}.test"] = len(rows)
    train_tasks = [t for t in mixture if family == "kimi" or not t.startswith("image")]
    total = sum(mixture[t] for t in train_tasks)
    counts["train"] = 0
    with (out / "train.jsonl").open("w") as f:
        # every fact stated, in every phrasing, under several prompts, so questions about it are
        # answerable (the first nano models, with each fact once per epoch, stayed at ~2.9 nats per
        # fact token)
        for ask in FACT_PROMPTS:
            for fact in world.facts():
                f.write(
                    json.dumps(
                        {
                            "task": "facts",
                            "messages": [
                                {"role": "user", "content": ask},
                                {"role": "assistant", "content": fact},
                            ],
                        }
                    )
                    + "\n"
                )
                counts["train"] += 1
        for task in train_tasks:
            for s in split_seeds("train", task, round(train_items * mixture[task] / total), first_item):
                f.write(json.dumps(for_family(item(task, s, world, fiction_share), family)) + "\n")
                counts["train"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--family", choices=["kimi", "glm"], default="kimi")
    p.add_argument("--train-items", type=int, default=TRAIN_ITEMS)
    p.add_argument("--test-items", type=int, default=TEST_ITEMS)
    p.add_argument("--mixture", default=None, help="task=share,… instead of MIXTURE (tasks left out: none)")
    p.add_argument(
        "--first-item", type=int, default=0, help="training items from this index of each task's seeds"
    )
    p.add_argument(
        "--fiction-share", type=float, default=None, help="multiple choice about a fictional world"
    )
    args = p.parse_args(argv)
    mixture = parse_mixture(args.mixture) if args.mixture else None
    counts = build(args.out, family=args.family, train_items=args.train_items, test_items=args.test_items,
                   mixture=mixture, first_item=args.first_item, fiction_share=args.fiction_share)  # fmt: skip
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
