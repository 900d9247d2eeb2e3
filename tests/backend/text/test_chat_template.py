"""Chat templates render the published Kimi K2.5 / GLM formats exactly as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from backend.errors import InvalidRequest
from backend.text.chat_template import ChatTemplate, message_dict, tool_dict
from backend.text.tokenizer_files import write_tokenizer_files
from schemas.backend import ImagePart, Message, Reasoning, TextPart, Tool, ToolCall, ToolCallFunction
from tests.backend.server_tokenizers import tokenizer_dir

WEATHER = Tool(
    name="get_weather",
    description="Weather for a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
CONVERSATION = [
    Message(role="system", content="Be brief."),
    Message(role="user", content="Weather in Paris?"),
    Message(
        role="assistant",
        content="",
        reasoning_content="I need the tool.",
        tool_calls=[
            ToolCall(
                id="functions.get_weather:0",
                function=ToolCallFunction(name="get_weather", arguments='{"city": "Paris", "days": 2}'),
            )
        ],
    ),
    Message(role="tool", tool_call_id="functions.get_weather:0", content="sunny, 21C"),
    Message(role="assistant", content="Sunny.", reasoning_content="Easy."),
    Message(role="user", content=[TextPart(text="And here?"), ImagePart(data=b"\x89PNG")]),
]


@pytest.fixture(scope="module")
def glm45_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("glm45")
    write_tokenizer_files("glm", path, glm_generation="4.5")
    return path


def _dirs(factory: pytest.TempPathFactory, glm45: Path) -> dict[str, Path]:
    return {
        "kimi": tokenizer_dir(factory, "kimi-json"),
        "glm5": tokenizer_dir(factory, "glm"),
        "glm45": glm45,
    }


@pytest.mark.parametrize("name", ["kimi", "glm5", "glm45"])
@pytest.mark.parametrize(
    "reasoning", [Reasoning(), Reasoning(enabled=True), Reasoning(enabled=False, effort="low")]
)
def test_same_text_as_transformers(
    tmp_path_factory: pytest.TempPathFactory, glm45_dir: Path, name: str, reasoning: Reasoning
) -> None:
    folder = _dirs(tmp_path_factory, glm45_dir)[name]
    ours = ChatTemplate.from_checkpoint(folder)
    assert ours is not None
    reference = AutoTokenizer.from_pretrained(str(folder))
    kwargs = {}
    if reasoning.enabled is not None:
        kwargs = {"enable_thinking": reasoning.enabled, "thinking": reasoning.enabled}
    if reasoning.effort is not None:
        kwargs["reasoning_effort"] = reasoning.effort
    expected = reference.apply_chat_template(
        [message_dict(m) for m in CONVERSATION],
        tools=[tool_dict(WEATHER)],
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )
    assert ours.render(CONVERSATION, tools=[WEATHER], reasoning=reasoning) == expected


def test_kimi_format(tmp_path_factory: pytest.TempPathFactory) -> None:
    template = ChatTemplate.from_checkpoint(tokenizer_dir(tmp_path_factory, "kimi-tiktoken"))
    assert template is not None
    text = template.render(CONVERSATION[:4], tools=[WEATHER])
    tools_json = json.dumps([tool_dict(WEATHER)], separators=(",", ":"))
    assert text == (
        f"<|im_system|>tool_declare<|im_middle|>{tools_json}<|im_end|>"
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>I need the tool.</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    off = template.render(CONVERSATION[:2], reasoning=Reasoning(enabled=False))
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    with_image = template.render(CONVERSATION[-1:])
    assert "And here?<|media_begin|>image<|media_content|><|media_pad|><|media_end|><|im_end|>" in with_image


def test_glm_format(tmp_path_factory: pytest.TempPathFactory, glm45_dir: Path) -> None:
    template = ChatTemplate.from_checkpoint(glm45_dir)
    assert template is not None
    text = template.render(CONVERSATION[1:4], reasoning=Reasoning(enabled=False))
    assert text == (
        "[gMASK]<sop><|user|>\nWeather in Paris?/nothink<|assistant|>\n<think>I need the tool.</think>"
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><|observation|>\n<tool_response>\n"
        "sunny, 21C\n</tool_response><|assistant|>\n<think></think>"
    )
    glm5 = ChatTemplate.from_checkpoint(tokenizer_dir(tmp_path_factory, "glm"))
    assert glm5 is not None
    assert glm5.render(CONVERSATION[1:2]).endswith("<|assistant|><think>")
    assert glm5.render(CONVERSATION[1:2], reasoning=Reasoning(enabled=False)).endswith(
        "<|assistant|></think>"
    )


def test_no_template_means_none(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_checkpoint(tmp_path) is None


def test_template_errors_are_invalid_requests() -> None:
    strict = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok", {}
    )
    assert strict.render([Message(role="user", content="hi")]) == "ok"
    with pytest.raises(InvalidRequest, match="user first"):
        strict.render([Message(role="assistant", content="hi")])


def test_a_template_failing_on_the_messages_is_an_invalid_request(glm45_dir: Path) -> None:
    """GLM-4.5's own template iterates a tool message's content: a tool message without one is
    the client's mistake (400), not an internal error."""
    glm45 = ChatTemplate.from_checkpoint(glm45_dir)
    assert glm45 is not None
    with pytest.raises(InvalidRequest, match="cannot render these messages"):
        glm45.render([Message(role="tool", content=None)])


