"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``) translated onto the gateway's chat and completion requests (pure).

Requests: :func:`parse_chat` and :func:`parse_generate` build the OpenAI request
the Ollama one means and check it with :mod:`gateway.protocol`'s own parsers, so
sampling, tools and structured output are the ones chat completions use.
``options`` map as follows (Ollama's defaults where the request leaves them out,
as Ollama applies them: temperature 0.8, top_k 40, top_p 0.9)::

    num_predict  -> max_tokens (-1 or -2: until the end of generation or the context)
    temperature, top_p, top_k, min_p, seed, stop, presence_penalty, frequency_penalty -> the same
    repeat_penalty -> repetition_penalty
    mirostat (non-zero), typical_p (not 1), tfs_z (not 1) -> 400: ignoring them changes the answer
    num_ctx, num_batch, num_gpu, num_thread, num_keep, repeat_last_n, ... -> ignored (the swarm's)

``format`` ``"json"`` is ``response_format`` ``json_object``, a schema object
``json_schema``. ``/api/generate`` renders ``prompt`` (and ``system``) with the
model's chat template as Ollama does; ``raw: true`` sends the prompt as it is
(a completion). Model names may carry Ollama's ``:latest`` tag.

Responses: NDJSON lines ``{"model", "created_at", "message"|"response", "done":
false}`` while streaming, then one ``done: true`` line with ``done_reason``,
``prompt_eval_count``, ``eval_count`` and the durations in nanoseconds
(``total_duration``, ``load_duration`` 0, ``prompt_eval_duration`` until the
first token, ``eval_duration`` after it); ``stream: false`` gives that last line
with the whole text. Errors are ``{"error": "..."}`` (:func:`error_body`).

No I/O; the standard library only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocol import GenerationRequest, ToolCall, parse_chat_request, parse_completion_request

VERSION = "0.12.0"  # the Ollama API version whose shapes this module speaks
TAG = ":latest"
DEFAULTS: Mapping[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
}
_NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}  # any other value is refused
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class OllamaRequest:
    request: GenerationRequest | None  # None: no prompt, only "load the model" (done_reason "load")
    model: str  # as the client named it (echoed back)
    stream: bool
    ignored_options: tuple[str, ...] = ()


def _bad(message: str, param: str = "body") -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_value")


def model_name(value: Any) -> str:
    """The gateway's model id for an Ollama model name (``:latest`` dropped)."""
    if not isinstance(value, str) or not value:
        raise _bad("model is required", "model")
    return value[: -len(TAG)] if value.endswith(TAG) else value


def _options(body: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    raw = body.get("options")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _bad("options must be an object", "options")
    out: dict[str, Any] = dict(DEFAULTS)
    ignored = []
    for key, value in raw.items():
        if value is None:
            continue
        if key in _OPTIONS:
            out[_OPTIONS[key]] = value
        elif key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise _bad(
                    "num_predict must be a positive integer, -1 (no limit) or -2 (fill the context)",
                    "options.num_predict",
                )
            if value > 0:
                out["max_tokens"] = value
        elif key in _NEUTRAL:
            if value != _NEUTRAL[key]:
                raise _bad(f"option {key}={value!r} is not supported by this server", f"options.{key}")
        else:
            ignored.append(key)
    if "stop" in out and isinstance(out["stop"], str):
        out["stop"] = [out["stop"]]
    return out, tuple(ignored)


def _format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise _bad('format must be "json" or a JSON schema object', "format")


def _stream(body: Mapping[str, Any]) -> bool:
    value = body.get("stream", True)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise _bad("stream must be a boolean", "stream")
    return value


def _refuse(body: Mapping[str, Any], fields: Mapping[str, str]) -> None:
    for name, why in fields.items():
        if body.get(name) not in (None, "", [], False):
            raise _bad(f"{name} is not supported by this server: {why}", name)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise _bad("messages must be a list", "messages")
    out: list[dict[str, Any]] = []
    calls_seen: list[tuple[str, str]] = []  # (name, id) of the assistant's calls so far
    for i, message in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad("each message must be an object", param)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"invalid role {role!r}: expected one of {sorted(ROLES)}", param + ".role")
        if message.get("images"):
            raise _bad("images are not supported by this server (text models only)", param + ".images")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad("content must be a string", param + ".content")
        entry: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise _bad("tool_calls must be a list", param + ".tool_calls")
            entry["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad("a tool call needs function.name", f"{param}.tool_calls[{j}]")
                arguments = fn.get("arguments", {})
                call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}"
                calls_seen.append((fn["name"], call_id))
                entry["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": fn["name"],
                            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                        },
                    }
                )
        if role == "tool":
            name = message.get("tool_name") or message.get("name")
            match = [cid for n, cid in calls_seen if n == name] or [cid for _, cid in calls_seen]
            entry["tool_call_id"] = message.get("tool_call_id") or (match[-1] if match else f"call_tool_{i}")
        out.append(entry)
    return out


