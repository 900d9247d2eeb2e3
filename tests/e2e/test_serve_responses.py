"""The OpenAI Responses API through `kumo serve`, driven by the official `openai` SDK's
`responses.create` (and its streaming helper) on both trained nano models: text input with
instructions, message items, a function call and its output sent back, reasoning items, streamed
events in order, usage with neurons; nothing stored."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.e2e.serve_process import GLM, KIMI, Kumo, sdk_client

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("model", [GLM, KIMI])
def test_text_input_with_instructions(kumo: Kumo, model: str) -> None:
    answer = sdk_client(kumo).responses.create(
        model=model, input="What is 2 plus 3?", instructions="Answer briefly.", max_output_tokens=24,
        reasoning={"effort": "none"},
    )  # fmt: skip
    assert answer.object == "response" and answer.model == model and answer.id.startswith("resp_")
    assert answer.status in ("completed", "incomplete") and answer.store is False
    assert answer.output_text and [o.type for o in answer.output] == ["message"]
    usage = answer.usage
    assert usage is not None and usage.input_tokens > 5 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert (usage.model_extra or {}).get("neurons", 0) > 0
    if answer.status == "incomplete":
        assert answer.incomplete_details is not None
        assert answer.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("model", [GLM, KIMI])
def test_a_function_call_and_its_output_round_trip(kumo: Kumo, model: str) -> None:
    api = sdk_client(kumo)
    conversation: list[Any] = [{"role": "user", "content": "What's the weather in Tokyo?"}]
    first = api.responses.create(
        model=model, input=conversation, tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )  # type: ignore[arg-type]
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls), first.output
    if model == KIMI:
        assert calls[0].call_id == "functions.get_weather:0"
    conversation += [o.model_dump(exclude_none=True) for o in first.output]
    conversation += [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'} for c in calls
    ]
    second = api.responses.create(model=model, input=conversation, tools=[WEATHER], max_output_tokens=8)  # type: ignore[arg-type]
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output were rendered


def test_reasoning_comes_back_as_a_reasoning_item_and_goes_back_in(kumo: Kumo) -> None:
    """GLM thinks by default on `/responses` too; its reasoning item can be sent back as input."""
    api = sdk_client(kumo)
    first = api.responses.create(model=GLM, input="Hi", max_output_tokens=40, reasoning={"effort": "high"})
    kinds = [o.type for o in first.output]
    assert kinds and set(kinds) <= {"reasoning", "message"}
    reasoning = [o for o in first.output if o.type == "reasoning"]
    assert first.usage is not None and first.usage.output_tokens_details is not None
    if reasoning:  # the nano model may open no thinking block at all
        assert reasoning[0].content and reasoning[0].content[0].text
        # counted by the backend (they were always 0)
        assert 0 < first.usage.output_tokens_details.reasoning_tokens <= first.usage.output_tokens
    again = api.responses.create(
        model=GLM,
        input=[{"role": "user", "content": "Hi"}, *(o.model_dump(exclude_none=True) for o in first.output),
               {"role": "user", "content": "And again?"}],
        max_output_tokens=4,
    )  # type: ignore[arg-type]  # fmt: skip
    assert again.status in ("completed", "incomplete")


@pytest.mark.parametrize("model", [GLM, KIMI])
def test_streaming_events_build_the_same_kind_of_response(kumo: Kumo, model: str) -> None:
    api = sdk_client(kumo)
    events = list(
        api.responses.create(
            model=model, input="Hello there", max_output_tokens=16, stream=True, reasoning={"effort": "none"}
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text and final.output_text == text
    assert final.usage is not None and final.usage.output_tokens <= 16
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert "response.output_item.done" in kinds
    with api.responses.stream(model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                              max_output_tokens=60) as stream:  # type: ignore[arg-type]  # fmt: skip
        for _ in stream:
            pass
        called = stream.get_final_response()
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"


def test_stored_state_is_refused_with_a_clear_400(kumo: Kumo) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk_client(kumo).responses.create(model=GLM, input="Hi", previous_response_id="resp_123")
    assert "not stored" in json.dumps(info.value.body)


@pytest.mark.parametrize("model", [GLM, KIMI])
def test_logprobs_come_on_the_output_text_and_its_deltas(kumo: Kumo, model: str) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: each answer token's logprob
    and its alternatives, the tokens' bytes joining to the text, the same (greedy) on chat
    completions and on a stream's deltas; without the include, none (it was accepted and dropped)."""
    api = sdk_client(kumo)
    ask: dict[str, Any] = dict(model=model, input="Hello there", max_output_tokens=12, temperature=0,
                               reasoning={"effort": "none"})  # fmt: skip
    answer = api.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)
    [message] = [o for o in answer.output if o.type == "message"]
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs
    assert b"".join(bytes(t.bytes) for t in part.logprobs).decode() == part.text
    assert all(t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 2 for t in part.logprobs)
    chat = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_completion_tokens=12,
        temperature=0, reasoning_effort="none", logprobs=True, top_logprobs=2,
    )  # type: ignore[call-overload]  # fmt: skip
    assert chat.choices[0].message.content == part.text
    expected = [(t.token, round(t.logprob, 3)) for t in chat.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 3)) for t in part.logprobs] == expected

    events = list(api.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2,
                                       stream=True))  # fmt: skip
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]  # type: ignore[union-attr]
    assert [(t.token, round(t.logprob, 3)) for t in streamed] == expected
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [t.token for t in done.logprobs or []] == [t for t, _ in expected]  # type: ignore[union-attr]

    plain = api.responses.create(**ask, top_logprobs=2)  # without the include: none, as OpenAI
    assert all(not p.logprobs for o in plain.output if o.type == "message" for p in o.content)
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(**ask, include=["message.output_text.nonsense"])  # type: ignore[list-item]
    assert "include[0]" in json.dumps(info.value.body)