def test_sandbox_blocks_python_internals() -> None:
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", {})
    with pytest.raises(InvalidRequest):
        escape.render([Message(role="user", content="hi")])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}", {})
    with pytest.raises(InvalidRequest):
        mutate.render([Message(role="user", content="hi")])


def test_template_kwargs_pass_through_but_cannot_replace_the_conversation(
    tmp_path_factory: pytest.TempPathFactory, glm45_dir: Path
) -> None:
    template = ChatTemplate.from_checkpoint(glm45_dir)
    assert template is not None
    off = template.render(CONVERSATION[1:2], extra={"enable_thinking": False, "messages": [], "tools": None})
    assert off == template.render(CONVERSATION[1:2], reasoning=Reasoning(enabled=False))
    # the request's own reasoning switch wins over a stray template kwarg
    on = template.render(
        CONVERSATION[1:2], reasoning=Reasoning(enabled=True), extra={"enable_thinking": False}
    )
    assert "/nothink" not in on


@pytest.mark.parametrize("arguments", ["{not json", "", "5", "[1, 2]", "null"])
def test_call_arguments_that_are_no_object_name_the_call(
    tmp_path_factory: pytest.TempPathFactory, arguments: str
) -> None:
    """GLM's template reads a past call's arguments as a mapping: arguments that are no JSON object
    are the client's 400 naming the call (the probe of 2026-12-07 got the template's own "'str object'
    has no attribute 'items'"); Kimi's template writes them as given."""
    call = ToolCall(id="c0", function=ToolCallFunction(name="get_weather", arguments=arguments))
    messages = [
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", tool_call_id="c0", content="sunny"),
    ]
    glm5 = ChatTemplate.from_checkpoint(tokenizer_dir(tmp_path_factory, "glm"))
    assert glm5 is not None
    with pytest.raises(
        InvalidRequest, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"
    ):
        glm5.render(messages)
    kimi = ChatTemplate.from_checkpoint(tokenizer_dir(tmp_path_factory, "kimi-json"))
    assert kimi is not None
    assert "Weather?" in kimi.render(messages)


@pytest.mark.parametrize("depth", [65, 600, 5000])
def test_call_arguments_nested_too_deep_are_a_400_not_a_crash(
    tmp_path_factory: pytest.TempPathFactory, depth: int
) -> None:
    """A past call's arguments nested hundreds deep ran the parser or the template's walk out of
    stack: a 500 and a 150 KB traceback in the backend's log for a 1.5 KB body (retried on every
    replica). Past 64 levels they are the client's 400; 64 still render."""

    def render(template: ChatTemplate, levels: int) -> str:
        arguments = '{"a":' + "[" * (levels - 1) + "]" * (levels - 1) + "}"
        call = ToolCall(id="c0", function=ToolCallFunction(name="f", arguments=arguments))
        return template.render(
            [
                Message(role="user", content="hi"),
                Message(role="assistant", content="", tool_calls=[call]),
                Message(role="tool", tool_call_id="c0", content="x"),
            ]
        )

    for model in ("glm", "kimi-json"):
        template = ChatTemplate.from_checkpoint(tokenizer_dir(tmp_path_factory, model))
        assert template is not None
        with pytest.raises(InvalidRequest, match="nested more than 64 levels"):
            render(template, depth)
        assert "hi" in render(template, 64)
