"""The node's admin HTTP server: ``/healthz``, ``/metrics`` (Prometheus text), ``/status`` (JSON).

A tiny trio + h11 server (no framework: three read-only GET endpoints),
bound to loopback by default (``admin_host``; set it to ``0.0.0.0`` or a LAN
address to let a Prometheus server scrape ``/metrics``: nothing here changes
state). One request per connection, bodies refused, request heads bounded to
8 KiB, 10 s to send the head.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import h11
import trio

from common.logs import event
from common.metrics import CONTENT_TYPE

log = logging.getLogger("swarm.node.admin")
MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 10.0


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        health: Callable[[], tuple[int, dict[str, Any]]],
        metrics: Callable[[], str],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.host = host
        self.port = port
        self._routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/healthz": lambda: self._json(*health()),
            "/metrics": lambda: (200, CONTENT_TYPE, metrics().encode()),
            "/status": lambda: self._json(200, status()),
        }

    @staticmethod
    def _json(code: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
        return code, "application/json", json.dumps(body, default=str).encode()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        port = listeners[0].socket.getsockname()[1]
        event(log, "admin_listening", host=self.host, port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(port)

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            with trio.move_on_after(HEAD_TIMEOUT_S):
                request = await self._read_request(stream, conn)
            if request is None:
                return
            target = request.target.decode("ascii", "replace").split("?", 1)[0]
            route = self._routes.get(target)
            if request.method != b"GET":
                code, ctype, body = 405, "text/plain", b"method not allowed\n"
            elif route is None:
                code, ctype, body = 404, "text/plain", b"not found\n"
            else:
                try:
                    code, ctype, body = route()
                except Exception:  # a broken probe must not kill the admin server
                    log.exception("admin_handler_failed")
                    code, ctype, body = 500, "text/plain", b"internal error\n"
            headers = [("content-type", ctype), ("content-length", str(len(body))), ("connection", "close")]
            data = conn.send(h11.Response(status_code=code, headers=headers))
            data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            pass
        finally:
            await stream.aclose()

    @staticmethod
    async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = await stream.receive_some(4096)
                if not data:
                    return None
                conn.receive_data(data)
                continue
            if isinstance(ev, h11.Request):
                return ev
            return None
