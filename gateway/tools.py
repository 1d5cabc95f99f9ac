"""Tool calling: tools into the prompt, the model's calls back out in OpenAI's ``tool_calls`` shape (pure).

Format. Calls are written in the Hermes format most open chat models were
trained on (Qwen 2.5, Hermes, many fine-tunes)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rendering. A model whose own chat template knows that format (its Jinja source
mentions ``<tool_call>``) gets ``tools`` and the history's ``tool_calls`` /
``tool`` messages through the template itself, as ``transformers`` passes them.
A template without a tool format (SmolLM2's, Gemma's) cannot express tools:
the gateway then says so (``/v1/models`` ``tool_format: "generic"``, docs) and
uses a generic rendering through the same template: the tool list and the call
format go into the system message, past calls become the assistant's text in
the format above, and tool results become user turns wrapped in
``<tool_response>``. The answer is parsed the same way either way.

Constraint. With ``tool_choice`` ``required`` or a named function the output
is constrained (``gateway/structured.py``) to calls whose arguments match the
function's JSON schema; with ``auto`` the model chooses and whatever it wrote
in the format above is parsed (a call naming an unknown function or with
arguments that are not JSON stays text).

Streaming. :class:`ToolStream` passes text through until ``<tool_call>``
could be starting, holds it back from there, and hands the parsed calls over
when the generation ends.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import ChatMessage, GenerationRequest, Tool, ToolCall

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def template_has_tools(source: str) -> bool:
    """Whether a chat template renders tools itself in the Hermes format."""
    return "tools" in source and TOOL_OPEN in source


def tool_format(source: str) -> str:
    return "hermes" if template_has_tools(source) else "generic"


def _tool_json(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
        }
        for t in tools
    ]


def _instructions(request: GenerationRequest) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in _tool_json(request.tools))
    text = (
        "You can call functions. The functions (JSON schema of their arguments):\n"
        f"{listing}\n"
        "To call a function, answer with exactly:\n"
        f'{TOOL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{TOOL_CLOSE}\n'
        "Results come back as <tool_response>...</tool_response>; then answer the user."
    )
    if request.tool_choice == "required":
        text += "\nYou must call a function now."
    elif request.tool_choice == "function":
        text += f"\nYou must call the function {request.tool_name} now."
    return text


def _call_text(call: ToolCall) -> str:
    try:
        arguments: Any = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_OPEN}\n{body}\n{TOOL_CLOSE}"


def template_messages(request: GenerationRequest, template_source: str) -> tuple[list[dict[str, Any]], dict]:
    """The messages (and extra template variables) to render for a chat request."""
    messages = request.messages
    uses_tools = bool(request.tools) or any(m.tool_calls or m.role == "tool" for m in messages)
    if not uses_tools:
        return [m.to_template() for m in messages], {}
    if template_has_tools(template_source):
        extra = {"tools": _tool_json(request.tools)} if request.tools_active else {}
        return [m.to_template() for m in messages], extra
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            text = "\n".join([*([m.content] if m.content else []), *(_call_text(c) for c in m.tool_calls)])
            out.append({"role": "assistant", "content": text})
        elif m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        else:
            out.append(m.to_template())
    if request.tools_active:
        note = _instructions(request)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, {}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_calls(text: str, tools: Sequence[Tool]) -> tuple[str, tuple[ToolCall, ...]]:
    """Split generated text into (content before the calls, calls). Text that is not a valid call to one
    of ``tools`` stays content. Each call's JSON is decoded as JSON (a string argument may contain the
    closing tag itself)."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return text, ()
    names = {t.name for t in tools}
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = start
    while at < len(text):
        if not text.startswith(TOOL_OPEN, at):
            return text, ()
        body = at + len(TOOL_OPEN)
        while body < len(text) and text[body].isspace():
            body += 1
        try:
            obj, end = decoder.raw_decode(text, body)
        except ValueError:
            return text, ()
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return text, ()
        arguments = obj.get("arguments", obj.get("parameters", {}))
        args_text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(new_call_id(), str(obj["name"]), args_text))
        rest = text[end:].lstrip()
        if rest.startswith(TOOL_CLOSE):
            rest = rest[len(TOOL_CLOSE) :].lstrip()
        at = len(text) - len(rest)
    return text[:start].rstrip(), tuple(calls)


@dataclass
class ToolStream:
    """Streaming text with tool calls held back (see the module docstring)."""

    tools: Sequence[Tool]
    _held: str = ""
    _calling: bool = False
    _content: list[str] = field(default_factory=list)

    def push(self, text: str) -> str:
        """Text that can go to the client now."""
        if self._calling:
            self._held += text
            return ""
        buf = self._held + text
        at = buf.find(TOOL_OPEN)
        if at >= 0:
            self._calling = True
            self._held = buf[at:]
            out = buf[:at]
        else:
            keep = _partial_suffix(buf, TOOL_OPEN)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self._content.append(out)
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(the rest of the content, the calls) once the generation ended."""
        held, self._held = self._held, ""
        if not self._calling:
            self._content.append(held)
            return held, ()
        content, calls = parse_calls(held, self.tools)
        if not calls:  # not a valid call after all: it is text
            self._content.append(held)
            return held, ()
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def assistant_message(content: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The response's ``message`` with OpenAI's ``tool_calls``."""
    return {
        "role": "assistant",
        "content": content or None,
        "refusal": None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }


__all__ = [
    "ChatMessage",
    "ToolStream",
    "assistant_message",
    "parse_calls",
    "template_messages",
    "tool_format",
]
