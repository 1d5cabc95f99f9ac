"""Tool calls in and out (gateway/tools.py, gateway/structured.py; pure)."""

from __future__ import annotations

import json

import llguidance
import pytest

from gateway.errors import InvalidRequest
from gateway.protocol import parse_chat_request
from gateway.structured import grammar_for, tool_grammar
from gateway.tools import ToolStream, parse_calls, template_messages, tool_format

TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def request(**kw: object):  # type: ignore[no-untyped-def]
    return parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], **kw}
    )


def test_calls_are_parsed_even_when_an_argument_contains_the_closing_tag() -> None:
    tools = request().tools
    text = '<tool_call>\n{"name": "python", "arguments": {"code": "print(\\"</tool_call>\\")"}}\n</tool_call>'
    content, calls = parse_calls("Sure. " + text + "\n" + text, tools)
    assert content == "Sure." and len(calls) == 2
    assert json.loads(calls[0].arguments) == {"code": 'print("</tool_call>")'}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    # Not a call: unknown function, broken JSON, no tag.
    for bad in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>{oops", "plain"):
        assert parse_calls(bad, tools) == (bad, ())


def test_stream_holds_back_a_call_and_passes_text() -> None:
    stream = ToolStream(request().tools)
    out = [
        stream.push(p) for p in ("Hello <to", "ol_call>\n", '{"name": "python", "arguments": {"code": "1"}}')
    ]
    assert "".join(out) == "Hello "
    rest, calls = stream.finish()
    assert rest == "" and len(calls) == 1 and calls[0].name == "python"
    plain = ToolStream(request().tools)
    assert plain.push("a <b") + plain.push("c") + plain.finish()[0] == "a <bc"


def test_generic_rendering_puts_tools_in_the_system_message_and_history_in_the_format() -> None:
    req = parse_chat_request(
        {
            "model": "m",
            "tools": [TOOL],
            "tool_choice": "required",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "run it"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "python", "arguments": '{"code": "1"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ],
        }
    )
    messages, extra = template_messages(req, "{{ messages }}")
    assert extra == {} and tool_format("{{ messages }}") == "generic"
    assert messages[0]["role"] == "system" and "python" in messages[0]["content"]
    assert "You must call a function" in messages[0]["content"]
    assert messages[2]["content"].startswith("<tool_call>") and '"code": "1"' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n1\n</tool_response>"}
    hermes = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>"
    native, extra = template_messages(req, hermes)
    assert tool_format(hermes) == "hermes" and "tools" in extra and native[2]["tool_calls"]


def test_constrained_calls_follow_the_schema() -> None:
    grammar = grammar_for(request(tool_choice="required"))
    assert grammar and grammar == tool_grammar(request().tools, parallel=False)
    assert not llguidance.LLMatcher.validate_grammar(grammar)
    assert grammar_for(request()) == ""  # auto: the model chooses
    with pytest.raises(InvalidRequest) as info:
        grammar_for(
            parse_chat_request(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "x"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": {"if": {}, "then": {}}},
                    },
                }
            )
        )
    assert "if" in info.value.message and info.value.status == 400


def test_unknown_fields_are_ignored_and_reported() -> None:
    req = parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "typical_p": 1, "mystery": {"a": 1}}
    )
    assert set(req.ignored) == {"typical_p", "mystery"}
