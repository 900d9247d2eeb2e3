"""The everyday training items (models/recipes/everyday.py, images.scene, build.for_family) and the
held-out sets (backend/tools/eval_heldout.py) that measure them: fast checks, no training."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from backend.tools import eval_heldout
from backend.tools.eval_tasks import GenItem, generation_correct, load_items
from models.recipes import everyday
from models.recipes.build import for_family, item, split_seeds
from models.recipes.images import COLOURS, render, scene, scene_question
from models.recipes.world import make_world

GLM = Path("models/glm-5.2-nano")


@pytest.fixture(scope="module")
def world():  # type: ignore[no-untyped-def]
    return make_world(0)


def _written(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def test_tool_arguments_are_copied_from_the_request(world) -> None:  # type: ignore[no-untyped-def]
    rows = [item("tool-call", s, world) for s in split_seeds("train", "tool-call", 400)]
    names, cities = set(), set()
    for row in (r for r in rows if "expected" in r):
        request = row["messages"][0]["content"]
        for key, value in row["expected"]["arguments"].items():
            assert _written(value).lower() in request.lower(), (request, key, value)
        tool = next(t for t in row["tools"] if t["name"] == row["expected"]["name"])
        assert set(tool["parameters"]["required"]) <= set(row["expected"]["arguments"])
        assert set(row["expected"]["arguments"]) <= set(tool["parameters"]["properties"])
        args = row["expected"]["arguments"]
        names.add(args.get("to"))
        cities.add(args.get("city"))
    # far beyond the world's 24 towns and its people
    assert len(cities - set(world.regions)) > 30 and len(names - {p.name for p in world.people}) > 30


def test_copy_drills_answer_with_the_requests_own_value(world) -> None:  # type: ignore[no-untyped-def]
    rows = [item("chat", s, world) for s in split_seeds("train", "chat", 600)]
    asks = [re.compile(re.escape(a).replace(re.escape("{v}"), "(.+)") + "$") for a, *_ in everyday.ECHO]
    values = []
    for row in rows:
        ask, reply = row["messages"][0]["content"], row["messages"][1]["content"]
        match = next((m for m in (a.match(ask) for a in asks) if m), None)
        if match:
            assert match.group(1) in reply, (ask, reply)
            values.append(match.group(1))
    assert 0.2 < len(values) / len(rows) < 0.4
    assert len(set(values)) > 0.9 * len(values)  # unbounded values: nothing to learn by heart


def test_tool_values_are_too_many_to_learn_and_never_heldout_ones(world) -> None:  # type: ignore[no-untyped-def]
    """The string arguments come from generators far larger than the training set (the first everyday
    models answered held-out requests with a memorised value: `"text": "water the plants"`), at every
    length, and none is a value of the held-out sets."""
    rows = [item("tool-call", s, world) for s in split_seeds("train", "tool-call", 3000)]
    by_key: dict[str, list[str]] = {}
    for row in (r for r in rows if "expected" in r):
        for key, value in row["expected"]["arguments"].items():
            if (
                isinstance(value, str)
                and key not in ("unit", "from")
                and row["expected"]["name"] != "convert_currency"
            ):
                by_key.setdefault(key, []).append(value)
    for key in ("city", "to", "restaurant", "text"):
        assert len(set(by_key[key])) > 0.6 * len(by_key[key]), key  # mostly values seen once
    assert {len(v.split()) for v in by_key["text"]} >= set(range(1, 8))
    assert {len(v.split()) for v in by_key["city"]} >= {1, 2, 3}
    heldout = {*eval_heldout.PLACES, *eval_heldout.FRIENDS, *eval_heldout.EATERIES, *eval_heldout.NOTES,
               *eval_heldout.ERRANDS}  # fmt: skip
    assert not heldout & {v for vs in by_key.values() for v in vs}


def test_word_problems_answer_their_own_steps(world) -> None:  # type: ignore[no-untyped-def]
    rows = [item("gsm-nano", s, world) for s in split_seeds("train", "gsm-nano", 300)]
    openings = set()
    for row in rows:
        turn = row["messages"][-1]
        steps = re.findall(r"(-?\d+) ([-+*/]) (\d+) = (-?\d+)", turn["reasoning_content"])
        assert steps, turn
        for a, op, b, c in steps:
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) // int(b)}[
                op
            ] == int(c)
        for (_, _, _, c), (a, _, _, _) in zip(steps, steps[1:], strict=False):
            assert c == a  # each step starts from the last result
        assert turn["content"] == f"The answer is {steps[-1][3]}." == f"The answer is {row['answer']}."
        openings.add(row["prompt"].split(" ")[1])
    assert len(openings) > 8  # several settings, not one template


def test_scenes_have_the_requested_size_and_the_shape_where_it_says(world) -> None:  # type: ignore[no-untyped-def]
    import random

    sizes, places = set(), set()
    for seed in range(200):
        spec = scene(random.Random(seed), 1 + seed % 3)
        image = Image.open(io.BytesIO(render(spec))).convert("RGB")
        assert image.size == tuple(spec["size"]) and all(48 <= s <= 512 for s in image.size)
        sizes.add(image.size)
        for s in spec["shapes"]:
            x0, y0, x1, y1 = s["box"]
            # a point inside every kind of shape (a triangle's lower middle)
            pixel = image.getpixel(((x0 + x1) // 2, (y0 + 3 * y1) // 4))
            want = COLOURS[s["colour"]]
            assert max(abs(p - w) for p, w in zip(pixel, want, strict=True)) <= 15, (seed, s, pixel)
            cx, cy = (x0 + x1) / 2 / image.width, (y0 + y1) / 2 / image.height
            row = "top" if cy < 1 / 3 else "bottom" if cy >= 2 / 3 else ""
            col = "left" if cx < 1 / 3 else "right" if cx >= 2 / 3 else ""
            assert s["place"] == (f"{row} {col}".strip() or "centre")
            places.add(s["place"])
    assert len(places) == 9 and len(sizes) > 100
    assert any(w != h for w, h in sizes)


def test_scene_questions_answer_from_the_drawing(world) -> None:  # type: ignore[no-untyped-def]
    import random

    for seed in range(200):
        q = scene_question(random.Random(seed), 1 + seed % 4)
        shapes = q["image_spec"]["shapes"]
        if q["answer"] in COLOURS:
            assert q["answer"] in [s["colour"] for s in shapes]
        elif q["answer"].isdigit():
            assert int(q["answer"]) == len(shapes)
        assert q["messages"][-1]["content"] == f"{q['answer']}."


def test_glm_turns_think_and_kimi_turns_do_not(world) -> None:  # type: ignore[no-untyped-def]
    rows = [item(t, s, world) for t in ("chat", "tool-call") for s in split_seeds("train", t, 100)]
    glm = [for_family(r, "glm") for r in rows]
    thinking = [r for r in glm if r.get("enable_thinking") is not False]
    off = [r for r in glm if r.get("enable_thinking") is False]
    assert off and len(off) < len(glm) / 3
    for r in thinking:
        assert all(m.get("reasoning_content") for m in r["messages"] if m["role"] == "assistant")
    for r in off + [for_family(r, "kimi") for r in rows]:
        assert not any("reasoning_content" in m or "think" in m for m in r["messages"])


@pytest.mark.skipif(not (GLM / "chat_template.jinja").exists(), reason="the committed GLM checkpoint")
def test_glm_renders_thinking_and_thinking_off_turns(world) -> None:  # type: ignore[no-untyped-def]
    from models.recipes.render import Renderer

    r = Renderer(GLM)
    rows = [for_family(item("chat", s, world), "glm") for s in split_seeds("train", "chat", 60)]
    on = next(x for x in rows if x.get("enable_thinking") is not False)
    off = next(x for x in rows if x.get("enable_thinking") is False)
    (ex,) = r.examples(on)
    target = r.tokenizer.decode([t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if m])
    assert target.startswith(on["messages"][1]["reasoning_content"]) and "</think>" in target
    assert target.endswith(on["messages"][1]["content"] + "<|endoftext|>")
    (ex,) = r.examples(off)
    text = r.tokenizer.decode(ex.token_ids)
    prompt = r.tokenizer.decode([t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if not m])
    target = r.tokenizer.decode([t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if m])
    assert prompt.endswith("/nothink<|assistant|></think>") and "<think>" not in target
    assert target.strip() == off["messages"][1]["content"] + "<|endoftext|>" and text.endswith(target)


def _skeleton(template: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", template).lower()


def test_heldout_phrasings_are_not_training_phrasings() -> None:
    training = {_skeleton(t) for ts in everyday.PHRASINGS.values() for t in ts}
    training |= {_skeleton(q) for qs in everyday.FACT_ASK.values() for q in qs}
    training |= {g.lower() for gs in everyday.GREETINGS.values() for g in gs}
    heldout = {_skeleton(t) for ts in eval_heldout.ASK.values() for t in ts}
    heldout |= {q.lower() for q, _ in eval_heldout.ONE_LINERS} | {g.lower() for g in eval_heldout.GREETINGS}
    assert not training & heldout
    assert not set(eval_heldout.PLACES) & set(everyday.CITIES)
    assert not set(eval_heldout.FRIENDS) & set(everyday.NAMES)


_STOP = set(
    [
        "a",
        "an",
        "the",
        "to",
        "for",
        "me",
        "my",
        "i",
        "you",
        "your",
        "please",
        "could",
        "can",
        "is",
        "it",
        "in",
        "of",
        "at",
        "on",
        "and",
        "with",
        "what",
        "how",
        "do",
        "us",
        "we",
        "that",
        "this",
        "be",
        "there",
        "any",
        "some",
        "are",
        "will",
        "would",
        "so",
        "now",
        "right",
        "just",
    ]
)


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", re.sub(r"\{[^}]*\}", " ", text.lower())) if w not in _STOP}


def _closest(text: str, others: list[str]) -> tuple[float, str]:
    words = _content_words(text)
    return max((len(words & _content_words(o)) / max(1, len(words | _content_words(o))), o) for o in others)


def test_heldout_wording_has_no_near_twin_in_training() -> None:
    """Not only no equal phrasing: no held-out request or tool description shares half its content
    words with a training one (the second everyday retrain's added phrasings had near twins of held-out
    ones, e.g. "Count down from {minutes} minutes." against "Could you count down {minutes} minutes for
    me?"; those held-out phrasings were rewritten, and the held-out figures re-measured)."""
    training = [t for ts in everyday.PHRASINGS.values() for t in ts]
    for asks in eval_heldout.ASK.values():
        for ask in asks:
            score, twin = _closest(ask, training)
            assert score < 0.5, (ask, twin)
    descriptions = [d for ds in everyday.TOOL_DESCRIPTIONS.values() for d in ds if d]
    for spec in eval_heldout.TOOLS.values():
        score, twin = _closest(spec["description"], descriptions)
        assert score < 0.5, (spec["description"], twin)
    assert (
        _closest("Count down from {minutes} minutes.", ["Could you count down {minutes} minutes for me?"])[0]
        >= 0.5
    )


def test_heldout_sets_load_and_are_right_by_construction(tmp_path: Path) -> None:
    paths = {p.stem: p for p in eval_heldout.write_sets(tmp_path, "kimi", 30)}
    assert {k: load_items(p)[0] for k, p in paths.items()} == {
        "heldout-tools": "tool_call", "heldout-arithmetic": "generation",
        "heldout-chat": "generation", "heldout-images": "generation",
    }  # fmt: skip
    for row in map(json.loads, paths["heldout-tools"].read_text().splitlines()):
        request = row["messages"][0]["content"]
        assert row["expected"]["name"] in [t["name"] for t in row["tools"]]
        for value in row["expected"]["arguments"].values():
            assert _written(value) in request
    _, arith = load_items(paths["heldout-arithmetic"])
    assert all(generation_correct(f"So the total is {i.answer}.", i) for i in arith)
    for row in map(json.loads, paths["heldout-images"].read_text().splitlines()):
        image = Image.open(io.BytesIO(base64.b64decode(row["messages"][0]["content"][0]["data"]))).convert(
            "RGB"
        )
        for s in row["shapes"]:
            x0, y0, x1, y1 = s["box"]
            assert image.getpixel(((x0 + x1) // 2, (y0 + 3 * y1) // 4)) == eval_heldout.HUES[s["hue"]]
        assert row["answer"] in [s["hue"] for s in row["shapes"]] + [s["kind"] for s in row["shapes"]]
    assert len({Image.open(io.BytesIO(base64.b64decode(json.loads(x)["messages"][0]["content"][0]["data"]))).size
                for x in paths["heldout-images"].read_text().splitlines()}) > 20  # fmt: skip


def test_an_open_reply_is_right_only_without_markup() -> None:
    hello = GenItem(answer="", prompt="Howdy!", accept_regex=eval_heldout.GREETING_OK)
    assert generation_correct("Hello! How can I help?", hello)
    assert not generation_correct("", hello)
    assert not generation_correct("Hello<|tool_calls_section_begin|>", hello)
    assert not generation_correct("<tool_call>get_weather hello", hello)
    assert not generation_correct("The answer is 4.", hello)


def test_some_training_tool_items_offer_tools_but_need_none(world) -> None:  # type: ignore[no-untyped-def]
    rows = [item("tool-call", s, world) for s in split_seeds("train", "tool-call", 400)]
    plain = [r for r in rows if "expected" not in r]
    assert 10 < len(plain) < 80
    for r in plain:
        assert r["tools"] and not any(m.get("tool_calls") for m in r["messages"])
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
    tests = [item("tool-call", s, world) for s in split_seeds("test", "tool-call", 200)]
    assert all("expected" in r for r in tests)  # the test set always asks for a call


@pytest.mark.parametrize("kind,family", [("kimi-k2.6", "kimi"), ("glm-5.2", "glm")])
def test_kumo_eval_heldout_writes_a_report_for_one_variant(kind: str, family: str, tmp_path: Path) -> None:
    from backend.tools.eval import main
    from backend.tools.random_checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint(kind, tmp_path / "ckpt")
    out = tmp_path / "report.json"
    args = ["--heldout", family, "--heldout-items", "2", "--heldout-dir", str(tmp_path / "sets")]
    assert (
        main(
            [*args, "--device", "cpu", "--max-new-tokens", "4", "--variant", f"now={ckpt}", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    tasks = {t["task"]: t["num_items"] for t in report["tasks"]}
    expected = {"heldout-tools": 2, "heldout-arithmetic": 2, "heldout-chat": 2}
    assert tasks == (expected | {"heldout-images": 2} if family == "kimi" else expected)
    assert all(0.0 <= t["results"][0]["accuracy"] <= 1.0 for t in report["tasks"])


def test_offered_tools_vary_in_text_but_not_in_contract(world) -> None:  # type: ignore[no-untyped-def]
    """Training offers each tool with a drawn description and property order (a call must not hang on one
    schema text), but its name, types, enums and `required` are the tool's own; no held-out description."""
    import random

    from models.recipes import tasks

    rng = random.Random(3)
    for tool in tasks.TOOLS:
        seen_descriptions, seen_orders = set(), set()
        for _ in range(200):
            dressed = everyday.dress_tool(rng, tool)
            assert dressed["name"] == tool["name"]
            assert dressed["parameters"]["required"] == tool["parameters"]["required"]
            props = dressed["parameters"]["properties"]
            assert set(props) == set(tool["parameters"]["properties"])
            for key, schema in props.items():
                assert {k: v for k, v in schema.items() if k != "description"} == tool["parameters"][
                    "properties"
                ][key]
            seen_descriptions.add(dressed.get("description"))
            seen_orders.add(tuple(props))
        assert len(seen_descriptions) >= 4
        assert len(seen_orders) >= min(2, len(props))
        heldout = eval_heldout.TOOLS[tool["name"]]
        assert heldout["description"] not in seen_descriptions
    train = [tasks.tool_use(rng, 2, world, "train") for _ in range(300)]
    assert len({json.dumps(it["tools"], sort_keys=True) for it in train}) > 200
