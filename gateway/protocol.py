"""OpenAI request and response shapes: parse and validate requests, build responses (pure).

Requests are plain JSON objects; :func:`parse_chat_request` and
:func:`parse_completion_request` check every field (fields in the order of the
OpenAI API reference), refuse what the swarm cannot honour with a 400 that
names the parameter, and return one frozen :class:`GenerationRequest`. The
builders at the bottom produce the response objects, streaming chunks and both
logprobs formats (chat: ``content[]``; completions: parallel lists).

Extensions beyond the OpenAI API are marked ``# extension``: ``top_k``,
``min_p``, ``repetition_penalty``.

Nothing here does I/O or imports an event loop; the standard library only.
"""

from __future__ import annotations

import math
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

# Accepted and ignored: they change nothing about what the swarm computes.
_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    }
)
# Known but not supported: a clear 400 rather than a silent difference.
_UNSUPPORTED = frozenset(
    {
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "suffix",
    }
)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class GenerationRequest:
    """One validated OpenAI request, reduced to what a Route Session needs."""

    kind: str  # "chat" or "completion"
    model: str
    messages: tuple[ChatMessage, ...] = ()  # chat
    prompt_text: str | None = None  # completion, text prompt
    prompt_tokens: tuple[int, ...] | None = None  # completion, token-id prompt
    max_tokens: int | None = None  # None: up to the KV budget
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

    @property
    def n_top_logprobs(self) -> int:
        return self.top_logprobs if self.logprobs else 0


# --------------------------------------------------------------------------- field checks


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


def _check_fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name in _UNSUPPORTED and body[name] not in (None, [], {}):
            raise _bad(f"'{name}' is not supported by this gateway", name, "unsupported_parameter")
        if name not in known and name not in _IGNORED and name not in _UNSUPPORTED:
            raise _bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("you must provide a model parameter", "model", "missing_required_parameter")
    return model


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    n = _integer(body, "n", 1, 128)
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", "n", "unsupported_value")
    logit_bias = body.get("logit_bias")
    if logit_bias not in (None, {}):
        raise _bad("'logit_bias' is not supported by this gateway", "logit_bias", "unsupported_parameter")
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
    for name in ("frequency_penalty", "presence_penalty"):
        # The nodes' samplers do not apply these yet (node/sampling.py): refuse rather than ignore.
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(
                f"'{name}' other than 0 is not supported by this swarm yet; use 'repetition_penalty'",
                name,
                "unsupported_value",
            )
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
    }


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
        if role not in CHAT_ROLES:
            raise _bad(f"invalid role {role!r}: expected one of {sorted(CHAT_ROLES)}", f"messages[{i}].role")
        if message.get("tool_calls") or message.get("function_call"):
            raise _bad("tool calls are not supported", f"messages[{i}]", "unsupported_value")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad("message name must be a string", f"messages[{i}].name", "invalid_type")
        out.append(ChatMessage(role=str(role), content=_content(message.get("content"), i), name=name))
    return tuple(out)


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
            "presence_penalty",
            "response_format",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "temperature",
            "top_p",
            "top_logprobs",
            "top_k",
            "min_p",
            "repetition_penalty",
        }
    )
    _check_fields(body, known)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad(
            "only response_format {'type': 'text'} is supported", "response_format", "unsupported_value"
        )
    messages = _messages(body)
    common = _common(body)
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
        **{**common, "seed": _seed(common["seed"])},
    )


def _prompt(body: Mapping[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return None, tuple(int(t) for t in prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("only one prompt per request is supported", "prompt", "unsupported_value")
    raise _bad(
        "'prompt' must be a string, a list of one string, or a list of token ids", "prompt", "invalid_type"
    )


def parse_completion_request(body: Any) -> GenerationRequest:
    """``POST /v1/completions`` body -> :class:`GenerationRequest` (InvalidRequest if wrong)."""
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
            "top_k",
            "min_p",
            "repetition_penalty",
        }
    )
    _check_fields(body, known)
    text, tokens = _prompt(body)
    best_of = _integer(body, "best_of", 1, 20)
    if best_of is not None and best_of != 1:
        raise _bad("only best_of=1 is supported", "best_of", "unsupported_value")
    if _boolean(body, "echo"):
        raise _bad("'echo' is not supported", "echo", "unsupported_value")
    common = _common(body)
    max_tokens = _integer(body, "max_tokens", 1, 1 << 31)
    top = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return GenerationRequest(
        kind="completion",
        prompt_text=text,
        prompt_tokens=tokens,
        max_tokens=16 if "max_tokens" not in body else max_tokens,
        logprobs=top is not None,
        top_logprobs=top or 0,
        **{**common, "seed": _seed(common["seed"])},
    )


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
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
    }
    if usage_only:
        chunk["choices"] = []
    else:
        chunk["choices"] = [
            {
                "index": 0,
                "delta": delta or {},
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        ]
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
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
    }
    if usage_only:
        chunk["choices"] = []
    else:
        chunk["choices"] = [
            {
                "index": 0,
                "text": text,
                "logprobs": None if logprobs is None else completion_logprobs(logprobs, text_offset),
                "finish_reason": finish_reason,
            }
        ]
    if include_usage:
        chunk["usage"] = usage_block
    return chunk


def model_list(models: Sequence[Mapping[str, Any]], created: int) -> dict[str, Any]:
    """``GET /v1/models`` from the tracker's routable models (one entry per name and fingerprint)."""
    data: list[dict[str, Any]] = []
    for m in models:
        data.append(
            {
                "id": str(m["name"]),
                "object": "model",
                "created": created,
                "owned_by": "swarm",
                "fingerprint": m.get("fingerprint"),
                "n_layers": m.get("n_layers"),  # extension
                "live_nodes": m.get("live_nodes"),
            }
        )  # extension
    return {"object": "list", "data": data}


def sse_event(payload: str) -> bytes:
    """One server-sent event carrying ``payload`` (JSON text or ``[DONE]``)."""
    return b"data: " + payload.encode("utf-8") + b"\n\n"
