"""A chat-template rendering process (``python -m gateway.template_worker``): the far side of the sandbox.

Started by :mod:`gateway.template_sandbox`, never by hand. It limits its own
address space (``RLIMIT_AS``, the first argument in bytes) before it renders
anything, then answers requests on stdin with replies on stdout, one at a
time, each a 4-byte big-endian length and that many bytes of JSON:

request  ``{"source", "bos", "eos", "messages", "add_generation_prompt", "extra", "max_chars"}``
reply    ``{"text": ...}`` or ``{"error": "refused"|"too_long"|"memory"|"bad_request", "message": ...}``

Compiled templates are kept by source (at most :data:`MAX_COMPILED`). After a
``memory`` error the process exits (its heap may be in any state); the parent
starts another. End of input ends it.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
from collections import OrderedDict
from typing import Any, BinaryIO

from gateway.chat_template import ChatTemplate, TemplateError
from gateway.errors import InvalidRequest

MAX_COMPILED = 8
MAX_REQUEST_BYTES = 64 * 1024 * 1024


def _read(stream: BinaryIO) -> dict[str, Any] | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    if size > MAX_REQUEST_BYTES:
        raise SystemExit(2)
    body = stream.read(size)
    if len(body) < size:
        return None
    request = json.loads(body)
    return request if isinstance(request, dict) else {}


def _write(stream: BinaryIO, reply: dict[str, Any]) -> None:
    body = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def _render(
    compiled: OrderedDict[tuple[str, str, str], ChatTemplate], request: dict[str, Any]
) -> dict[str, Any]:
    key = (str(request["source"]), str(request.get("bos", "")), str(request.get("eos", "")))
    template = compiled.get(key)
    if template is None:
        template = ChatTemplate(key[0], bos_token=key[1], eos_token=key[2])
        compiled[key] = template
        while len(compiled) > MAX_COMPILED:
            compiled.popitem(last=False)
    compiled.move_to_end(key)
    text = template.render(
        list(request["messages"]),
        add_generation_prompt=bool(request.get("add_generation_prompt", True)),
        max_chars=int(request["max_chars"]),
        **dict(request.get("extra") or {}),
    )
    return {"text": text}


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    compiled: OrderedDict[tuple[str, str, str], ChatTemplate] = OrderedDict()
    while (request := _read(stdin)) is not None:
        try:
            reply = _render(compiled, request)
        except MemoryError:
            compiled.clear()
            _write(stdout, {"error": "memory", "message": "the chat template needs more memory than allowed"})
            return
        except TemplateError as err:
            reply = {"error": "refused", "message": err.message}
        except InvalidRequest as err:
            reply = {"error": "too_long", "message": err.message}
        except (KeyError, TypeError, ValueError, RecursionError) as err:
            reply = {"error": "bad_request", "message": f"{type(err).__name__}: {err}"[:500]}
        _write(stdout, reply)


if __name__ == "__main__":
    main()
