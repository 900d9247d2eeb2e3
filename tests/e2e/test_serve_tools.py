"""Tool calls through `kumo serve` and the `openai` SDK on both trained nano models: twenty varied
prompts, each with a few offered tools and a `tool_choice`. Whatever the model makes of them, the
contract holds: a call names an offered tool (the named one when forced), its arguments validate
against that tool's JSON schema (jsonschema_rs, independent of the grammar library), no markup
reaches `content`, Kimi's ids read `functions.NAME:IDX`, a call cut by `max_tokens` ends with
`length` and no call, and the stream carries what the non-streamed answer does."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import pytest

from tests.e2e.serve_process import GLM, KIMI, Kumo, sdk_client

pytestmark = pytest.mark.slow


def tool(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {
        "type": "function",
        "function": {"name": name, "description": name.replace("_", " "), "parameters": schema},
    }


WEATHER = tool("get_weather", {"city": {"type": "string", "maxLength": 24}}, ["city"])
TIMER = tool("set_timer", {"minutes": {"type": "integer", "minimum": 1, "maximum": 240}}, ["minutes"])
CURRENCY = tool(
    "convert_currency",
    {
        "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
        "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
        "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
    },
    ["amount", "from", "to"],
)
EMAIL = tool(
    "send_email",
    {"to": {"type": "string", "maxLength": 40}, "subject": {"type": "string", "maxLength": 40}},
    ["to", "subject"],
)
SEARCH = tool("search_web", {"query": {"type": "string", "maxLength": 40}}, ["query"])
FLIGHT = tool(
    "book_flight",
    {"origin": {"type": "string", "maxLength": 12}, "destination": {"type": "string", "maxLength": 12},
     "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
    ["origin", "destination"],
)  # fmt: skip

# (prompt, offered tools, tool_choice)
CASES: list[tuple[str, list[dict[str, Any]], Any]] = [
    ("What's the weather in Tokyo?", [WEATHER], "auto"),
    ("Is it raining in São Paulo right now?", [WEATHER, TIMER], "auto"),
    ("Set a timer for 25 minutes please", [TIMER, WEATHER], "auto"),
    ("How many yen is 120 dollars?", [CURRENCY], "auto"),
    ("Email bob@example.com that the meeting moved", [EMAIL, SEARCH], "auto"),
    ("Search the web for the tallest building in Oslo", [SEARCH], "auto"),
    ("Book a flight from Lima to Quito for 2 people", [FLIGHT, WEATHER], "auto"),
    ("hello!", [WEATHER, TIMER], "auto"),
    ("Tell me a joke about cats.", [SEARCH], "auto"),
    ("weather in reykjavik tomorrow?", [WEATHER], "required"),
    ("Remind me in an hour", [TIMER], "required"),
    ("Convert 3.5 euros to pounds", [CURRENCY, WEATHER], "required"),
    (
        "Look up the population of Nairobi",
        [SEARCH, EMAIL],
        {"type": "function", "function": {"name": "search_web"}},
    ),
    ("Whatever you like", [WEATHER, TIMER], {"type": "function", "function": {"name": "set_timer"}}),
    ("Fly me from Paris to Rome", [FLIGHT], {"type": "function", "function": {"name": "book_flight"}}),
    ("What's the weather in Cairo and in Lagos?", [WEATHER], "auto"),
    ("Send an email to ana@site.org saying hi", [EMAIL], "none"),
    ("What is 7 plus 5?", [CURRENCY, TIMER], "none"),
    ("Weather for Wellington, NZ", [WEATHER, SEARCH, TIMER], "auto"),
    ("Ten minute timer, then check weather in Hanoi", [TIMER, WEATHER], "auto"),
]
MARKUP = ("<|", "|>", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "functions.", "<think>")


def check(model: str, tools: list[dict[str, Any]], choice: Any, message: Any, finish: str | None) -> None:
    offered = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in tools}
    content = message.content or ""
    assert not any(m in content for m in MARKUP), content
    calls = message.tool_calls or []
    if choice == "none":
        assert not calls
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == [choice["function"]["name"]] or finish == "length"
    if choice == "required":
        assert calls or finish == "length"
    for call in calls:
        assert call.function.name in offered, call
        assert offered[call.function.name].is_valid(json.loads(call.function.arguments)), call
        if model == KIMI:
            assert call.id.startswith(f"functions.{call.function.name}:"), call.id
    if calls:
        assert finish in ("tool_calls", "length")


@pytest.mark.parametrize("model", [KIMI, GLM])
def test_twenty_tool_prompts_keep_the_contract(kumo: Kumo, model: str) -> None:
    client = sdk_client(kumo)
    num_calls = 0
    for i, (prompt, tools, choice) in enumerate(CASES):
        body: dict[str, Any] = dict(
            model=model, messages=[{"role": "user", "content": prompt}], tools=tools, tool_choice=choice,
            max_tokens=80, seed=i, temperature=0.7,
        )  # fmt: skip
        answer = client.chat.completions.create(**body)
        choice0 = answer.choices[0]
        check(model, tools, choice, choice0.message, choice0.finish_reason)
        num_calls += len(choice0.message.tool_calls or [])
        streamed = list(client.chat.completions.create(**body, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        deltas = [t for c in streamed if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
        assert text == (choice0.message.content or ""), prompt
        assert [(d.function.name, d.function.arguments) for d in deltas if d.function] == [
            (c.function.name, c.function.arguments) for c in choice0.message.tool_calls or []
        ]
        assert finish == [choice0.finish_reason]
    assert num_calls >= 8  # the forced cases alone make six or more


@pytest.mark.parametrize("model", [KIMI, GLM])
def test_a_call_cut_by_max_tokens_is_length_without_markup(kumo: Kumo, model: str) -> None:
    client = sdk_client(kumo)
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Fly me from Paris to Rome"}], tools=[FLIGHT],
        tool_choice="required", max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # type: ignore[call-overload]  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert not any(m in (choice.message.content or "") for m in MARKUP)
