"""Chat templates rendered in worker processes, with a time limit and a memory limit, off the event loop.

A model's chat template is a program written by whoever published the model
file. jinja2's sandbox (``gateway/chat_template.py``) stops it from reaching
Python internals, but not from looping for minutes or allocating gigabytes in
one expression, and a Python thread cannot be stopped. So the gateway renders
in ``python -m gateway.template_worker`` processes:

* at most :data:`WORKERS` renders run at once, each in its own process; the
  call waits in a thread (``trio.to_thread``, a limiter of :data:`WORKERS`),
  so the event loop keeps serving everything else;
* a render that takes longer than :data:`TIMEOUT_S` is refused and its
  process killed (a replacement is started on the next render);
* each process limits its address space to :data:`MEMORY_BYTES`; a render
  that needs more is refused and the process replaced;
* output longer than ``chat_template.MAX_RENDERED_CHARS`` is refused while it
  is produced.

Refusals raise :class:`gateway.chat_template.TemplateError` (400, the
request's messages cannot be rendered by this model). A process that dies or
answers garbage is replaced and the render refused the same way. Processes
are started on first use (:meth:`TemplateSandbox.warm` starts them early) and
killed by :meth:`TemplateSandbox.close`. ``python -m sim.bench_template``
measures what a render costs this way.
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any, Protocol

import trio

from common.logs import event
from gateway.chat_template import MAX_RENDERED_CHARS, TemplateError

log = logging.getLogger("swarm.gateway.template")
WORKERS = 2
TIMEOUT_S = 2.0
MEMORY_BYTES = 1 << 30
MAX_REPLY_BYTES = 4 * MAX_RENDERED_CHARS + 4096  # UTF-8 of the longest text, JSON-escaped


class Template(Protocol):
    """A template as text (``chat_template.TemplateSource``, or a compiled ``ChatTemplate``)."""

    @property
    def source(self) -> str: ...

    @property
    def bos_token(self) -> str: ...

    @property
    def eos_token(self) -> str: ...


class _WorkerDied(Exception):
    pass


class _Worker:
    """One rendering process; :meth:`call` blocks (run it in a thread)."""

    def __init__(self, memory_bytes: int) -> None:
        self.proc = subprocess.Popen(  # noqa: S603  (our own interpreter and module)
            [sys.executable, "-m", "gateway.template_worker", str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.renders = 0

    def call(self, request: bytes) -> dict[str, Any]:
        stdin: IO[bytes] | None = self.proc.stdin
        stdout: IO[bytes] | None = self.proc.stdout
        if stdin is None or stdout is None:
            raise _WorkerDied("no pipes")
        try:
            stdin.write(struct.pack(">I", len(request)) + request)
            stdin.flush()
            head = stdout.read(4)
            if len(head) < 4:
                raise _WorkerDied("the process ended")
            (size,) = struct.unpack(">I", head)
            if size > MAX_REPLY_BYTES:
                raise _WorkerDied(f"a reply of {size} bytes")
            body = stdout.read(size)
            if len(body) < size:
                raise _WorkerDied("the process ended mid-reply")
            reply = json.loads(body)
        except (OSError, ValueError) as err:
            raise _WorkerDied(repr(err)) from err
        if not isinstance(reply, dict):
            raise _WorkerDied("a reply that is not an object")
        self.renders += 1
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class TemplateSandbox:
    def __init__(
        self,
        *,
        workers: int = WORKERS,
        timeout_s: float = TIMEOUT_S,
        memory_bytes: int = MEMORY_BYTES,
        max_chars: int = MAX_RENDERED_CHARS,
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_chars = max_chars
        self._limiter = trio.CapacityLimiter(workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self.refused = {"timeout": 0, "memory": 0, "too_long": 0, "refused": 0, "died": 0}

    async def _take(self) -> _Worker:
        if self._idle:
            return self._idle.pop()
        worker = await trio.to_thread.run_sync(_Worker, self.memory_bytes)
        self._all.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()

    async def warm(self) -> None:
        """Start the worker processes now rather than on the first render."""
        while len(self._all) < self._limiter.total_tokens:
            worker = await trio.to_thread.run_sync(_Worker, self.memory_bytes)
            self._all.add(worker)
            self._idle.append(worker)

    async def render(
        self,
        template: Template,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        try:
            request = json.dumps(
                {
                    "source": template.source,
                    "bos": template.bos_token,
                    "eos": template.eos_token,
                    "messages": list(messages),
                    "add_generation_prompt": add_generation_prompt,
                    "extra": extra,
                    "max_chars": self.max_chars,
                },
                ensure_ascii=False,
            ).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as err:
            raise TemplateError(
                f"messages cannot be passed to the chat template: {err}", param="messages"
            ) from err
        async with self._limiter:
            worker = await self._take()
            try:
                with trio.fail_after(self.timeout_s):
                    reply = await trio.to_thread.run_sync(worker.call, request, abandon_on_cancel=True)
            except trio.TooSlowError:
                self._retire(worker)  # ends the abandoned thread's read too
                self._refuse("timeout", f"did not finish within {self.timeout_s:g} s")
            except _WorkerDied as err:
                self._retire(worker)
                self._refuse("died", f"its renderer failed ({err})")
            except BaseException:
                self._retire(worker)  # cancelled mid-render: the process may still be busy
                raise
            if reply.get("error") == "memory":
                self._retire(worker)  # the process exits after a memory error anyway
                self._refuse("memory", f"needs more than {self.memory_bytes >> 20} MiB")
            self._idle.append(worker)
        if "text" in reply and isinstance(reply["text"], str):
            return reply["text"]
        kind = str(reply.get("error", "refused"))
        message = str(reply.get("message", ""))[:500]
        self.refused["too_long" if kind == "too_long" else "refused"] += 1
        raise TemplateError(f"chat template refused the messages: {message}", param="messages")

    def _refuse(self, kind: str, why: str) -> None:
        self.refused[kind] += 1
        event(log, "chat_template_refused", level=logging.WARNING, reason=kind, detail=why)
        raise TemplateError(
            f"the model's chat template {why}; refused", param="messages", code="chat_template"
        )

    def close(self) -> None:
        """Kill every worker process (blocking briefly: they exit at once)."""
        for worker in list(self._all):
            worker.kill()
        self._all.clear()
        self._idle.clear()
