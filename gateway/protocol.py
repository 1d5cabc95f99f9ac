"""OpenAI request and response shapes: parse and validate requests, build responses (pure).

Requests are plain JSON objects; :func:`parse_chat_request` and
:func:`parse_completion_request` check every field (fields in the order of the
OpenAI API reference), refuse what the swarm cannot honour with a 400 that
names the parameter, and return one frozen :class:`GenerationRequest`. The
builders at the bottom produce the response objects, streaming chunks and both
logprobs formats (chat: ``content[]``; completions: parallel lists).

Extensions beyond the OpenAI API are marked ``# extension``: ``top_k``,
``min_p``, ``repetition_penalty``, ``cache_prompt``, ``speculation`` (true/false: speculative
decoding for this request, overriding the gateway's default; or the proposer: "off", "ngram",
"draft", "auto"), llama.cpp's ``grammar`` (GBNF or
Lark) and ``json_schema``, and (chat) ``conversation_id`` (:mod:`gateway.conversations`).

Fields this module does not know are ignored (their names are returned in
:attr:`GenerationRequest.ignored` for a debug log), like vLLM, llama.cpp and
Ollama do; known fields whose absence would change the answer (audio, guided
decoding under vLLM's names, ``ignore_eos``...) get a 400 naming them.

Nothing here does I/O or imports an event loop; the standard library only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_SEED = 2**63 - 1
MAX_MESSAGES = 4096
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

MAX_N = 16
MAX_LOGIT_BIAS = 300
MAX_TOOLS = 128
# Known, and refused when set: ignoring them would change the answer. (Anything else unknown is ignored.)
_UNSUPPORTED = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "prediction",
        "web_search_options",
        "suffix",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "ignore_eos",
        "min_tokens",
        "mirostat",
        "images",
    }
)
_HINTS = {
    "functions": "use 'tools'",
    "function_call": "use 'tool_choice'",
    "guided_json": "use 'response_format'",
    "guided_regex": "use 'grammar' (Lark)",
    "guided_choice": "use 'response_format' with an enum schema",
    "guided_grammar": "use 'grammar'",
}


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant made (history) or makes (response)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments
    strict: bool = False


@dataclass(frozen=True)
class ResponseFormat:
    """``response_format`` (or llama.cpp's ``json_schema``/``grammar``): what the output must match."""

    kind: str  # "text", "json_object", "json_schema", "grammar"
    schema: Mapping[str, Any] | None = None
    name: str = ""
    grammar: str = ""  # kind "grammar": GBNF or Lark text


@dataclass(frozen=True)
class GenerationRequest:
    """One validated OpenAI request, reduced to what a Route Session needs."""

    kind: str  # "chat" or "completion"
    model: str
    messages: tuple[ChatMessage, ...] = ()  # chat
    prompt_text: str | None = None  # completion, text prompt
    prompt_tokens: tuple[int, ...] | None = None  # completion, token-id prompt
    max_tokens: int | None = None  # None: up to the KV budget
    max_tokens_cap: int = 0  # extension (set by the gateway, not the client): None above means up to this
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension
    min_p: float = 0.0  # extension
    repetition_penalty: float = 1.0  # extension
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: the gateway picks one
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: ResponseFormat = ResponseFormat("text")
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # "auto", "none", "required" or "function"
    tool_name: str = ""  # tool_choice "function": the function's name
    parallel_tool_calls: bool = True
    cache_prompt: bool = True  # extension (llama.cpp's name): reuse a kept prefix of this client
    conversation_id: str | None = None  # extension (chat): the gateway keeps the history (conversations)
    speculation: bool | None = None  # extension: speculative decoding on/off; None: the gateway decides
    proposer: str = ""  # extension (speculation "ngram"/"draft"): who drafts; "": the last stage decides
    ignored: tuple[str, ...] = ()  # unknown fields, ignored (logged at debug level)

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def n_top_logprobs(self) -> int:
        return self.top_logprobs if self.logprobs else 0


# --------------------------------------------------------------------------- field checks

MAX_JSON_DEPTH = 64


def _path(parts: Sequence[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, str):  # a key may itself be the invalid string: never echo it raw
            part = part.encode("utf-8", "backslashreplace").decode("utf-8")
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check_json_value(value: Any) -> None:
    """A parsed JSON body fit for the parsers below: nesting at most :data:`MAX_JSON_DEPTH` levels
    and every string (keys too) valid Unicode, without lone surrogates (``"\\ud800"`` parses
    in Python but cannot be encoded, tokenized or rendered). 400 naming the first offending
    field otherwise. Iterative, so a deep body cannot exhaust the stack here."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, where = stack.pop()
        if len(where) > MAX_JSON_DEPTH:
            raise _bad(
                f"The JSON body of your request nests deeper than {MAX_JSON_DEPTH} levels",
                where[0] if where and isinstance(where[0], str) else "body",
                "invalid_json",
            )
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, dict):
            for key, sub in item.items():
                _check_text(key, (*where, key))
                stack.append((sub, (*where, key)))
        elif isinstance(item, list):
            stack.extend((sub, (*where, i)) for i, sub in enumerate(item))


def _check_text(text: str, where: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        raise _bad(
            f"{_path(where) or 'The body'} contains a lone surrogate (\\u{ord(bad):04x}), which is not "
            "valid Unicode",
            _path(where) or "body",
        ) from err


def _bad(message: str, param: str, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code or "invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name, "invalid_type")
    if not lo <= value <= hi:
        raise _bad(f"{value} is not a valid value for '{name}': it must be between {lo:g} and {hi:g}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad(f"'{name}' must be an integer", name, "invalid_type")
    if not lo <= value <= hi:
        raise _bad(f"{value} is not a valid value for '{name}': it must be between {lo} and {hi}", name)
    return int(value)


def _boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name, "invalid_type")
    return value


SPECULATION_CHOICES = ("off", "ngram", "draft", "auto")


def _speculation(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``speculation`` extension: true/false, or the proposer -- "off", "ngram" (n-gram lookup),
    "draft" (the last stage's draft model; n-gram lookup where it has none), "auto" (the gateway
    decides whether, the last stage with what: as if absent)."""
    value = body.get("speculation")
    if value is None or isinstance(value, bool):
        return {"speculation": value, "proposer": ""}
    if value not in SPECULATION_CHOICES:
        raise _bad(
            f"'speculation' must be true, false or one of {', '.join(map(repr, SPECULATION_CHOICES))}",
            "speculation",
            "invalid_value" if isinstance(value, str) else "invalid_type",
        )
    if value == "off":
        return {"speculation": False, "proposer": ""}
    if value == "auto":
        return {"speculation": None, "proposer": ""}
    return {"speculation": True, "proposer": value}


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise _bad(f"a stop sequence is longer than {MAX_STOP_CHARS} characters", "stop")
    return tuple(dict.fromkeys(s for s in items if s))  # empty strings never match: drop them


def _check_fields(body: Mapping[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """Refuse known-but-unsupported fields that are set; return the unknown ones (ignored)."""
    ignored = []
    for name in body:
        if name in _UNSUPPORTED and body[name] not in (None, [], {}, False, 0):
            hint = f"; {_HINTS[name]}" if name in _HINTS else ""
            raise _bad(f"'{name}' is not supported by this gateway{hint}", name, "unsupported_parameter")
        if name not in known and name not in _UNSUPPORTED:
            ignored.append(name)
    return tuple(ignored)


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(
            "'logit_bias' must be an object mapping token ids to numbers", "logit_bias", "invalid_type"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad(f"logit_bias key {key!r} is not a token id", "logit_bias", "invalid_type") from None
        if token < 0:
            raise _bad(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise _bad(f"logit_bias value for token {token} must be a number in [-100, 100]", "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("you must provide a model parameter", "model", "missing_required_parameter")
    return model


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    n = _integer(body, "n", 1, 128) or 1
    if n > MAX_N:
        raise _bad(f"n={n} is more than this gateway's limit of {MAX_N} choices", "n", "unsupported_value")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(options) - {"include_usage", "include_obfuscation"}
        if unknown:
            raise _bad(f"unknown stream option(s) {sorted(unknown)}", "stream_options")
        include_usage = _boolean(options, "include_usage")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        top_p = 1e-9  # OpenAI accepts 0: keep only the most likely token
    return {
        "model": _model(body),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "seed": _integer(body, "seed", -MAX_SEED - 1, MAX_SEED),
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": top_p,
        "top_k": _integer(body, "top_k", 0, 1 << 20) or 0,
        "min_p": _number(body, "min_p", 0.0, 0.0, 0.999),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        "n": n,
        "logit_bias": _logit_bias(body),
        "cache_prompt": body.get("cache_prompt") is not False,
        **_speculation(body),
        "response_format": _grammar_fields(body),
    }


def _grammar_fields(body: Mapping[str, Any]) -> ResponseFormat:
    """llama.cpp's ``grammar`` (GBNF or Lark) and ``json_schema`` extensions (both endpoints)."""
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar is not None and schema is not None:
        raise _bad("give either 'grammar' or 'json_schema', not both", "grammar")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise _bad("'grammar' must be a non-empty string (GBNF or Lark)", "grammar", "invalid_type")
        return ResponseFormat("grammar", grammar=grammar)
    if schema is not None:
        if not isinstance(schema, dict):
            raise _bad("'json_schema' must be a JSON schema object", "json_schema", "invalid_type")
        return ResponseFormat("json_schema", schema=schema, name="json_schema")
    return ResponseFormat("text")


def _response_format(body: Mapping[str, Any], fallback: ResponseFormat) -> ResponseFormat:
    fmt = body.get("response_format")
    if fmt is None:
        return fallback
    param = "response_format"
    if not isinstance(fmt, dict):
        raise _bad("'response_format' must be an object", param, "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return fallback
    if fallback.kind != "text":
        raise _bad("give either 'response_format' or 'grammar'/'json_schema', not both", param)
    if kind == "json_object":
        schema = fmt.get("schema", {"type": "object"})  # llama.cpp's extension: a schema here too
        if not isinstance(schema, dict):
            raise _bad(
                "response_format.schema must be a JSON schema object", param + ".schema", "invalid_type"
            )
        return ResponseFormat("json_object", schema=schema)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(
                "response_format.json_schema must be an object", param + ".json_schema", "invalid_type"
            )
        name = spec.get("name", "")
        if not isinstance(name, str):
            raise _bad("response_format.json_schema.name must be a string", param + ".json_schema.name")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad(
                "response_format.json_schema.schema must be a JSON schema object",
                param + ".json_schema.schema",
                "invalid_type",
            )
        return ResponseFormat("json_schema", schema=schema, name=name)
    raise _bad(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
        param + ".type",
        "unsupported_value",
    )


def _tools(body: Mapping[str, Any]) -> tuple[Tool, ...]:
    raw = body.get("tools")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list", "tools", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools", "tools")
    out: list[Tool] = []
    for i, tool in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad("only tools of type 'function' are supported", param + ".type", "unsupported_value")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("a tool needs function.name", param + ".function.name", "missing_required_parameter")
        name = fn["name"]
        if len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
            raise _bad(
                f"function name {name!r} must be 1-64 letters, digits, '_' or '-'", param + ".function.name"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad("function.parameters must be a JSON schema object", param + ".function.parameters")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise _bad("function.description must be a string", param + ".function.description")
        if any(t.name == name for t in out):
            raise _bad(f"two tools are named {name!r}", param + ".function.name")
        out.append(Tool(name, description, params, bool(fn.get("strict", False))))
    return tuple(out)


def _tool_choice(body: Mapping[str, Any], tools: Sequence[Tool]) -> tuple[str, str]:
    value = body.get("tool_choice")
    if value is None:
        return ("auto", "") if tools else ("none", "")
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise _bad("tool_choice 'required' needs 'tools'", "tool_choice")
        return str(value), ""
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not any(t.name == name for t in tools):
            raise _bad(f"tool_choice names a function that is not in 'tools': {name!r}", "tool_choice")
        return "function", name
    raise _bad(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
        "invalid_value",
    )


_EXTENSIONS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "cache_prompt",
    "speculation",
    "grammar",
    "json_schema",
)
CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def conversation_id(value: Any) -> str | None:
    """A conversation id from a body field or header (None: none given); 400 if malformed."""
    if value is None:
        return None
    if not isinstance(value, str) or not CONVERSATION_ID.fullmatch(value):
        raise _bad(
            "'conversation_id' must be 1-128 letters, digits and . _ : -", "conversation_id", "invalid_value"
        )
    return value


def _seed(value: int | None) -> int | None:
    # The wire seed is unsigned; fold negative OpenAI seeds into range deterministically.
    return None if value is None else value % (1 << 63)


# --------------------------------------------------------------------------- requests


def _content(value: Any, index: int) -> str:
    param = f"messages[{index}].content"
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str] = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad("only text content parts are supported", param, "unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad("message content must be a string or a list of text parts", param, "invalid_type")


def _messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages", "missing_required_parameter")
    if len(raw) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages", "messages")
    out: list[ChatMessage] = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _bad("each message must be an object", f"messages[{i}]", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(f"invalid role {role!r}: expected one of {sorted(CHAT_ROLES)}", f"messages[{i}].role")
        if message.get("function_call"):
            raise _bad("'function_call' in messages is not supported; use 'tool_calls'", f"messages[{i}]")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad("message name must be a string", f"messages[{i}].name", "invalid_type")
        calls = _message_tool_calls(message.get("tool_calls"), i) if role == "assistant" else ()
        call_id = message.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise _bad("a tool message needs 'tool_call_id'", f"messages[{i}].tool_call_id", "invalid_type")
        out.append(
            ChatMessage(
                role=str(role),
                content=_content(message.get("content"), i),
                name=name,
                tool_calls=calls,
                tool_call_id=call_id if role == "tool" else None,
            )
        )
    return tuple(out)


def _message_tool_calls(raw: Any, index: int) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    param = f"messages[{index}].tool_calls"
    if not isinstance(raw, list):
        raise _bad("'tool_calls' must be a list", param, "invalid_type")
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("a tool call needs function.name", f"{param}[{j}].function.name", "invalid_type")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(str(call.get("id") or f"call_{index}_{j}"), fn["name"], arguments))
    return tuple(calls)


def parse_chat_request(body: Any) -> GenerationRequest:
    """``POST /v1/chat/completions`` body -> :class:`GenerationRequest` (InvalidRequest if wrong)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body", "invalid_type")
    known = frozenset(
        {
            "messages",
            "model",
            "frequency_penalty",
            "logit_bias",
            "logprobs",
            "max_completion_tokens",
            "max_tokens",
            "n",
            "parallel_tool_calls",
            "presence_penalty",
            "response_format",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "temperature",
            "tool_choice",
            "tools",
            "top_p",
            "top_logprobs",
            *_EXTENSIONS,
            "conversation_id",
        }
    )
    ignored = _check_fields(body, known)
    messages = _messages(body)
    common = _common(body)
    common["response_format"] = _response_format(body, common["response_format"])
    tools = _tools(body)
    choice, tool_name = _tool_choice(body, tools)
    if choice != "none" and tools and common["response_format"].kind != "text":
        raise _bad("give either tools or a response format, not both", "response_format")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 31)
    legacy = _integer(body, "max_tokens", 1, 1 << 31)
    if max_tokens is None:
        max_tokens = legacy
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _bad("'logprobs' must be true when 'top_logprobs' is set", "top_logprobs")
    return GenerationRequest(
        kind="chat",
        messages=messages,
        max_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top or 0,
        tools=tools,
        tool_choice=choice,
        tool_name=tool_name,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        conversation_id=conversation_id(body.get("conversation_id")),
        ignored=ignored,
        **{**common, "seed": _seed(common["seed"])},
    )


MAX_PROMPTS = 16  # prompts in one completions request
MAX_BATCH_CHOICES = 64  # prompts x n


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


def _prompts(body: Mapping[str, Any]) -> tuple[tuple[str | None, tuple[int, ...] | None], ...]:
    """``prompt``: a string, a list of token ids, or a list of strings and token-id lists (one
    completion per entry, OpenAI's batch form)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return ((prompt, None),)
    if isinstance(prompt, list) and _token_list(prompt):
        return ((None, tuple(int(t) for t in prompt)),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad(
                f"{len(prompt)} prompts is more than this gateway's limit of {MAX_PROMPTS} per request",
                "prompt",
                "unsupported_value",
            )
        return tuple((p, None) if isinstance(p, str) else (None, tuple(int(t) for t in p)) for p in prompt)
    raise _bad(
        "'prompt' must be a string, a list of token ids, or a list of strings or token-id lists",
        "prompt",
        "invalid_type",
    )


def parse_completion_request(body: Any) -> GenerationRequest:
    """``POST /v1/completions`` body with one prompt -> :class:`GenerationRequest` (InvalidRequest if
    wrong, or if it has several prompts: see :func:`parse_completion_batch`)."""
    batch = parse_completion_batch(body)
    if len(batch) > 1:
        raise _bad("this takes one prompt; the request has several", "prompt", "unsupported_value")
    return batch[0]


def parse_completion_batch(body: Any) -> tuple[GenerationRequest, ...]:
    """``POST /v1/completions`` body -> one :class:`GenerationRequest` per prompt, in order (the
    same settings each); choice ``j`` of prompt ``i`` is the response's choice ``i * n + j``."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body", "invalid_type")
    known = frozenset(
        {
            "model",
            "prompt",
            "best_of",
            "echo",
            "frequency_penalty",
            "logit_bias",
            "logprobs",
            "max_tokens",
            "n",
            "presence_penalty",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "temperature",
            "top_p",
            *_EXTENSIONS,
        }
    )
    ignored = _check_fields(body, known)
    prompts = _prompts(body)
    best_of = _integer(body, "best_of", 1, 20)
    if best_of is not None and best_of != 1:
        raise _bad("only best_of=1 is supported", "best_of", "unsupported_value")
    if _boolean(body, "echo"):
        raise _bad("'echo' is not supported", "echo", "unsupported_value")
    common = _common(body)
    if len(prompts) * common["n"] > MAX_BATCH_CHOICES:
        raise _bad(
            f"{len(prompts)} prompts x n={common['n']} is more than this gateway's limit of "
            f"{MAX_BATCH_CHOICES} choices per request",
            "n",
            "unsupported_value",
        )
    max_tokens = _integer(body, "max_tokens", 1, 1 << 31)
    top = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return tuple(
        GenerationRequest(
            kind="completion",
            prompt_text=text,
            prompt_tokens=tokens,
            max_tokens=16 if "max_tokens" not in body else max_tokens,
            logprobs=top is not None,
            top_logprobs=top or 0,
            ignored=ignored,
            **{**common, "seed": _seed(common["seed"])},
        )
        for text, tokens in prompts
    )


def merge_completions(bodies: Sequence[Mapping[str, Any]], n: int) -> dict[str, Any]:
    """The ``text_completion`` of a batch from one per prompt (in prompt order): every choice
    re-indexed ``prompt * n + j``, usage summed; id, created and fingerprint from the first."""
    if not bodies:
        raise ValueError("no completions to merge")
    choices = []
    for i, body in enumerate(bodies):
        for choice in body["choices"]:
            choices.append({**choice, "index": i * n + int(choice["index"])})
    prompt = sum(int(b["usage"]["prompt_tokens"]) for b in bodies)
    completion = sum(int(b["usage"]["completion_tokens"]) for b in bodies)
    return {**bodies[0], "choices": choices, "usage": usage(prompt, completion)}


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob entry, ready for either format."""

    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _lp(value: float) -> float:
    # JSON has no -Infinity; OpenAI reports -9999.0 for "never".
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _lp(e.logprob),
                "bytes": list(e.token_bytes),
                "top_logprobs": [{"token": t, "logprob": _lp(lp), "bytes": list(b)} for t, b, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    offsets: list[int] = []
    at = text_offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    tops: list[dict[str, float]] = []
    for e in entries:
        top: dict[str, float] = {}
        for t, _b, lp in e.top:
            top.setdefault(t, _lp(lp))
        tops.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    logprobs: Sequence[TokenLogprob] | None,
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": fingerprint,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    fingerprint: str,
    *,
    delta: dict[str, Any] | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    finish_reason: str | None = None,
    usage_block: dict[str, int] | None = None,
    include_usage: bool = False,
    usage_only: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``usage_only`` is the final chunk with empty choices."""
    choice = {
        "index": 0,
        "delta": delta or {},
        "logprobs": None if logprobs is None else chat_logprobs(logprobs),
        "finish_reason": finish_reason,
    }
    return _stream_chunk(
        "chat.completion.chunk",
        rid,
        created,
        model,
        fingerprint,
        None if usage_only else choice,
        include_usage=include_usage,
        usage_block=usage_block,
    )


def _stream_chunk(
    kind: str,
    rid: str,
    created: int,
    model: str,
    fingerprint: str,
    choice: dict[str, Any] | None,
    *,
    include_usage: bool,
    usage_block: dict[str, int] | None,
) -> dict[str, Any]:
    """The envelope every streamed chunk shares: one choice, or none (the final usage-only chunk), and
    the ``usage`` key only when the client asked for usage (``stream_options.include_usage``)."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [] if choice is None else [choice],
    }
    if include_usage:
        chunk["usage"] = usage_block
    return chunk


def text_completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    logprobs: Sequence[TokenLogprob] | None,
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None if logprobs is None else completion_logprobs(logprobs, 0),
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": fingerprint,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    fingerprint: str,
    *,
    text: str = "",
    logprobs: Sequence[TokenLogprob] | None = None,
    text_offset: int = 0,
    finish_reason: str | None = None,
    usage_block: dict[str, int] | None = None,
    include_usage: bool = False,
    usage_only: bool = False,
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None if logprobs is None else completion_logprobs(logprobs, text_offset),
        "finish_reason": finish_reason,
    }
    return _stream_chunk(
        "text_completion",
        rid,
        created,
        model,
        fingerprint,
        None if usage_only else choice,
        include_usage=include_usage,
        usage_block=usage_block,
    )


def model_id(name: str) -> str:
    """The stable id of a model a person would type: its name, lowercase, runs of other characters as
    one dash (``"SmolLM2 135M Instruct"`` -> ``"smollm2-135m-instruct"``)."""
    out = []
    for ch in name.lower():
        out.append(ch if ch.isalnum() or ch in "._" else "-")
    return "-".join(filter(None, "".join(out).split("-"))) or "model"


def model_list(
    models: Sequence[Mapping[str, Any]],
    created: int,
    aliases: Mapping[str, str] | None = None,
    tool_formats: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``GET /v1/models``: every model the tracker knows, routable or still being assembled.

    One entry per model under its stable id (:func:`model_id`), plus one per alias naming it. Extensions:
    ``name`` (the GGUF's), ``fingerprint``, ``n_layers``, ``live_nodes``, ``status`` (``ready`` when a
    complete route exists, else ``assembling``), ``coverage`` (share of layers served), ``tool_format``.
    """
    data: list[dict[str, Any]] = []
    for m in models:
        name = str(m.get("name", ""))
        fingerprint = m.get("fingerprint")
        routable = bool(m.get("routable"))
        coverage = m.get("coverage")
        entry = {
            # A name the tracker does not resolve to this model (unregistered, no trusted holder, or
            # another model's): the model is listed, and reached, by its fingerprint.
            "id": model_id(name) if m.get("name_resolves", True) else str(fingerprint),
            "object": "model",
            "created": created,
            "owned_by": "swarm",
            "name": name,  # extension
            "fingerprint": fingerprint,
            "n_layers": m.get("n_layers"),
            "live_nodes": m.get("live_nodes"),
            "status": "ready" if routable else "assembling",
            "coverage": 1.0 if routable else (coverage if isinstance(coverage, int | float) else None),
            "tool_format": (tool_formats or {}).get(str(fingerprint), None),
        }
        data.append(entry)
        for alias, target in (aliases or {}).items():
            if target in (name, fingerprint, entry["id"]):
                data.append({**entry, "id": alias})
    return {"object": "list", "data": data}


def sse_event(payload: str) -> bytes:
    """One server-sent event carrying ``payload`` (JSON text or ``[DONE]``)."""
    return b"data: " + payload.encode("utf-8") + b"\n\n"
