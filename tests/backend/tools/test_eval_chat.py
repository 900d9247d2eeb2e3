"""`kumo eval` in chat mode on the recipe's test sets and checkpoints.

The prompts it runs are the ones serving sends (`Serving.prepare` on the same conversation) and the
ones the recipe trains on (`models.recipes.render`); a multiple-choice answer is scored on exactly
the ids the recipe trains the right answer on. End to end, micro models trained by the recipe on a
handful of items (memorised) score every task perfectly, the way a client would read the answers
(reasoning split, the family's tool-call parser, serving's image path).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import torch

from backend.engine.prompt_runner import PromptRunner
from backend.models.image_encoder import MEDIA_PAD, VisionEncoder
from backend.server.generation import GenerationEngine, Serving
from backend.server.model_card import ServedModel
from backend.tools.eval import Evaluator, Variant, main
from backend.tools.eval_prompts import EvalPrompts
from backend.tools.eval_tasks import GenItem, McItem, ToolItem, load_items
from backend.tools.random_checkpoint import write_random_checkpoint
from models.recipes import nano
from models.recipes.build import build, eval_row, item
from models.recipes.images import render as draw
from models.recipes.render import Renderer
from models.recipes.train import train
from models.recipes.world import make_world
from schemas.backend import GenerateRequest, Message, Tool

WORLD = make_world(0)
TASKS = ["gsm-nano", "arc-nano-easy", "mmlu-nano", "tool-call"]
KIND = {"gsm-nano": "generation", "arc-nano-easy": "multiple_choice", "arc-nano-challenge": "multiple_choice",
        "mmlu-nano": "multiple_choice", "tool-call": "tool_call", "image-qa": "generation"}  # fmt: skip


def _tasks(family: str) -> list[str]:
    return TASKS + (["image-qa"] if family == "kimi" else [])


def _items(family: str) -> list[dict[str, Any]]:
    return [item(t, seed, WORLD) for t in _tasks(family) for seed in (1, 3)]


@pytest.fixture(scope="module", params=["kimi", "glm"])
def memorised(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A micro checkpoint trained by the recipe on the test items' own transcripts; its test files."""
    family = request.param
    root = tmp_path_factory.mktemp(f"memorised-{family}")
    (root / "data").mkdir()
    items = _items(family)
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    with pytest.MonkeyPatch.context() as mp:  # the micro DSA keeps every key, as the nano one does
        mp.setitem(nano.SIZES["micro"]["dsa"], "index_topk", 2048)
        train(family, root / "data", root / "ckpt", size="micro", steps=240 if family == "glm" else 160,
              batch_tokens=4096, lr=1e-2, warmup=5, max_len=600, log_every=100, device="cpu", workers=1)  # fmt: skip
    for task in _tasks(family):
        rows = [eval_row(it) for it in items if it["task"] == task]
        (root / f"{task}.test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return family, root


@pytest.mark.slow  # trains two micro models (~1.5 min of CPU)
def test_a_memorised_model_scores_every_task_in_chat_mode(memorised: tuple[str, Path]) -> None:
    family, root = memorised
    ckpt, out = root / "ckpt", root / "report.json"
    data = [a for t in _tasks(family) for a in ("--data", str(root / f"{t}.test.jsonl"))]
    variants = ["--variant", f"ref={ckpt}", "--variant", f"same={ckpt}",
                "--variant", f"q={ckpt}:weights=int4-g32:kv=fp8"]  # fmt: skip
    assert main([*variants, *data, "--batch-size", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "chat"
    tasks = {t["task"]: t for t in report["tasks"]}
    expected = {t for t in _tasks(family)} | {
        f"{t}:norm" for t in _tasks(family) if KIND[t] == "multiple_choice"
    }
    assert set(tasks) == expected
    for name, task in tasks.items():
        ref, same, q = task["results"]
        assert task["num_items"] == 2
        assert ref["accuracy"] == 1.0, (name, task)  # the memorised answers, read as a client reads them
        assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["delta_ci"] == [0.0, 0.0]
        assert q["mean_kl"] > 0, name
    assert tasks["tool-call"]["kind"] == "tool_call" and tasks["gsm-nano"]["kind"] == "generation"


@pytest.mark.slow
def test_raw_mode_scores_plain_text(memorised: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    family, root = memorised
    args = ["--variant", f"a={root / 'ckpt'}", "--variant", f"b={root / 'ckpt'}", "--raw"]
    out = root / "raw.json"
    assert main([*args, "--data", str(root / "mmlu-nano.test.jsonl"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["mode"] == "raw"
    assert main([*args, "--data", str(root / "tool-call.test.jsonl")]) == 2
    assert "need chat mode" in capsys.readouterr().err


@pytest.mark.slow
def test_batched_runs_give_the_single_sequence_results(memorised: tuple[str, Path]) -> None:
    """Many sequences over one pool, whole or chunked, in one or several steps: each sequence's logits
    and greedy output are those of running it alone."""
    family, root = memorised
    ev = Evaluator([Variant("a", str(root / "ckpt"))])
    requests = [ev.prompts.generation(msgspec.convert(eval_row(it), ToolItem if "expected" in it else GenItem))
                for it in _items(family) if it["task"] in ("gsm-nano", "tool-call", "image-qa")]  # fmt: skip
    prompts = [r[0].prompt for r in requests]
    model = ev.variants[0].model
    alone = [PromptRunner(model, model_dtype=torch.float32, chunk=None) for _ in prompts]
    single = [r.score([p], [0])[0] for r, p in zip(alone, prompts, strict=True)]
    stop = ev.prompts.stop_ids
    outputs = [r.generate([p], 24, stop)[0] for r, p in zip(alone, prompts, strict=True)]
    for chunk, step_tokens in ((None, 8192), (16, 8192), (None, 300)):
        runner = PromptRunner(model, model_dtype=torch.float32, chunk=chunk, step_tokens=step_tokens)
        for got, want in zip(runner.score(prompts, [0] * len(prompts)), single, strict=True):
            assert (got - want).abs().max() < 1e-4
        assert runner.generate(prompts, 24, stop) == outputs
    if family == "kimi":
        assert any(p.image_embeds is not None for p in prompts)


@pytest.mark.parametrize("family", ["kimi", "glm"])
def test_every_test_set_build_writes_loads(family: str, tmp_path: Path) -> None:
    counts = build(tmp_path, family=family, train_items=14, test_items=3)
    files = sorted(tmp_path.glob("*.test.jsonl"))
    assert [f.name.removesuffix(".test.jsonl") for f in files] == sorted(
        _tasks(family) + ["arc-nano-challenge"]
    )
    for f in files:
        kind, items = load_items(f)
        task = f.name.removesuffix(".test.jsonl")
        assert kind == KIND[task] and len(items) == 3 == counts[f"{task}.test"]
        for it in items:
            assert it.messages and all(m.role != "assistant" for m in it.messages)  # no answer leaks in


@pytest.fixture(scope="module", params=["kimi-k2.6", "glm-5.2"])
def random_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def _serving_request(it: dict[str, Any]) -> GenerateRequest:
    """The request a client would send for the item's prompt (its images as PNG bytes)."""

    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {"type": "image", "data": draw(it["image_spec"])} if p["type"] == "image" else p

    first = it["messages"][0]
    wire = (
        first | {"content": [part(p) for p in first["content"]]}
        if isinstance(first["content"], list)
        else first
    )
    return GenerateRequest(request_id="r", tenant_salt="ab" * 8, messages=[msgspec.convert(wire, Message)],
                           tools=[Tool(**t) for t in it["tools"]] if it.get("tools") else None)  # fmt: skip


def test_eval_sends_what_serving_sends_and_scores_what_training_trains(random_ckpt: Path) -> None:
    family = "kimi" if (random_ckpt / "tiktoken.model").exists() else "glm"
    prompts = EvalPrompts(
        [random_ckpt], is_chat=True, max_new_tokens=64, dtype=torch.float32, devices=["cpu"]
    )
    served = ServedModel.from_checkpoint(random_ckpt)
    vision = VisionEncoder.from_checkpoint(
        random_ckpt, pad_token_id=served.tokenizer.token_to_id(MEDIA_PAD), dtype=torch.float32
    )
    serving = Serving(served, cast(GenerationEngine, None), images=vision)
    renderer = Renderer(random_ckpt)
    num_images = 0
    for it in [item(t, seed, WORLD) for t in _tasks(family) + ["arc-nano-challenge"] for seed in (5, 6)]:
        row = eval_row(it)
        sent = serving.prepare(_serving_request(it))
        example = renderer.examples(it)[0]
        if "choices" in row:
            (request,), choices = prompts.multiple_choice(msgspec.convert(row, McItem))
            trained = [t for t, m in zip(example.token_ids, example.loss_mask, strict=True) if m]
            assert choices[it["answer"]].target_ids == trained, it["id"]
            for choice, text in zip(choices, it["choices"], strict=True):
                assert text in renderer.tokenizer.decode(choice.target_ids)
        else:
            (request,) = prompts.generation(msgspec.convert(row, ToolItem if "expected" in row else GenItem))
        assert request.prompt.token_ids == sent.engine_request.prompt_token_ids, it["id"]
        assert (
            example.token_ids[: len(request.prompt.token_ids)] == request.prompt.token_ids
        )  # training's prompt
        if sent.image_embeds is not None:
            num_images += 1
            assert request.prompt.image_embeds is not None
            assert torch.equal(request.prompt.image_embeds, sent.image_embeds)
            pad = served.tokenizer.token_to_id(MEDIA_PAD)
            assert request.prompt.image_positions == [
                i for i, t in enumerate(sent.engine_request.prompt_token_ids) if t == pad
            ]
    assert num_images == (2 if family == "kimi" else 0)


@pytest.mark.gpu
def test_cuda_runs_give_the_cpu_scores(tmp_path: Path) -> None:
    """The batched runner on CUDA (Triton MLA prefill and decode, MoonViT on the GPU): the scores of
    multiple-choice and image items match the CPU's, and batched greedy decoding runs."""
    path = write_random_checkpoint("kimi-k2.6", tmp_path / "k", dtype=torch.float32)
    rows = [eval_row(item(t, s, WORLD)) for t in ("arc-nano-easy", "image-qa") for s in (1, 2, 3)]
    scores = []
    for device in ("cpu", "cuda"):
        ev = Evaluator([Variant(device, str(path), device=device)], batch_size=4)
        seqs = []
        for row in rows:
            if "choices" in row:
                requests, choices = ev.prompts.multiple_choice(msgspec.convert(row, McItem))
                seqs += [(requests, c.target_ids) for c in choices]
            else:
                requests = ev.prompts.generation(msgspec.convert(row, GenItem))
                seqs.append((requests, ev.prompts.tokenizer.encode(row["answer"] + ".")))
                out = ev.runners[0].generate([requests[0].prompt], 8, ev.prompts.stop_ids)[0]
                assert len(out.token_ids) == 8 or out.stop_id is not None
        scores.append(ev._score(seqs)[0][0])
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-3, atol=1e-3)
