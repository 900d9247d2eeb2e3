"""The small models' data generators: seeded, held-out seeds disjoint, answers right, tiers spread."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from models.recipes.build import TEST_TASKS, build, item, parse_mixture, split_seeds
from models.recipes.images import CELLS, COLOURS, SIZE, render
from models.recipes.world import make_world


@pytest.fixture(scope="module")
def nano(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nano")
    build(out, family="kimi", train_items=1400, test_items=300)
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_and_test_seeds_are_disjoint(nano: Path) -> None:
    train = {r["seed"] for r in _rows(nano / "train.jsonl") if "seed" in r}
    for task in TEST_TASKS + ["image-qa"]:
        test = {r["seed"] for r in _rows(nano / f"{task}.test.jsonl")}
        assert len(test) == 300 and not (test & train), task
        assert not set(split_seeds("test", task, 1000)) & set(split_seeds("train", task, 1000))


def test_test_questions_ask_only_pairs_no_training_item_asks(nano: Path) -> None:
    world = make_world(0)
    trained = {tuple(r["pair"]) for r in _rows(nano / "train.jsonl") if "pair" in r}
    assert trained and all(not world.is_held_out(*pair) for pair in trained)
    for task in ("arc-nano-easy", "arc-nano-challenge", "mmlu-nano"):
        asked = {tuple(r["pair"]) for r in _rows(nano / f"{task}.test.jsonl")}
        assert len(asked) > 10 and all(world.is_held_out(*pair) for pair in asked), task
        assert not asked & trained, task
    # about a quarter of all pairs is held out, and every held-out fact is still stated
    people = [(kind, p.name) for p in world.people for kind in ("town", "trade", "colour", "pet")]
    held = [(kind, name) for kind, name in people if world.is_held_out("easy", kind, name)]
    assert 0.15 < len(held) / len(people) < 0.35
    corpus = {r["messages"][1]["content"] for r in _rows(nano / "train.jsonl") if r["task"] == "facts"}
    for kind, name in held:
        value = getattr(next(p for p in world.people if p.name == name), kind)
        assert sum(name in fact and value in fact for fact in corpus) >= 3, (kind, name)


def test_generation_is_deterministic() -> None:
    world = make_world(0)
    assert item("gsm-nano", 12345, world) == item("gsm-nano", 12345, make_world(0))
    assert item("gsm-nano", 12345, world) != item("gsm-nano", 12347, world)


def test_arithmetic_steps_compute_the_answer(nano: Path) -> None:
    world = make_world(0)
    for row in _rows(nano / "gsm-nano.test.jsonl"):  # the rows keep the prompt: the item has the steps
        steps = (
            item("gsm-nano", row["seed"], world)["messages"][1]["reasoning_content"].rstrip(".").split(". ")
        )
        value = None
        assert len(steps) == row["prompt"].count(". Then ") == row["tier"] + 1  # one step per sentence
        for step in steps:
            a, op, b, _, c = step.split()
            assert value is None or int(a) == value
            assert eval(f"{a} {op.replace('/', '//')} {b}") == int(c)  # noqa: S307 - our own digits
            value = int(c)
        assert str(value) == row["answer"]


def test_choices_hold_the_answer_once_and_tiers_add_distractors(nano: Path) -> None:
    for task in ("arc-nano-easy", "arc-nano-challenge", "mmlu-nano"):
        rows = _rows(nano / f"{task}.test.jsonl")
        for row in rows:
            assert len(set(row["choices"])) == len(row["choices"]) == 2 + row["tier"]
        assert {r["tier"] for r in rows} == {1, 2, 3, 4}


def test_facts_behind_questions_are_in_the_training_corpus(nano: Path) -> None:
    corpus = " ".join(
        r["messages"][1]["content"] for r in _rows(nano / "train.jsonl") if r["task"] == "facts"
    )
    for row in _rows(nano / "arc-nano-easy.test.jsonl")[:50]:
        name = re.search(r"([A-Z][a-z]+)('s| live| work| own)", row["prompt"]).group(1)
        assert f"{name} " in corpus and row["choices"][row["answer"]] in corpus


def _sentences(row: dict) -> list[str]:
    return [x.strip() for x in re.findall(r"[^.]+\.", row["notes"])]


def test_notes_are_true_and_hold_what_the_answer_needs(nano: Path) -> None:
    """Open book: every sentence of an item's notes is a stated fact of the world (so none contradicts the
    answer), the sentences the answer needs are among them, and tiers add distractors."""
    world = make_world(0)
    stated = set(world.facts())
    for task in ("arc-nano-easy", "arc-nano-challenge", "mmlu-nano"):
        rows = _rows(nano / f"{task}.test.jsonl")
        for row in rows:
            sentences = _sentences(row)
            assert sentences and all(x in stated for x in sentences), row["notes"]
            assert row["messages"][0]["content"].startswith(row["notes"] + "\n" + row["prompt"])
            answer, key = row["choices"][row["answer"]], row["pair"][-1]
            if task == "arc-nano-challenge" and row["pair"][0] == "challenge-region":
                town = next(q.town for q in world.people if q.name == key)
                assert any(key in x and town in x for x in sentences)  # hop 1: the person's town
                assert any(town in x and answer in x for x in sentences)  # hop 2: the town's region
            else:  # the fact itself: the person (or the term) with the answer
                assert any(key in x and answer in x for x in sentences), (row["prompt"], row["notes"])
        mean = {
            t: sum(r["notes"].count(".") for r in rows if r["tier"] == t)
            / max(1, sum(r["tier"] == t for r in rows))
            for t in (1, 4)
        }
        assert mean[4] > mean[1] + 2, (task, mean)


def test_half_the_training_questions_are_about_a_fictional_world_of_fresh_names() -> None:
    """Reading the notes, not recalling a trained pair, is what a fictional item rewards: its names are
    none of the main world's, so its sentences never contradict a stated fact."""
    world = make_world(0)
    fresh = make_world(7, num_people=30, num_towns=8, num_regions=4, num_subjects=2, avoid=world.names)
    assert fresh.names > world.names  # it records what it avoided, so a nested draw avoids both
    assert not {p.name for p in fresh.people} & {p.name for p in world.people}
    assert not set(fresh.regions) & set(world.regions)
    assert not {t for s in fresh.subjects for t in s.table} & {t for s in world.subjects for t in s.table}
    stated = set(world.facts())
    for task in ("arc-nano-easy", "arc-nano-challenge", "mmlu-nano"):
        rows = [item(task, s, world) for s in split_seeds("train", task, 200)]
        main = [set(_sentences(r)) <= stated for r in rows]
        assert 0.35 < sum(main) / len(rows) < 0.65, task  # the rest states only fictional facts
        tests = [item(task, s, world) for s in split_seeds("test", task, 50)]
        assert all(set(_sentences(r)) <= stated for r in tests), task


