"""Reasoning is split from the answer on `<think>` ids, whoever opens the block, chunking aside."""

from __future__ import annotations

import pytest

from backend.text.reasoning import ReasoningParser, ThinkMarkers
from backend.text.tokenizer import Tokenizer
from tests.backend.server_tokenizers import load, ordinary_ids


def _run(tok: Tokenizer, prompt: str, output: list[int], *, enabled: bool, chunk: int) -> dict[str, str]:
    markers = ThinkMarkers.of(tok)
    assert markers is not None
    parser = ReasoningParser(markers, prompt_token_ids=tok.encode(prompt), enabled=enabled)
    ids: dict[str, list[int]] = {"reasoning": [], "content": []}
    for i in range(0, len(output), chunk):
        for channel, run in parser.split(output[i : i + chunk]):
            ids[channel].extend(run)
    return {k: tok.decode(v) for k, v in ids.items()}


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "glm"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_model_opens_the_block(tmp_path_factory: pytest.TempPathFactory, layout: str, chunk: int) -> None:
    tok = load(tmp_path_factory, layout)
    output = tok.encode("<think>12 * 7 = 84.</think>The answer is 84.")
    got = _run(tok, "<|user|>what?<|assistant|>", output, enabled=True, chunk=chunk)
    assert got == {"reasoning": "12 * 7 = 84.", "content": "The answer is 84."}


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_prompt_opens_the_block(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    """Kimi K2.5 and GLM-5 end the generation prompt with `<think>`."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    output = tok.encode("Let me think 🙂</think>Done.")
    got = _run(tok, "<|im_assistant|>assistant<|im_middle|><think>", output, enabled=True, chunk=chunk)
    assert got == {"reasoning": "Let me think 🙂", "content": "Done."}
    closed = _run(
        tok,
        "<|im_assistant|>assistant<|im_middle|><think></think>",
        tok.encode("Done."),
        enabled=True,
        chunk=chunk,
    )
    assert closed == {"reasoning": "", "content": "Done."}


def test_reasoning_off_produces_none(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    output = tok.encode("<think>secret musings</think>Visible.")
    assert _run(tok, "<|assistant|></think>", output, enabled=False, chunk=1) == {
        "reasoning": "",
        "content": "Visible.",
    }


def test_marker_text_in_the_answer_is_not_a_marker(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    output = tok.encode("<think>a</think>") + ordinary_ids(tok, "Use <think> tags like </think> this.")
    got = _run(tok, "<|assistant|>", output, enabled=True, chunk=1)
    assert got == {"reasoning": "a", "content": "Use <think> tags like </think> this."}


def test_a_tool_call_marker_ends_the_block_when_tools_are_offered(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """With tools offered the family's call-opening marker ends an open block and goes to the answer
    (the tool parser's); without, it is reasoning like any other id."""
    tok = load(tmp_path_factory, "glm")
    markers = ThinkMarkers.of(tok)
    assert markers is not None
    call = tok.encode("<tool_call>")
    output = ordinary_ids(tok, "plan") + call + ordinary_ids(tok, "search")
    prompt = tok.encode("<|assistant|><think>")
    parser = ReasoningParser(markers, prompt_token_ids=prompt, enabled=True, call_start_id=call[0])
    assert parser.split(output) == [
        ("reasoning", ordinary_ids(tok, "plan")),
        ("content", output[-1 - len(ordinary_ids(tok, "search")) :]),
    ]
    assert not parser.in_reasoning
    plain = ReasoningParser(markers, prompt_token_ids=prompt, enabled=True)
    assert plain.split(output) == [("reasoning", output)]
