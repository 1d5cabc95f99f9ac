"""The node side of the WebSocket relay: a node that cannot accept connections dials out to a gateway.

``swarm-node start --relay http://gateway:8000`` keeps one WebSocket open to
the gateway's ``/v1/relay`` and serves the very same protobuf frames over it
as over gRPC: every binary message is one serialized ``Frame``, many sessions
share the socket (told apart by ``session_id``), and the frames go into the
node's transport-independent :class:`node.hub.Hub` like a gRPC stream's.

Handshake (text messages, JSON; docs/nat-and-recovery.md)::

    gateway -> node   {"type": "challenge", "gateway_id": <hex>, "challenge": <64 hex>}
    node -> gateway   signed envelope (proto.signing) of {"kind": "relay_hello", "node_id",
                      "gateway_id", "challenge", "info": <base64 NodeInfo>, "timestamp", "nonce"}
    gateway -> node   {"type": "ready"}   or   {"type": "refused", "reason": ...} and close

Transport: ``wss://`` when the gateway serves HTTPS (``relay_url`` https:// or
wss://): the gateway is pinned by its certificate's sha256
(``relay_tls_fingerprint``, checked on every connection) or verified against a
CA bundle or the system CAs. A plain ``ws://`` relay carries the frames
readable and is logged as such.

After ``ready`` the node announces itself to the tracker as relayed through
that gateway (``relay: true``, ``relay_via: <gateway id>``). A dropped socket
ends the hub connection (its sessions wait ``reattach_window_s``; the gateway
recovers them elsewhere) and the client dials again with exponential backoff
(0.5 s doubling to 10 s, reset after a connection that lasted). A ping every
20 s (10 s to answer) notices a gateway that vanished without closing.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import nacl.signing
import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from common.logs import event
from common.tls import TlsError
from common.tls_dial import pinned_client_context
from node.hub import Hub, TooManyConnections
from proto.signing import make_payload, sign_envelope
from proto.swarm.v1 import shard_service_pb2

log = logging.getLogger("swarm.node.relay")
RELAY_PATH = "/v1/relay"
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0
PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 10.0


class RelayRefused(Exception):
    """The gateway refused the handshake (it says why)."""


_CONNECTION_FAILURES = (
    OSError,
    HandshakeError,
    ConnectionClosed,
    RelayRefused,
    trio.TooSlowError,
    ValueError,
)


def _connection_failure(err: BaseException) -> bool:
    """The socket could not be opened or ended (also when wrapped in trio's exception groups)."""
    if isinstance(err, BaseExceptionGroup):
        return all(_connection_failure(e) for e in err.exceptions)
    return isinstance(err, _CONNECTION_FAILURES)


def relay_ws_url(url: str) -> str:
    """``http://host:port`` (a gateway's base URL) or ``ws://host:port/v1/relay`` -> the WebSocket URL."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"relay URL must be http(s):// or ws(s)://host:port, got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(RELAY_PATH):
        path = path.removesuffix("/v1") + RELAY_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def hello_envelope(
    key: nacl.signing.SigningKey, gateway_id: str, challenge: str, info: bytes, now_s: float
) -> dict[str, str]:
    payload = make_payload(
        "relay_hello",
        "node_id",
        key,
        now_s,
        {"gateway_id": gateway_id, "challenge": challenge, "info": base64.b64encode(info).decode("ascii")},
    )
    return sign_envelope(key, payload)


@dataclass(frozen=True)
class RelayStatistics:
    connected: bool
    gateway_id: str | None
    connects: int
    disconnects: int
    frames_in: int
    frames_out: int


class RelayClient:
    def __init__(
        self,
        url: str,
        hub: Hub,
        key: nacl.signing.SigningKey,
        info: Callable[[], shard_service_pb2.NodeInfo],
        *,
        max_frame_bytes: int,
        tls_fingerprint: str = "",
        ca_file: str = "",
    ) -> None:
        self.url = relay_ws_url(url)
        self.tls_fingerprint = tls_fingerprint
        self.ca_file = ca_file
        self._ssl: ssl.SSLContext | None = None
        self.hub = hub
        self.key = key
        self.info = info
        self.max_frame_bytes = max_frame_bytes
        self.gateway_id: str | None = None
        self.ready = trio.Event()  # set after the first accepted handshake
        self.connected = False
        self.connects = 0
        self.disconnects = 0
        self.frames_in = 0
        self.frames_out = 0

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            self.connected, self.gateway_id, self.connects, self.disconnects, self.frames_in, self.frames_out
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a relay connection up until cancelled."""
        if not self.url.startswith("wss://"):
            event(
                log,
                "relay_plaintext",
                level=logging.WARNING,
                url=self.url,
                message="ws:// relay: frames travel readable; give the gateway a certificate (wss://)",
            )
        task_status.started()
        backoff = BACKOFF_MIN_S
        while True:
            began = time.monotonic()
            try:
                await self._connect_once()
            except Exception as err:
                if not _connection_failure(err):
                    raise
                event(log, "relay_disconnected", level=logging.WARNING, url=self.url, error=repr(err))
            finally:
                if self.connected:
                    self.disconnects += 1
                self.connected = False
            if time.monotonic() - began > 30:
                backoff = BACKOFF_MIN_S
            await trio.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _ssl_context(self) -> ssl.SSLContext | None:
        """None for ws://; for wss:// the pinned certificate, a CA bundle or the system CAs."""
        if not self.url.startswith("wss://"):
            return None
        if self._ssl is None:
            if self.tls_fingerprint:
                try:
                    self._ssl = await pinned_client_context(urlsplit(self.url).netloc, self.tls_fingerprint)
                except TlsError as err:
                    raise RelayRefused(str(err)) from err
            else:
                self._ssl = ssl.create_default_context(cafile=self.ca_file or None)
        return self._ssl

    async def _connect_once(self) -> None:
        room = self.max_frame_bytes + 64 * 1024
        context = await self._ssl_context()
        async with open_websocket_url(
            self.url, ssl_context=context, max_message_size=room, message_queue_size=8
        ) as ws:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                challenge = json.loads(await ws.get_message())
                if not isinstance(challenge, dict) or challenge.get("type") != "challenge":
                    raise RelayRefused(f"unexpected first message from the gateway: {challenge!r}")
                gateway_id = str(challenge["gateway_id"])
                info = self.info().SerializeToString()
                envelope = hello_envelope(
                    self.key, gateway_id, str(challenge["challenge"]), info, time.time()
                )
                await ws.send_message(json.dumps(envelope))
                answer = json.loads(await ws.get_message())
                if not isinstance(answer, dict) or answer.get("type") != "ready":
                    raise RelayRefused(f"gateway refused the relay: {answer!r}")
            self.gateway_id = gateway_id
            self.connected = True
            self.connects += 1
            event(log, "relay_connected", url=self.url, gateway_id=gateway_id)
            self.ready.set()
            try:
                conn = self.hub.open_connection(trusted=True)  # we dialled the gateway ourselves
            except TooManyConnections as err:
                raise RelayRefused(str(err)) from err
            try:
                async with trio.open_nursery() as nursery:

                    async def outbound() -> None:
                        assert conn.outbound is not None  # opened without a sink
                        async for data in conn.outbound:
                            await ws.send_message(data)
                            self.frames_out += 1
                        # The hub closed the connection (slow reader): end the socket too.
                        await ws.aclose()

                    async def keepalive() -> None:
                        # A gateway that vanished without closing the TCP connection is noticed here.
                        while True:
                            await trio.sleep(PING_INTERVAL_S)
                            with trio.fail_after(PING_TIMEOUT_S):
                                await ws.ping()

                    nursery.start_soon(outbound)
                    nursery.start_soon(keepalive)
                    while True:
                        message = await ws.get_message()
                        if isinstance(message, str):
                            continue  # control text (none defined after ready): ignored
                        self.frames_in += 1
                        await self.hub.feed(conn, message)
            finally:
                self.hub.close_connection(conn)
