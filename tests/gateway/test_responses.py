"""A Responses body becomes the Chat Completions request it means (`gateway.responses.to_chat`)."""

from __future__ import annotations

import msgspec
import pytest

from gateway.errors import BadInput
from gateway.normalize_openai import check_tool_results
from gateway.responses import to_chat
from schemas.responses import ResponsesRequest


def chat_of(body: dict) -> dict:  # type: ignore[type-arg]
    """The chat request as JSON-like data, the fields left unset (None) out."""
    request = msgspec.convert(body, ResponsesRequest)
    return set_fields(msgspec.to_builtins(to_chat(request)))  # type: ignore[return-value]


def set_fields(value: object) -> object:
    if isinstance(value, dict):
        return {k: set_fields(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [set_fields(v) for v in value]
    return value


def test_a_whole_conversation_of_items() -> None:
    chat = chat_of(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo and Rome?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Two cities."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "3C"},
                {"type": "function_call_output", "call_id": "c2", "output": "20C"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Cold, warm."}]},
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 50,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "reasoning": {"effort": "none"},
            "stream": True,
            "store": True,
        }
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Rome?"}]},
        {
            "role": "assistant",
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "content": "3C", "tool_call_id": "c1"},
        {"role": "tool", "content": "20C", "tool_call_id": "c2"},
        {"role": "assistant", "content": "Cold, warm."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "", "parameters": {"type": "object"}},
            "description": "",  # ToolSpec's own field (its flat shape), empty
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_completion_tokens"] == 50 and chat["reasoning_effort"] == "none"
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["stream"] is True and chat["stream_options"]["include_usage"] is True


def test_text_input_is_one_user_message() -> None:
    assert chat_of({"model": "m", "input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "Hi", "previous_response_id": "resp_1"}, "not stored"),
        ({"input": "Hi", "background": True}, "background"),
        ({}, "'input' is required"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "$.input[0] (function_call)",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}]}, "file_id"),
        (  # a result for a call the input never made (OpenAI: "No tool call found for … call_id")
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c2", "output": "x"},
                ]
            },
            "$.input[1] (function_call_output): no function_call before it has call_id 'c2'",
        ),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c1", "output": "x"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                ]
            },
            "$.input[0] (function_call_output)",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_saying_why(body: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(BadInput) as info:
        chat_of({"model": "m", **body})
    assert message in str(info.value)


@pytest.mark.parametrize(
    "items",
    [
        # a response that reasoned, called, reasoned, called (as the gateway's own output lists them)
        [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "One. "}]},
         {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
         {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
         {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"}],
        # one that called, then wrote text
        [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
         {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}],
    ],
)  # fmt: skip
def test_a_responses_own_output_sent_back_with_its_results_is_one_turn(items: list[dict]) -> None:  # type: ignore[type-arg]
    """OpenAI accepts a response's output items back as input with each call's output after them;
    the chat they become has one assistant turn holding the reasoning, text and calls, answered by
    the results after it (the chat rule the gateway checks too)."""
    outputs = [{"type": "function_call_output", "call_id": c, "output": c.upper()} for c in ("b", "a")]
    request = msgspec.convert({"model": "m", "input": [{"role": "user", "content": "Hi"}, *items, *outputs]},
                              ResponsesRequest)  # fmt: skip
    chat = to_chat(request)
    assert chat.messages is not None
    check_tool_results(chat.messages)  # no 400
    assert [type(m).__name__ for m in chat.messages] == [
        "UserMessage",
        "AssistantMessage",
        "ToolMessage",
        "ToolMessage",
    ]
    turn = chat.messages[1]
    assert [c.id for c in turn.tool_calls or []] == ["a", "b"]  # type: ignore[union-attr]
    assert turn.reasoning_content == ("One. Two." if items[0]["type"] == "reasoning" else None)  # type: ignore[union-attr]
    assert turn.content == (None if items[0]["type"] == "reasoning" else "Checking.")  # type: ignore[union-attr]


def test_logprobs_that_come_after_a_tool_call_go_to_the_message_before_it() -> None:
    """A backend sends a token's logprobs once its text is out, in an event of their own: after a
    tool call closed the message, they belong to that message (they once opened an empty one)."""
    from gateway.catalog import Catalog, load_catalog_file
    from gateway.responses import Echo, EventWriter
    from schemas import responses as r

    model = Catalog.from_file(load_catalog_file(None)).get("@cf/zai-org/glm-5.2")
    writer = EventWriter("resp_1", 0, model, Echo.of(msgspec.convert({"input": "x"}, ResponsesRequest)))
    token = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    writer.text("message", "Hi", [])
    writer.call(0, "c1", "f", "{}")
    assert writer.late_logprobs([token]) == []
    kinds = [type(item) for item in writer.output]
    assert kinds == [r.MessageItem, r.FunctionCallItem]
    message = writer.output[0]
    assert isinstance(message, r.MessageItem) and message.content[0].logprobs == [token]
    # with the message still open, they ride an empty delta
    writer = EventWriter("resp_2", 0, model, Echo.of(msgspec.convert({"input": "x"}, ResponsesRequest)))
    writer.text("message", "Hi", [])
    [delta] = writer.late_logprobs([token])
    assert b'"delta":""' in delta and b'"logprobs":[{"token":"Hi"' in delta
    assert len(writer.output) == 1
