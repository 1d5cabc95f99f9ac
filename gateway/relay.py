"""The gateway side of the WebSocket relay: nodes behind NAT dial in, Route Sessions reach them here.

A node started with ``--relay http://<gateway>`` opens a WebSocket to
``/v1/relay`` (the handshake is in ``node/relay_client.py`` and
docs/nat-and-recovery.md: the node signs the gateway's random challenge with
its ed25519 key, so a socket is bound to a node id nobody else can claim).
From then on every binary message either way is one serialized ``Frame``,
exactly the bytes of a gRPC Session stream; one socket carries every session
the node has with this gateway, told apart by ``session_id``.

The tracker lists such a node with the address ``relay:<gateway id>``. When a
route hop is relayed through this gateway, :class:`RelayChannels` hands the
Route Session a :class:`RelayStageStream` instead of a gRPC stream: the same
``send``/``receive`` of frame bytes, with the same :class:`StreamError` when
the node is gone. A hop relayed through *another* gateway cannot be reached
from here (StreamError: the route is changed like for any dead node).

Bounds: one socket per node id (a new one replaces the old), frames queued to
a node (:data:`OUTBOUND_FRAMES`), replies buffered per session
(:data:`SESSION_BUFFER_FRAMES`; the socket reader waits when a session does
not read), message size ``max_frame_bytes`` plus framing.

If a socket drops, every session using it gets ``StreamError`` on its next
``receive`` -- the step fails cleanly and span recovery takes over.

Join challenges: the tracker cannot dial a relayed node, so this gateway carries
its challenge (:func:`carry_challenges_loop`): it names its connected nodes to
the tracker (``POST /v1/relay/challenges``), sends the frames the tracker wrote
for those waiting for their challenge, and brings every frame they answer back
(``POST /v1/relay/challenge-results``). The tracker judges; this gateway only
carries bytes (tracker/relay_challenges.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from quart import websocket
from quart_trio import QuartTrio

from common.grpc_adapter import Grpc
from common.logs import event
from common.tracker_client import TrackerClient, TrackerClientError
from gateway.grpc_bridge import NodeChannels, StreamError
from gateway.routes import Hop
from proto.signing import NonceCache, SignatureError, open_envelope
from proto.swarm.v1 import frame_pb2, shard_service_pb2

log = logging.getLogger("swarm.gateway.relay")
RELAY_PATH = "/v1/relay"
ADDRESS_PREFIX = "relay:"
OUTBOUND_FRAMES = 64
SESSION_BUFFER_FRAMES = 16
HANDSHAKE_TIMEOUT_S = 10.0
SIGNATURE_SKEW_S = 60.0
MAX_HELLO_BYTES = 256 * 1024


class RelayStageStream:
    """One session's frames with one relayed node, over that node's WebSocket."""

    def __init__(self, link: RelayLink, node_id: str) -> None:
        self._link = link
        self._node_id = node_id
        self._session_id: str | None = None
        self._send_replies, self._replies = trio.open_memory_channel[bytes | StreamError](
            SESSION_BUFFER_FRAMES
        )

    async def send(self, data: bytes) -> None:
        if self._session_id is None:
            # The first frame of a stream is the session's OPEN: learn the id replies will carry.
            self._session_id = frame_pb2.Frame.FromString(data).session_id
            self._link.sessions[self._session_id] = self._send_replies
        if self._link.closed:
            raise StreamError(f"relayed node {self._node_id[:8]} is disconnected")
        try:
            await self._link.outbound_send.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
            raise StreamError(f"relayed node {self._node_id[:8]} is disconnected") from err

    async def receive(self) -> bytes:
        try:
            item = await self._replies.receive()
        except trio.EndOfChannel as err:
            raise StreamError(f"the relay socket of node {self._node_id[:8]} closed") from err
        if isinstance(item, StreamError):
            raise item
        return item

    def close_sending(self) -> None:
        """Nothing to flush: sent frames are already queued on the node's socket."""

    def close(self) -> None:
        if self._session_id is not None and self._link.sessions.get(self._session_id) is self._send_replies:
            del self._link.sessions[self._session_id]
        self._send_replies.close()
        self._replies.close()


