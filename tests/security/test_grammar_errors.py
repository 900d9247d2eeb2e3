"""Row 9 of issue 27: a response format or forced tool call whose grammar fails to compile is a 400
that gives llguidance's reason and none of the internal grammar (its rules, the family's call
syntax, the special-token ids it references as `<[N]>`)."""

from __future__ import annotations

import re

import pytest

from backend.errors import InvalidRequest
from backend.server.model_card import TOOL_MARKERS
from backend.text.structured import build_constraint, grammar_for
from schemas.backend import GenerateRequest, Message, ResponseFormat, Tool, ToolChoice
from tests.backend.server_tokenizers import load


def _forced(schema: dict[str, object]) -> dict[str, object]:
    tool = Tool(name="lookup", parameters={"type": "object", "properties": {"q": schema}, "required": ["q"]})
    return {"tools": [tool], "tool_choice": ToolChoice(mode="required")}


ATTACKS = {
    "forced call, argument of unknown type": (_forced({"type": "strnig"}), "Invalid type: strnig"),
    "forced call, dangling $ref": (_forced({"$ref": "#/nope"}), "Pointer '/nope' does not exist"),
    "json_schema, unknown type": (
        {"response_format": ResponseFormat(type="json_schema", json_schema={"type": "strnig"})},
        "Invalid type: strnig",
    ),
    "json_schema, bad regex": (
        {
            "response_format": ResponseFormat(
                type="json_schema", json_schema={"type": "string", "pattern": "(("}
            )
        },
        "unclosed group",
    ),
}


@pytest.mark.parametrize(("layout", "family"), [("glm", "glm"), ("kimi-tiktoken", "kimi")])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_grammar_errors_carry_no_internals(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str, attack: str
) -> None:
    fields, reason = ATTACKS[attack]
    tok = load(tmp_path_factory, layout)
    markers = {n: tok.token_to_id(n) for n in TOOL_MARKERS}
    request = GenerateRequest(
        request_id="r", tenant_salt="0" * 16, messages=[Message(role="user", content="hi")], **fields
    )  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as info:
        grammar = grammar_for(request, family, markers)
        assert grammar is not None
        build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]))
        raise AssertionError("compiled")  # every attack here is uncompilable in both families
    message = info.value.message
    print(f"tried {family}: {attack}; got {info.value.status}: {message!r}")
    assert info.value.status == 400
    assert reason in message
    for internal in ("<[", "%json", "x-guidance", "start:", "call_0", "args_0", "value_0_0", " | "):
        assert internal not in message, internal
    marker_ids = {str(i) for i in markers.values() if i is not None}
    assert not marker_ids & set(re.findall(r"\d+", message)), "a special-token id leaked"
