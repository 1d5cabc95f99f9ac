"""``swarm.v1.ShardService`` over gRPC: the node's hub behind the project's grpcio adapter.

Everything here is trio (``common.grpc_adapter`` hosts grpc.aio on the same
thread), so a frame goes from gRPC to the session machine and its reply back
without a thread hand-off. Frames stay bytes here: ``Session`` carries
serialized ``Frame`` messages (docs/protocol.md, Transport) that
:meth:`node.hub.Hub.feed` parses; replies come from the connection's bounded
outbound channel. ``Info``/``Health`` answer from fresh snapshots; ``GetVocab``
streams the metadata-only GGUF held in memory; ``GetManifest`` and
``GetTensorBytes`` serve the model's manifest and the bytes of this node's
span to joining nodes (``node.peer_serve``, bounded and rate-limited there).

Flow control: a stream reads its next message only after the hub accepted the
previous one (the adapter stops reading from gRPC while its buffer is full),
and writes as fast as the peer reads; a peer that leaves more than the hub's
``reply_buffer_bytes`` unread loses its stream (``node.hub``). A stream that
opens no session and pushes no step is closed after the hub's idle timeout,
and counts against its source address's bound on such streams (``peer`` from
gRPC); a stream refused at the connection limit is logged in one line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import trio

from common.grpc_adapter import CallInfo, Grpc, MessageStream, RpcAbort, Service, StreamClosed
from common.logs import event
from common.tls import ServerCert
from node.hub import Connection, Hub, TooManyConnections, held_back
from node.peer_serve import PeerRefused, TensorServer
from proto import codec
from proto.swarm.v1 import shard_service_pb2
from proto.vocab import vocab_chunks

log = logging.getLogger("swarm.node.grpc")


def peer_address(peer: str) -> str:
    """The source address of a gRPC peer string, without the port.

    >>> peer_address("ipv4:127.0.0.1:50412"), peer_address("ipv6:[::1]:50412"), peer_address("unix:/x")
    ('127.0.0.1', '::1', 'unix:/x')
    """
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition(":")[0] or rest
        return host.strip("[]")
    return peer


@dataclass(frozen=True)
class GrpcSettings:
    host: str
    port: int
    max_frame_bytes: int
    vocab_bytes: Callable[[], bytes]  # the metadata-only GGUF gateways tokenize with (written before serving)
    model_fingerprint: str
    shutdown_grace_s: float = 5.0
    # GetManifest / GetTensorBytes (node.peer_serve); None: this node does not serve its span's bytes.
    tensors: Callable[[], TensorServer | None] = lambda: None
    tls: ServerCert | None = None  # None: plaintext (insecure_plaintext)


class ShardService:
    """The node's gRPC service; :meth:`serve` is started with ``nursery.start`` and reports the port."""

    def __init__(
        self,
        hub: Hub,
        settings: GrpcSettings,
        info: Callable[[], shard_service_pb2.NodeInfo],
        health: Callable[[], shard_service_pb2.HealthResponse],
    ) -> None:
        self.hub = hub
        self.settings = settings
        self._info = info
        self._health = health
        self.streams_opened = 0
        self.streams_refused = 0

    def service(self) -> Service:
        return Service(
            codec.SERVICE,
            streams={"Session": self._session},
            unary={"Info": self._info_rpc, "Health": self._health_rpc, "GetManifest": self._manifest_rpc},
            server_streams={"GetVocab": self._vocab_rpc, "GetTensorBytes": self._tensor_bytes_rpc},
        )

    async def serve(
        self, grpc_rt: Grpc, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # Room over the frame limit so an oversized frame gets TOO_LARGE from the codec, not a reset.
        limit = self.settings.max_frame_bytes + 1024 * 1024
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            # Find dead gateways on long-lived streams (their sessions then wait for a re-attach),
            # and tolerate client keepalive pings every 10 s or slower.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ]

        serve = functools.partial(
            grpc_rt.serve,
            self.settings.host,
            self.settings.port,
            [self.service()],
            options=options,
            shutdown_grace_s=self.settings.shutdown_grace_s,
            tls=self.settings.tls,
        )
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve)
            tls = self.settings.tls is not None
            event(log, "grpc_listening", host=self.settings.host, port=port, tls=tls)
            task_status.started(port)

    # -- handlers ------------------------------------------------------------------------------------

    async def _session(self, stream: MessageStream, call: CallInfo) -> None:
        peer = peer_address(call.peer)
        try:
            conn = self.hub.open_connection(peer)
        except TooManyConnections as err:
            self.streams_refused += 1
            if (held := self.hub.log_budget.take()) is not None:  # one line, no traceback; bounded
                log.warning("stream refused peer=%s: %s%s", peer or "?", err, held_back(held))
            raise RpcAbort("RESOURCE_EXHAUSTED", str(err)) from err
        self.streams_opened += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_replies, conn, stream, nursery.cancel_scope)
                while True:
                    try:
                        data = await stream.receive()
                    except StreamClosed:
                        break
                    await self.hub.feed(conn, data)
                self.hub.input_ended(conn)  # replies still pending go out, then the stream ends
        finally:
            self.hub.close_connection(conn)

    @staticmethod
    async def _write_replies(conn: Connection, stream: MessageStream, scope: trio.CancelScope) -> None:
        assert conn.outbound is not None  # open_connection() without a sink gives a channel
        try:
            async for data in conn.outbound:
                await stream.send(data)
        except StreamClosed:
            pass
        scope.cancel()  # the hub ended the connection (finished, shutdown or a slow reader)

    async def _info_rpc(self, request: bytes, call: CallInfo) -> bytes:
        return self._info().SerializeToString()

    async def _health_rpc(self, request: bytes, call: CallInfo) -> bytes:
        return self._health().SerializeToString()

    async def _vocab_rpc(self, request_bytes: bytes, call: CallInfo) -> AsyncIterator[bytes]:
        request = shard_service_pb2.VocabRequest.FromString(request_bytes)
        if request.model_fingerprint and request.model_fingerprint != self.settings.model_fingerprint:
            raise RpcAbort(
                "NOT_FOUND",
                f"this node serves model {self.settings.model_fingerprint}, not {request.model_fingerprint}",
            )
        data = self.settings.vocab_bytes()
        for chunk in vocab_chunks(
            data, model_fingerprint=self.settings.model_fingerprint, chunk_bytes=request.max_chunk_bytes
        ):
            yield chunk.SerializeToString()

    def _tensor_server(self) -> TensorServer:
        server = self.settings.tensors()
        if server is None:
            raise RpcAbort("UNAVAILABLE", "this node does not serve its span's bytes (yet)")
        return server

    async def _manifest_rpc(self, request_bytes: bytes, call: CallInfo) -> bytes:
        request = shard_service_pb2.ManifestRequest.FromString(request_bytes)
        try:
            data = self._tensor_server().manifest(request.model_fingerprint)
        except PeerRefused as err:
            raise RpcAbort(err.code, str(err)) from err
        reply = shard_service_pb2.ManifestReply(
            model_fingerprint=request.model_fingerprint, manifest_json=data
        )
        return reply.SerializeToString()

    async def _tensor_bytes_rpc(self, request_bytes: bytes, call: CallInfo) -> AsyncIterator[bytes]:
        request = shard_service_pb2.TensorBytesRequest.FromString(request_bytes)
        try:
            chunks = await self._tensor_server().tensor_bytes(
                request.model_fingerprint, request.offset, request.length, request.max_chunk_bytes
            )
        except PeerRefused as err:
            raise RpcAbort(err.code, str(err)) from err
        offset = request.offset
        for data in chunks:
            yield shard_service_pb2.TensorBytesChunk(offset=offset, data=data).SerializeToString()
            offset += len(data)