def parse_chat(body: Any) -> OllamaRequest:
    """``POST /api/chat`` -> the chat request it means (no messages: load only)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    name = model_name(model)
    _refuse(body, {"think": "this model does not think"})
    messages = _messages(body.get("messages", []))
    stream = _stream(body)
    if not messages:
        return OllamaRequest(None, str(model), stream)
    options, ignored = _options(body)
    chat: dict[str, Any] = {"model": name, "messages": messages, **options}
    if body.get("tools"):
        chat["tools"] = body["tools"]
    fmt = _format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    return OllamaRequest(parse_chat_request(chat), str(model), stream, ignored)


def parse_generate(body: Any) -> OllamaRequest:
    """``POST /api/generate`` -> a chat request (the prompt through the model's template), or with
    ``raw`` a completion request (the prompt as it is). No prompt: load only."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    name = model_name(model)
    _refuse(
        body,
        {
            "images": "text models only",
            "suffix": "fill-in-the-middle is not served",
            "template": "the model's own chat template is used",
            "context": "send the conversation to /api/chat instead",
            "think": "this model does not think",
        },
    )
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise _bad("prompt must be a string", "prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise _bad("system must be a string", "system")
    stream = _stream(body)
    if not prompt:
        return OllamaRequest(None, str(model), stream)
    options, ignored = _options(body)
    fmt = _format(body)
    extra: dict[str, Any] = {"response_format": fmt} if fmt is not None else {}
    if body.get("raw") is True:
        if fmt is not None:
            extra = {"json_schema": fmt.get("json_schema", {}).get("schema", {"type": "object"})}
        request = parse_completion_request(
            {"model": name, "prompt": prompt, "max_tokens": None, **options, **extra}
        )
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        request = parse_chat_request({"model": name, "messages": messages, **options, **extra})
    return OllamaRequest(request, str(model), stream, ignored)


# --------------------------------------------------------------------------- out


def timestamp(unix_s: float) -> str:
    """RFC 3339 in UTC with nanoseconds, as Ollama writes ``created_at``."""
    whole = int(unix_s)
    nanos = int(round((unix_s - whole) * 1e9))
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, nanos - 1_000_000_000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{nanos:09d}Z"


def chunk(kind: str, model: str, unix_s: float, text: str) -> dict[str, Any]:
    """One streamed line: ``kind`` is ``"chat"`` or ``"generate"``."""
    out: dict[str, Any] = {"model": model, "created_at": timestamp(unix_s)}
    if kind == "chat":
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    out["done"] = False
    return out


def tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        try:
            arguments: Any = json.loads(call.arguments)
        except ValueError:
            arguments = {}
        out.append({"id": call.id, "function": {"index": i, "name": call.name, "arguments": arguments}})
    return out


@dataclass(frozen=True)
class Timing:
    """Nanoseconds, as Ollama reports them."""

    total_ns: int
    prompt_eval_ns: int  # until the first token
    eval_ns: int  # after it

    @staticmethod
    def of(total_s: float, ttft_s: float | None) -> Timing:
        first = min(ttft_s if ttft_s is not None else total_s, total_s)
        return Timing(int(total_s * 1e9), int(first * 1e9), int((total_s - first) * 1e9))


def final(
    kind: str,
    model: str,
    unix_s: float,
    *,
    text: str,
    done_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    timing: Timing,
    calls: Sequence[ToolCall] = (),
) -> dict[str, Any]:
    """The ``done: true`` line (streamed: ``text`` is the last piece, often empty; else all of it)."""
    out = chunk(kind, model, unix_s, text)
    if calls and kind == "chat":
        out["message"]["tool_calls"] = tool_calls(calls)
    out.update(
        done=True,
        done_reason="stop" if done_reason == "tool_calls" else done_reason,
        total_duration=timing.total_ns,
        load_duration=0,
        prompt_eval_count=prompt_tokens,
        prompt_eval_duration=timing.prompt_eval_ns,
        eval_count=completion_tokens,
        eval_duration=timing.eval_ns,
    )
    return out


def loaded(kind: str, model: str, unix_s: float) -> dict[str, Any]:
    """The answer to a request without a prompt (Ollama loads the model and says so)."""
    out = chunk(kind, model, unix_s, "")
    out.update(done=True, done_reason="load")
    return out


def _details(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": str(entry.get("architecture") or ""),
        "families": [str(entry["architecture"])] if entry.get("architecture") else None,
        "parameter_size": "",
        "quantization_level": "",
    }


def tags(models: Sequence[Mapping[str, Any]], unix_s: float) -> dict[str, Any]:
    """``GET /api/tags`` from ``/v1/models`` entries (one per id, aliases included)."""
    return {
        "models": [
            {
                "name": str(m["id"]) + TAG,
                "model": str(m["id"]) + TAG,
                "modified_at": timestamp(unix_s),
                "size": 0,  # the weights are spread over the swarm's nodes
                "digest": str(m.get("fingerprint") or ""),
                "details": _details(m),
            }
            for m in models
        ]
    }


def running(models: Sequence[Mapping[str, Any]], unix_s: float) -> dict[str, Any]:
    """``GET /api/ps``: the models with a complete route now."""
    out = []
    for m in models:
        if m.get("status") != "ready":
            continue
        out.append(
            {
                "name": str(m["id"]) + TAG,
                "model": str(m["id"]) + TAG,
                "size": 0,
                "digest": str(m.get("fingerprint") or ""),
                "details": _details(m),
                "expires_at": timestamp(unix_s + 24 * 3600),
                "size_vram": 0,
            }
        )
    return {"models": out}


def show(entry: Mapping[str, Any], template: str | None, unix_s: float) -> dict[str, Any]:
    """``POST /api/show`` for one ``/v1/models`` entry (``template``: its chat template, if known)."""
    capabilities = ["completion"]
    if entry.get("tool_format") is not None:
        capabilities.append("tools")
    info: dict[str, Any] = {
        "general.name": entry.get("name"),
        "general.architecture": entry.get("architecture"),
        "swarm.fingerprint": entry.get("fingerprint"),
        "swarm.block_count": entry.get("n_layers"),
        "swarm.live_nodes": entry.get("live_nodes"),
        "swarm.status": entry.get("status"),
    }
    return {
        "modelfile": f"# served by a swarm of nodes\nFROM {entry.get('name')}\n",
        "parameters": "\n".join(f"{k} {v}" for k, v in DEFAULTS.items()),
        "template": template or "",
        "details": _details(entry),
        "model_info": {k: v for k, v in info.items() if v is not None},
        "capabilities": capabilities,
        "modified_at": timestamp(unix_s),
    }


def find(models: Sequence[Mapping[str, Any]], name: Any) -> Mapping[str, Any] | None:
    """The ``/v1/models`` entry an Ollama model name means (id, GGUF name or fingerprint)."""
    wanted = model_name(name)
    return next((m for m in models if wanted in (m.get("id"), m.get("name"), m.get("fingerprint"))), None)


def error_body(message: str) -> dict[str, Any]:
    """Ollama's error shape: ``{"error": "..."}`` (the status stays the gateway's)."""
    return {"error": message}
