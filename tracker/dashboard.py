"""The swarm dashboard's live feed: one producer per tracker process, any number of browsers.

:class:`DashboardFeed` computes :meth:`tracker.service.Registry.dashboard_state`
every ``push_interval_s`` while at least one browser listens (never when none
does) and hands the same JSON to every open event stream (server-sent events,
``/v1/dashboard/events``). A slow browser only ever holds the newest state: each
client has one slot that the producer overwrites, so memory per client is one
message whatever the client's speed. At most ``max_clients`` streams are open;
more get 503.

The page itself (``tracker/static/``: HTML, CSS and a small vanilla script that
draws with SVG) is served by the tracker: no CDN, no third-party code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import trio

from common.logs import event
from tracker.errors import TrackerError

log = logging.getLogger("swarm.tracker.dashboard")

_MIME = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def _load_static() -> dict[str, tuple[bytes, str]]:
    out = {}
    for entry in resources.files("tracker").joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _MIME:
            out[entry.name] = (entry.read_bytes(), _MIME[suffix])
    return out


STATIC_FILES = _load_static()


class TooManyViewers(TrackerError):
    status_hint = 503
    code = "too_many_dashboard_clients"


class _Client:
    def __init__(self) -> None:
        self.latest: bytes | None = None
        self.changed = trio.Event()

    def offer(self, data: bytes) -> None:
        self.latest = data
        self.changed.set()


class DashboardFeed:
    def __init__(self, registry: Any, *, push_interval_s: float, max_clients: int) -> None:
        self.registry = registry
        self.push_interval_s = push_interval_s
        self.max_clients = max_clients
        self._clients: set[_Client] = set()
        self._wake = trio.Event()
        self._last: bytes | None = None

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._clients:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            try:
                state = await self.registry.dashboard_state()
                data = json.dumps(state, separators=(",", ":"), allow_nan=False).encode()
            except TrackerError as err:  # the database is away: say so, keep the last picture
                data = json.dumps({"error": {"code": err.code, "message": err.message}}).encode()
            except ValueError as err:  # a non-finite number slipped through: a bug, but keep serving
                event(log, "dashboard_state_failed", level=logging.ERROR, error=repr(err))
                data = json.dumps(
                    {"error": {"code": "internal", "message": "state not serialisable"}}
                ).encode()
            else:
                self._last = data
            for client in list(self._clients):
                client.offer(data)
            with trio.move_on_after(self.push_interval_s):
                await self._wake.wait()  # a new viewer gets a fresh state at once
            self._wake = trio.Event()

    def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: ``event: state`` with the JSON, until the browser goes away.

        Raises :class:`TooManyViewers` (503) before the response starts when the feed is full."""
        if len(self._clients) >= self.max_clients:
            raise TooManyViewers(f"{self.max_clients} dashboard streams are open already; retry later")
        return self._stream()

    async def _stream(self) -> AsyncIterator[bytes]:
        client = _Client()
        if self._last is not None:
            client.offer(self._last)
        self._clients.add(client)
        self._wake.set()
        try:
            yield b"retry: 2000\n\n"
            while True:
                await client.changed.wait()
                client.changed = trio.Event()
                data, client.latest = client.latest, None
                if data is not None:
                    yield b"event: state\ndata: " + data + b"\n\n"
        finally:
            self._clients.discard(client)
