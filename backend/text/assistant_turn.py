"""The token ids of one assistant turn as a model emits it after the generation prompt.

One rule, shared by the training recipe (`models/recipes/render.py`: the ids a turn is trained on)
and `kumo eval` (the ids a multiple-choice answer is scored on), so the two cannot drift apart:

    target = the turn as the checkpoint's template renders it in history (reasoning, content, tool
             calls), minus the generation prompt's opening, up to and including the first stop
             token (the tokenizer's eos appended when the template writes none, as GLM's final turn).

The opening may differ from the history form by whitespace only (GLM-5's history writes
`<|assistant|>\\n<think>`, its generation prompt `<|assistant|><think>`); anything else is an error,
never a silent misalignment. Messages and tools are the OpenAI-style dicts serving hands the
template (`backend.text.chat_template.message_dict` / `tool_dict`). No msgspec here: the recipe imports it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from backend.text.jinja_sandbox import JinjaTemplate
from backend.text.tokenizer import Tokenizer


def assistant_turn_ids(
    template: JinjaTemplate,
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    i: int,
    tools: list[dict[str, Any]] | None,
    *,
    stop_ids: Collection[int],
    eos_id: int,
) -> list[int]:
    """The ids of assistant turn `messages[i]` after the generation prompt's opening, through its
    stop token. The turn after it is rendered too when it is not a user turn (a tool result closes
    a call turn with its own marker, as GLM's `<|observation|>`)."""
    render = template.render
    history = render(messages[:i], tools=tools, add_generation_prompt=False)
    opening = render(messages[:i], tools=tools, add_generation_prompt=True)[len(history) :]
    following = (
        messages[: i + 2]
        if i + 1 < len(messages) and messages[i + 1]["role"] != "user"
        else messages[: i + 1]
    )
    full = render(following, tools=tools, add_generation_prompt=False)
    if not full.startswith(history):
        raise ValueError("the template renders earlier messages differently once a turn follows")
    ids = tokenizer.encode(after_opening(full[len(history) :], opening))
    stop = next((k for k, t in enumerate(ids) if t in stop_ids), None)
    return ids[: stop + 1] if stop is not None else ids + [eos_id]


def after_opening(turn: str, opening: str) -> str:
    """`turn` after the characters of `opening`, which it must contain in order, up to extra whitespace
    in `turn`. Raises ValueError if the generation prompt is not the turn's opening."""
    j = 0
    for ch in opening:
        while j < len(turn) and turn[j] != ch and turn[j].isspace():
            j += 1
        if j == len(turn) or turn[j] != ch:
            raise ValueError(
                f"the generation prompt {opening!r} does not open the rendered turn {turn[:80]!r}"
            )
        j += 1
    return turn[j:]