@dataclass(eq=False)
class RelayLink:
    """One connected node: its Info, its outbound queue, the reply channel of each of its sessions."""

    node_id: str
    info: shard_service_pb2.NodeInfo
    outbound_send: trio.MemorySendChannel[bytes]
    sessions: dict[str, trio.MemorySendChannel[bytes | StreamError]] = field(default_factory=dict)
    closed: bool = False
    frames_in: int = 0
    frames_out: int = 0
    connected_at: float = 0.0  # trio.current_time() at the handshake

    def fail_all(self, reason: str) -> None:
        self.closed = True
        self.outbound_send.close()
        for channel in list(self.sessions.values()):
            try:
                channel.send_nowait(StreamError(reason))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                channel.close()  # a full buffer: closing still ends the reader with StreamError
        self.sessions.clear()


@dataclass(frozen=True)
class RelayStatistics:
    nodes: int
    sessions: int
    handshakes_ok: int
    handshakes_refused: int
    disconnects: int


class RelayHub:
    """The relayed nodes connected to this gateway, by node id."""

    def __init__(self, gateway_id: str, *, max_frame_bytes: int) -> None:
        self.gateway_id = gateway_id
        self.address = ADDRESS_PREFIX + gateway_id  # what the tracker lists for nodes relayed through us
        self.max_frame_bytes = max_frame_bytes
        self._links: dict[str, RelayLink] = {}
        self._nonces = NonceCache(100_000)
        self.handshakes_ok = 0
        self.handshakes_refused = 0
        self.disconnects = 0

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            len(self._links),
            sum(len(link.sessions) for link in self._links.values()),
            self.handshakes_ok,
            self.handshakes_refused,
            self.disconnects,
        )

    def link(self, hop: Hop) -> RelayLink:
        if hop.address != self.address:
            raise StreamError(
                f"node {hop.node_id[:8]} is relayed through another gateway ({hop.address[:24]}...)"
            )
        link = self._links.get(hop.node_id)
        if link is None or link.closed:
            raise StreamError(f"relayed node {hop.node_id[:8]} is not connected to this gateway")
        return link

    def connected(self, node_id: str) -> RelayLink | None:
        link = self._links.get(node_id)
        return None if link is None or link.closed else link

    def links(self) -> list[RelayLink]:
        """The connected nodes, newest first."""
        return sorted(
            (link for link in self._links.values() if not link.closed), key=lambda link: -link.connected_at
        )

    def check_hello(self, envelope: object, challenge: str) -> tuple[str, shard_service_pb2.NodeInfo]:
        """Verify the node's signed answer to ``challenge``; return its node id and Info."""
        payload = open_envelope(
            envelope,
            kind="relay_hello",
            now_s=time.time(),
            skew_s=SIGNATURE_SKEW_S,
            nonces=self._nonces,
            signer_field="node_id",
            max_payload_bytes=MAX_HELLO_BYTES,
        )
        if payload.get("gateway_id") != self.gateway_id:
            raise SignatureError("wrong_gateway", "the hello is addressed to another gateway")
        if not secrets.compare_digest(str(payload.get("challenge", "")), challenge):
            raise SignatureError("wrong_challenge", "the hello does not answer this connection's challenge")
        try:
            info = shard_service_pb2.NodeInfo.FromString(base64.b64decode(str(payload.get("info", ""))))
        except (binascii.Error, ValueError) as err:
            raise SignatureError("malformed_envelope", "info is not a base64 NodeInfo") from err
        node_id = str(payload["node_id"])
        if info.node_id != node_id:
            raise SignatureError("key_mismatch", "the NodeInfo names another node")
        return node_id, info

    async def serve_socket(self) -> None:
        """The ``/v1/relay`` WebSocket handler: handshake, then frames both ways until either side ends."""
        ws = websocket._get_current_object()  # type: ignore[attr-defined]
        await ws.accept()
        challenge = secrets.token_hex(32)
        await ws.send(
            json.dumps({"type": "challenge", "gateway_id": self.gateway_id, "challenge": challenge})
        )
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                hello = await ws.receive()
            if not isinstance(hello, str) or len(hello) > MAX_HELLO_BYTES:
                raise SignatureError("malformed_envelope", "the hello must be one JSON text message")
            try:
                envelope = json.loads(hello)
            except ValueError as err:
                raise SignatureError("malformed_envelope", "the hello is not JSON") from err
            node_id, info = self.check_hello(envelope, challenge)
        except (SignatureError, trio.TooSlowError) as err:
            self.handshakes_refused += 1
            reason = err.reason if isinstance(err, SignatureError) else "timeout"
            event(log, "relay_refused", level=logging.WARNING, reason=reason, error=str(err))
            await ws.send(json.dumps({"type": "refused", "reason": reason}))
            return
        send, receive = trio.open_memory_channel[bytes](OUTBOUND_FRAMES)
        link = RelayLink(node_id, info, send, connected_at=trio.current_time())
        old = self._links.get(node_id)
        if old is not None:
            old.fail_all("the node reconnected its relay socket")
        self._links[node_id] = link
        self.handshakes_ok += 1
        await ws.send(json.dumps({"type": "ready", "gateway_id": self.gateway_id}))
        event(log, "relay_node_connected", node_id=node_id, shard=[info.shard.start, info.shard.end])
        try:
            async with trio.open_nursery() as nursery:

                async def outbound() -> None:
                    async for data in receive:
                        await ws.send(data)
                        link.frames_out += 1
                    nursery.cancel_scope.cancel()  # the link was replaced or failed

                nursery.start_soon(outbound)
                while True:
                    data = await ws.receive()
                    if isinstance(data, str):
                        continue
                    link.frames_in += 1
                    try:
                        session_id = frame_pb2.Frame.FromString(data).session_id
                    except Exception:  # unreadable bytes: nobody to give them to
                        continue
                    channel = link.sessions.get(session_id)
                    if channel is None:
                        continue  # a session that is over (late reply, unsolicited notice)
                    try:
                        await channel.send(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        link.sessions.pop(session_id, None)
        finally:
            self.disconnects += 1
            if self._links.get(node_id) is link:
                del self._links[node_id]
            link.fail_all(f"the relay socket of node {node_id[:8]} closed")
            event(log, "relay_node_disconnected", node_id=node_id)


class RelayChannels(NodeChannels):
    """gRPC channels plus the relay: relayed hops get their node's WebSocket instead of a gRPC stream."""

    def __init__(
        self,
        grpc_rt: Grpc,
        *,
        max_frame_bytes: int,
        relay: RelayHub | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        super().__init__(grpc_rt, max_frame_bytes=max_frame_bytes, allow_plaintext=allow_plaintext)
        self.relay = relay

    def relay_info(self, hop: Hop) -> shard_service_pb2.NodeInfo:
        if self.relay is None:
            raise StreamError("this gateway has no relay")
        return self.relay.link(hop).info

    @asynccontextmanager
    async def open_relay_stream(self, hop: Hop) -> AsyncIterator[RelayStageStream]:
        if self.relay is None:
            raise StreamError("this gateway has no relay")
        stream = RelayStageStream(self.relay.link(hop), hop.node_id)
        try:
            yield stream
        finally:
            stream.close()

    async def info(self, address: str, tls_fingerprint: str = "") -> shard_service_pb2.NodeInfo:
        if address.startswith(ADDRESS_PREFIX):
            raise StreamError("a relayed node has no gRPC address")
        return await super().info(address, tls_fingerprint)

    async def get_vocab(self, address: str, model_fingerprint: str, max_bytes: int) -> bytes:
        if address.startswith(ADDRESS_PREFIX):
            raise StreamError("vocabularies are not fetched over the relay")
        return await super().get_vocab(address, model_fingerprint, max_bytes)


# -- join challenges carried for the tracker -------------------------------------------------------

CHALLENGE_POLL_NEW_S = 1.0  # how often the tracker is asked while a node connected recently
CHALLENGE_POLL_S = 10.0  # ... and otherwise, while any node is connected
CHALLENGE_NEW_LINK_S = 60.0  # "recently"
CHALLENGE_POLL_NODES = 16  # nodes named per poll (tracker/relay_challenges.py: MAX_POLL_NODES)


async def carry_challenge(hub: RelayHub, order: dict[str, Any]) -> dict[str, Any]:
    """Carry one of the tracker's challenge sessions to a relayed node: send the tracker's frames as
    they are, bring back every frame the node answers (the tracker judges them, not this gateway)."""
    node_id = str(order["node_id"])
    link = hub.connected(node_id)
    out: dict[str, Any] = {
        "gateway_id": hub.gateway_id,
        "node_id": node_id,
        "info": base64.b64encode(link.info.SerializeToString()).decode("ascii") if link else "",
        "input_id": str(order.get("input_id", "")),
        "replies": [],
        "error": "",
    }
    if link is None or link.closed:
        out["error"] = "the node is not connected to this gateway's relay"
        return out
    frames = [base64.b64decode(f) for f in order["frames"]]
    max_replies = int(order.get("max_replies", 1))
    replies: list[bytes] = []
    stream = RelayStageStream(link, node_id)
    try:
        with trio.fail_after(float(order.get("timeout_s", 30.0))):
            await stream.send(frames[0])
            replies.append(await stream.receive())
            if frame_pb2.Frame.FromString(replies[0]).WhichOneof("body") == "open_ack":
                for frame in frames[1:]:
                    await stream.send(frame)
                while len(replies) <= max_replies:
                    data = await stream.receive()
                    replies.append(data)
                    reply = frame_pb2.Frame.FromString(data)
                    if not reply.HasField("chunk") or reply.chunk.index >= reply.chunk.count - 1:
                        break
                with trio.move_on_after(2.0):
                    await stream.send(base64.b64decode(order["release"]))
    except (StreamError, trio.TooSlowError) as err:
        out["error"] = str(err) or "no answer in time"
    except Exception as err:  # unreadable bytes from the node: the tracker judges what came
        out["error"] = f"unreadable answer: {err!r}"[:200]
    finally:
        stream.close()
    out["replies"] = [base64.b64encode(r).decode("ascii") for r in replies]
    return out


async def carry_challenges_once(
    hub: RelayHub, tracker: TrackerClient, links: list[RelayLink], *, timeout_s: float
) -> int:
    """One round: name ``links`` to the tracker, carry the challenges it orders; the number carried."""
    payload = {
        "gateway_id": hub.gateway_id,
        "nodes": [
            {"node_id": link.node_id, "info": base64.b64encode(link.info.SerializeToString()).decode("ascii")}
            for link in links[:CHALLENGE_POLL_NODES]
        ],
    }
    with trio.fail_after(timeout_s):
        answer = await tracker.relay_challenges(payload)
    carried = 0
    for order in answer.get("orders") or []:
        result = await carry_challenge(hub, order)
        with trio.fail_after(timeout_s):
            verdict = await tracker.relay_challenge_result(result)
        carried += 1
        event(
            log,
            "relay_challenge_carried",
            node_id=result["node_id"],
            outcome=verdict.get("outcome"),
            routable=verdict.get("routable"),
            error=result["error"],
        )
    return carried


async def carry_challenges_loop(hub: RelayHub, tracker: TrackerClient, *, timeout_s: float) -> None:
    """Ask the tracker which nodes relayed here wait for their join challenge, and carry it to them:
    every second while a node connected in the last minute (it announces after its handshake), every
    ten seconds otherwise (a node that expired and came back is challenged again)."""
    last_full = -math.inf
    while True:
        now = trio.current_time()
        links = hub.links()
        recent = [link for link in links if now - link.connected_at < CHALLENGE_NEW_LINK_S]
        if links and now - last_full >= CHALLENGE_POLL_S:
            ask, last_full = links, now
        else:
            ask = recent
        if ask:
            try:
                await carry_challenges_once(hub, tracker, ask, timeout_s=timeout_s)
            except TrackerClientError as err:
                if err.status != 404:  # 404: the tracker challenges nobody (challenge_nodes off)
                    event(log, "relay_challenge_poll_failed", level=logging.WARNING, error=str(err)[:300])
                await trio.sleep(CHALLENGE_POLL_S)
            except (httpx.HTTPError, trio.TooSlowError, OSError) as err:
                event(log, "relay_challenge_poll_failed", level=logging.WARNING, error=str(err)[:300])
                await trio.sleep(CHALLENGE_POLL_S)
        await trio.sleep(CHALLENGE_POLL_NEW_S)


def install_relay(app: QuartTrio, hub: RelayHub) -> None:
    """Add the ``/v1/relay`` WebSocket route to the gateway's app."""

    @app.websocket(RELAY_PATH)
    async def relay_socket() -> None:
        await hub.serve_socket()
