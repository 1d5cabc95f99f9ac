"""Constrained output: response_format, tools and llama.cpp's grammar/json_schema as one grammar.

The gateway turns what a request asks for into one llguidance grammar (Lark
syntax, JSON schemas embedded as ``%json{...}``) that travels in OPEN
(``SamplingParams.grammar``) to the last stage, which enforces it token by token
(``node/constraints.py``). Every grammar is checked here first with llguidance
itself, so a schema feature it cannot enforce (``not``, ``if``/``then``, a
remote ``$ref``...) is a 400 that names it, before any node is involved.

JSON is generated compactly with one space after ``,`` and ``:`` (llguidance's
``whitespace_flexible`` off): small models otherwise tend to pad JSON with
whitespace until ``max_tokens``.

No I/O; llguidance and the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from gateway.errors import InvalidRequest
from gateway.protocol import GenerationRequest, Tool

JSON_OPTIONS: JsonCompileOptions = {  # noqa: UP037 - a stub-only type
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def _check(grammar: str, param: str, what: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        detail = "; ".join(messages) or "llguidance refused it"
        raise InvalidRequest(
            f"{what} cannot be enforced by constrained sampling: {detail}",
            param=param,
            code="unsupported_value",
        )
    return grammar


def _schema_with_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    guidance = dict(out.get("x-guidance") or {})
    for key, value in dict(JSON_OPTIONS).items():
        guidance.setdefault(key, value)
    out["x-guidance"] = guidance
    return out


def json_grammar(schema: Mapping[str, Any], *, param: str = "response_format") -> str:
    """The grammar of JSON text matching ``schema`` (400 naming what llguidance cannot enforce)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_OPTIONS)
    except ValueError as err:
        raise InvalidRequest(f"the JSON schema is not valid: {err}", param=param) from err
    return _check(grammar, param, "the JSON schema")


def text_grammar(text: str, *, param: str = "grammar") -> str:
    """llama.cpp's ``grammar`` field: GBNF (llama.cpp's syntax) or Lark."""
    try:
        grammar = llguidance.grammar_from("gbnf", text)
    except ValueError as err:
        raise InvalidRequest(f"the grammar cannot be read: {err}", param=param) from err
    return _check(grammar, param, "the grammar")


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """JSON schema of one call ``{"name": ..., "arguments": {...}}`` to any of ``tools``."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters) or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def tool_grammar(tools: Sequence[Tool], *, parallel: bool) -> str:
    """Output that is one (or, with ``parallel``, one or more) tool call in the Hermes format, the
    arguments matching the function's JSON schema."""
    schema = json.dumps(_schema_with_options(call_schema(tools)), ensure_ascii=False)
    call = f'"{TOOL_OPEN}\\n" %json {schema} "\\n{TOOL_CLOSE}"'
    lark = f'start: call ("\\n" call)*\ncall: {call}\n' if parallel else f"start: {call}\n"
    return _check(llguidance.LLMatcher.grammar_from_lark(lark), "tools", "the tools' parameter schemas")


def grammar_for(request: GenerationRequest) -> str:
    """The grammar a request's output must follow ("" for free text)."""
    if request.tools_active and request.tool_choice in ("required", "function"):
        tools = request.tools
        if request.tool_choice == "function":
            tools = tuple(t for t in tools if t.name == request.tool_name)
        return tool_grammar(tools, parallel=request.parallel_tool_calls and len(tools) > 1)
    fmt = request.response_format
    if fmt.kind in ("json_object", "json_schema"):
        param = "response_format" if fmt.name != "json_schema" or request.kind == "chat" else "json_schema"
        return json_grammar(fmt.schema or {"type": "object"}, param=param)
    if fmt.kind == "grammar":
        return text_grammar(fmt.grammar)
    return ""


def check_tool_schemas(tools: Sequence[Tool]) -> None:
    """Every tool's parameters must be enforceable (a named or required call is constrained by them)."""
    for i, tool in enumerate(tools):
        json_grammar(tool.parameters or {"type": "object"}, param=f"tools[{i}].function.parameters")
