"""OpenAI's Responses API (``POST /v1/responses``) translated onto chat completions (pure).

A Responses request becomes the chat request it means (:func:`parse_request`):
``instructions`` the system message, ``input`` (a string or a list of items:
messages, ``function_call`` and ``function_call_output``) the messages after the
history of ``previous_response_id`` (which the caller looks up and passes in),
flat function ``tools`` OpenAI's nested ones, ``text.format`` the
``response_format``, ``max_output_tokens`` the ``max_completion_tokens``. The chat
request is then checked by :func:`gateway.protocol.parse_chat_request` itself, so
both APIs accept, sample and refuse alike; a refusal names the Responses field.

Out: :func:`response_object` builds the ``response`` object; :class:`EventStream`
turns a generation's text, end and usage into the streamed events, in order::

    response.created, response.in_progress
    (text)  response.output_item.added (message), response.content_part.added,
            response.output_text.delta ...
    (end)   response.output_text.done, response.content_part.done, response.output_item.done,
            per tool call: response.output_item.added (function_call),
            response.function_call_arguments.delta, ...arguments.done, response.output_item.done
    (last)  response.completed, or response.incomplete (max_output_tokens reached)
    (error) error, response.failed

Every event carries ``sequence_number`` 0, 1, 2, ... Item ids derive from the
response id, so nothing here draws randomness. The standard library only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocol import GenerationRequest, ToolCall, parse_chat_request

MAX_INPUT_ITEMS = 4096
ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Known and refused when set: ignoring them would change the answer or lose data.
_REFUSED = {
    "background": "background responses are not supported",
    "conversation": "conversation objects are not supported: chain turns with 'previous_response_id'",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses: use /v1/chat/completions",
}
_KNOWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "previous_response_id",
        "store",
        "metadata",
        "user",
        "truncation",
        "reasoning",
        "include",
        "service_tier",
        "max_tool_calls",
        "stream_options",
        "safety_identifier",
        "prompt_cache_key",
        *_REFUSED,
    }
)
# Sampling extensions passed through to the chat request as they are.
_PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop")
# Chat-request parameter names in errors -> the Responses field they came from.
_PARAMS = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
)


@dataclass(frozen=True)
class ResponsesRequest:
    chat: GenerationRequest  # the same request as a chat completion
    turn: tuple[dict[str, Any], ...]  # the history and this input as chat messages (no instructions)
    stream: bool
    store: bool
    previous_response_id: str | None
    echo: Mapping[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def previous_id(body: Any) -> str | None:
    """``previous_response_id`` (checked), for the caller to look up before :func:`parse_request`."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body", "invalid_type")
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad("'previous_response_id' must be a response id", "previous_response_id", "invalid_type")
    return value


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of text parts", param, "invalid_type")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise _bad(
                f"content part type {kind!r} is not supported: only text parts ('input_text', 'output_text')",
                f"{param}[{k}].type",
                "unsupported_value",
            )
    return "".join(out)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` -> chat messages; consecutive assistant text and ``function_call`` items become one
    assistant message with ``tool_calls``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty list of items", "input", "invalid_type")
    if len(value) > MAX_INPUT_ITEMS:
        raise _bad(f"at most {MAX_INPUT_ITEMS} input items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad("each input item must be an object", param, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise _bad(f"invalid role {role!r}: expected one of {sorted(ROLES)}", param + ".role")
            out.append({"role": role, "content": _text(item.get("content"), param + ".content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a function_call item needs 'call_id'", param + ".call_id", "invalid_type")
            if not isinstance(name, str) or not name:
                raise _bad("a function_call item needs 'name'", param + ".name", "invalid_type")
            if not isinstance(arguments, str):
                raise _bad("'arguments' must be a JSON string", param + ".arguments", "invalid_type")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a function_call_output item needs 'call_id'", param + ".call_id", "invalid_type")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, param + ".output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _bad(
                f"input item type {kind!r} is not supported: use 'message', 'function_call' or "
                "'function_call_output'",
                param + ".type",
                "unsupported_value",
            )
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("'tools' must be a list", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(
                f"tool type {kind!r} is not supported: only 'function' tools",
                f"tools[{i}].type",
                "unsupported_value",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text", "invalid_type")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("'text.format' must be an object", "text.format", "invalid_type")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}


def _rename(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, responses in _PARAMS:
        if param == chat or param.startswith(chat + "[") or param.startswith(chat + "."):
            return responses + param[len(chat) :]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


def parse_request(body: Any, history: Sequence[Mapping[str, Any]] = ()) -> ResponsesRequest:
    """A ``POST /v1/responses`` body (after ``history``, the chat messages of its previous response)
    -> the chat request it means (InvalidRequest naming the Responses field if wrong)."""
    previous = previous_id(body)
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise _bad(f"'{name}' is not supported by this gateway: {why}", name, "unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions", "invalid_type")
    if "input" not in body:
        raise _bad("you must provide 'input'", "input", "missing_required_parameter")
    turn = [dict(m) for m in history] + input_messages(body["input"])
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + turn
    stream = body.get("stream") is True
    store = body.get("store") is not False
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for src, dst in (
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        *((p, p) for p in _PASSED),
    ):
        if body.get(src) is not None:
            chat[dst] = body[src]
    fmt = _format(body.get("text"))
    if fmt is not None and fmt.get("type") != "text":
        chat["response_format"] = fmt
    try:
        request = parse_chat_request(chat)
    except InvalidRequest as err:
        raise InvalidRequest(err.message, param=_rename(err.param), code=err.code) from err
    ignored = tuple(k for k in body if k not in _KNOWN and k not in _PASSED)
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": previous,
        "store": store,
        "temperature": request.temperature,
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "tools": body.get("tools") or [],
        "top_p": request.top_p,
        "truncation": "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
        "reasoning": {"effort": None, "summary": None},
    }
    return ResponsesRequest(
        chat=dataclasses.replace(request, ignored=request.ignored + ignored),
        turn=tuple(turn),
        stream=stream,
        store=store,
        previous_response_id=previous,
        echo=echo,
    )


# --------------------------------------------------------------------------- out


def _suffix(response_id: str) -> str:
    return response_id.split("_", 1)[-1]


def message_id(response_id: str) -> str:
    return "msg_" + _suffix(response_id)


def call_item_id(response_id: str, index: int) -> str:
    return f"fc_{_suffix(response_id)}_{index}"


def message_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {
        "type": "message",
        "id": message_id(response_id),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(response_id: str, index: int, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": call_item_id(response_id, index),
        "call_id": call.id,
        "name": call.name,
        "arguments": "" if status == "in_progress" else call.arguments,
        "status": status,
    }


def output_items(response_id: str, text: str, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The ``output`` list: the assistant's text (unless it only called tools), then one item per call."""
    items = [message_item(response_id, text)] if text or not calls else []
    return items + [call_item(response_id, i, c) for i, c in enumerate(calls)]


def assistant_turn(text: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The output as the chat message a following turn's history holds."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def status_of(finish_reason: str) -> tuple[str, dict[str, str] | None]:
    """``(status, incomplete_details)`` for a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    response_id: str,
    created_at: int,
    request: ResponsesRequest,
    *,
    status: str,
    output: Sequence[Mapping[str, Any]] = (),
    usage_block: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    incomplete_details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": dict(error) if error is not None else None,
        "incomplete_details": dict(incomplete_details) if incomplete_details is not None else None,
        "model": request.chat.model,
        "output": [dict(o) for o in output],
        "usage": dict(usage_block) if usage_block is not None else None,
        **request.echo,
    }


class EventStream:
    """The events of one streamed response (see the module docstring for their order)."""

    def __init__(self, response_id: str, created_at: int, request: ResponsesRequest) -> None:
        self.response_id = response_id
        self.created_at = created_at
        self.request = request
        self._seq = 0
        self._text: list[str] = []
        self._open = False  # the message item was announced
        self._output: list[dict[str, Any]] = []
        self.calls: tuple[ToolCall, ...] = ()

    @property
    def text(self) -> str:
        return "".join(self._text)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.response_id, self.created_at, self.request, status=status, **kw)

    def start(self) -> list[dict[str, Any]]:
        snapshot = self._response("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _part(self) -> dict[str, Any]:
        return {"item_id": message_id(self.response_id), "output_index": 0, "content_index": 0}

    def _open_message(self) -> list[dict[str, Any]]:
        if self._open:
            return []
        self._open = True
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=message_item(self.response_id, "", "in_progress"),
            ),
            self._event("response.content_part.added", **self._part(), part=_text_part("")),
        ]

    def delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._open_message()
        self._text.append(text)
        events.append(self._event("response.output_text.delta", **self._part(), delta=text, logprobs=[]))
        return events

    def end(self, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
        """The generation ended: close the message item (one, empty, if nothing was said and no tool
        was called), then each tool call as its own item."""
        self.calls = tuple(calls)
        events: list[dict[str, Any]] = []
        if self._open or not calls:
            events += self._open_message()
            text = self.text
            item = message_item(self.response_id, text)
            events += [
                self._event("response.output_text.done", **self._part(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._part(), part=_text_part(text)),
                self._event("response.output_item.done", output_index=0, item=item),
            ]
            self._output.append(item)
        for i, call in enumerate(calls):
            at = len(self._output)
            item_id = call_item_id(self.response_id, i)
            done = call_item(self.response_id, i, call)
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=at,
                    item=call_item(self.response_id, i, call, "in_progress"),
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=at,
                    delta=call.arguments,
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=at,
                    name=call.name,
                    arguments=call.arguments,
                ),
                self._event("response.output_item.done", output_index=at, item=done),
            ]
            self._output.append(done)
        return events

    def finish(
        self, finish_reason: str, usage_block: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The last event and the final response object (what the store keeps)."""
        status, details = status_of(finish_reason)
        final = self._response(
            status, output=self._output, usage_block=usage_block, incomplete_details=details
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return self._event(kind, response=final), final

    def fail(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``error``: the OpenAI error object (message, type, param, code)."""
        code = error.get("code") or error.get("type") or "server_error"
        message = str(error.get("message", ""))
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event(
                "response.failed",
                response=self._response(
                    "failed", output=self._output, error={"code": code, "message": message}
                ),
            ),
        ]


def sse_frame(event: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``event: <type>`` and its JSON."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