def test_tool_items_name_an_offered_tool_with_its_required_arguments(nano: Path) -> None:
    for row in _rows(nano / "tool-call.test.jsonl"):
        tool = next(t for t in row["tools"] if t["name"] == row["expected"]["name"])
        assert set(tool["parameters"]["required"]) <= set(row["expected"]["arguments"])


def test_rendered_image_shows_the_answered_colour(nano: Path) -> None:
    for row in _rows(nano / "image-qa.test.jsonl")[:40]:
        image = Image.open(io.BytesIO(render(row["image_spec"]))).convert("RGB")
        assert image.size == (SIZE, SIZE)
        for shape in row["image_spec"]:
            cx, cy = CELLS[shape["cell"]]
            centre = (cx * SIZE // 2 + SIZE // 4, cy * SIZE // 2 + SIZE // 4 + 6)
            assert image.getpixel(centre) == COLOURS[shape["colour"]], (row["id"], shape)


def test_test_sets_load_as_kumo_eval_task_files(nano: Path) -> None:
    from backend.tools.eval_tasks import load_items

    kinds = {task: load_items(nano / f"{task}.test.jsonl")[0] for task in TEST_TASKS}
    assert kinds == {
        "gsm-nano": "generation",
        "arc-nano-easy": "multiple_choice",
        "arc-nano-challenge": "multiple_choice",
        "mmlu-nano": "multiple_choice",
        "tool-call": "tool_call",
    }
    _, tool_items = load_items(nano / "tool-call.test.jsonl")
    assert all(len(i.messages) == 1 and i.messages[0].role == "user" for i in tool_items)
    _, gsm = load_items(nano / "gsm-nano.test.jsonl")
    from backend.tools.eval_tasks import extract_answer

    assert all(extract_answer(f"The answer is {i.answer}.", i) == i.answer for i in gsm)


def test_a_later_stage_gets_fresh_training_items_and_the_same_test_sets(tmp_path: Path) -> None:
    """`first_item` moves the training items past an earlier stage's (none shared), `mixture` sets their
    shares; the test sets are byte for byte those of the default build."""
    a = build(tmp_path / "a", family="glm", train_items=400, test_items=20)
    b = build(tmp_path / "b", family="glm", train_items=400, test_items=20, first_item=1000,
              mixture={"arc-nano-easy": 3.0, "gsm-nano": 1.0})  # fmt: skip
    for task in TEST_TASKS:
        assert (tmp_path / "a" / f"{task}.test.jsonl").read_bytes() == (
            tmp_path / "b" / f"{task}.test.jsonl"
        ).read_bytes()

    def items(folder: str) -> list[dict]:
        rows = [json.loads(x) for x in (tmp_path / folder / "train.jsonl").read_text().splitlines()]
        return [r for r in rows if r["task"] != "facts"]

    seeds_a = {r["seed"] for r in items("a")}
    later = items("b")
    assert not seeds_a & {r["seed"] for r in later}
    assert all(r["seed"] % 2 == 0 for r in later)  # training side of the split
    assert [r["task"] for r in later].count("arc-nano-easy") == 300 and len(later) == 400
    assert a["train"] - len(items("a")) == b["train"] - len(later)  # the facts, in both
    with pytest.raises(ValueError, match="TASK=SHARE"):
        parse_mixture("arc-nano-easy=0.5,nope=1")
    world = make_world(0)
    main = {p.name for p in world.people}
    seeds = split_seeds("train", "arc-nano-easy", 60)
    for share, inside in ((1.0, 0), (0.0, 60)):  # the person asked about: in the main world or not
        asked = [item("arc-nano-easy", s, world, share)["pair"][-1] for s in seeds]
        assert sum(name in main for name in asked) == inside
