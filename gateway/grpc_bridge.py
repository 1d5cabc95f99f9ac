"""The gateway's gRPC client side: node calls and Session streams through the grpcio adapter.

All of it is trio (``common.grpc_adapter`` runs grpc.aio on this thread): a
Session stream is a :class:`StageStream` (``send``/``receive`` bytes, bounded
buffers), ``Info`` is a unary call and ``GetVocab`` a server stream read whole
and checked by ``proto.vocab.VocabAssembler``; ``GetManifest`` and
``GetTensorBytes`` (the model file's header) are what the vocabulary is checked
against (``gateway/vocab_store.py``). Deadlines are the caller's trio
deadlines. Raw bytes both ways: the Session method carries serialized frames
(docs/protocol.md, Transport), parsed by ``proto.codec``.

TLS (docs/tls.md): ``Info`` and Session streams go over TLS pinned to the
certificate fingerprint the node announced (the route hop's
``tls_fingerprint``); a node that announced none is dialled in plaintext only
with ``allow_plaintext_nodes``, else refused. The vocabulary and its proofs are
public bytes checked against the model's fingerprint: they are fetched over
TLS without a pin from whatever address the tracker named.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from common.grpc_adapter import UNPINNED, Grpc, MessageStream, RpcError, StreamClosed
from common.logs import event
from proto import codec
from proto.swarm.v1 import shard_service_pb2
from proto.vocab import DEFAULT_VOCAB_CHUNK_BYTES, MAX_VOCAB_CHUNK_BYTES, VocabAssembler

log = logging.getLogger("swarm.gateway.grpc")
# Frames queued towards one node: enough for a chunked prefill step in flight, bounded in bytes too.
SEND_BUFFER_FRAMES = 64
# What proves a vocabulary (gateway/vocab_check.py): a manifest, the model file's header.
MANIFEST_METHOD = "/swarm.v1.ShardService/GetManifest"
TENSOR_BYTES_METHOD = "/swarm.v1.ShardService/GetTensorBytes"
MAX_PROOF_BYTES = 64 * 1024 * 1024
PROOF_CHUNK_BYTES = 1024 * 1024


class StreamError(Exception):
    """The stream to a node failed or ended (connection refused, node gone, call cancelled).

    ``transient``: worth asking again later (gRPC ``UNAVAILABLE``: a node not listening yet or
    restarting)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class PlaintextRefused(StreamError):
    """The node announced no TLS certificate and this gateway dials only over TLS."""


class CertificateRefused(StreamError):
    """The address answered with another certificate than the node announced: not the node, but
    not a silent address either (it answered at once)."""


class StageStream:
    """One bidirectional Session stream to one node: ``send`` bytes, ``receive`` bytes."""

    def __init__(self, stream: MessageStream) -> None:
        self._stream = stream

    async def send(self, data: bytes) -> None:
        try:
            await self._stream.send(data)
        except StreamClosed as err:
            raise StreamError(str(err)) from err

    async def receive(self) -> bytes:
        try:
            return await self._stream.receive()
        except StreamClosed as err:
            raise StreamError(str(err)) from err

    def close_sending(self) -> None:
        """Half-close: queued frames go out first; the node ends the stream once it answered them."""
        self._stream.close_sending()


class NodeChannels:
    """gRPC calls to nodes; one channel per node address, shared by every stream to it."""

    def __init__(self, grpc_rt: Grpc, *, max_frame_bytes: int, allow_plaintext: bool = False) -> None:
        self._grpc = grpc_rt
        self._max_frame_bytes = max_frame_bytes
        self._allow_plaintext = allow_plaintext
        # Our largest frame or vocabulary chunk plus gRPC framing; frames are size-checked again by
        # proto.codec.parse_frame against max_frame_bytes.
        self._max_message_bytes = max(max_frame_bytes, MAX_VOCAB_CHUNK_BYTES) + 64 * 1024

    def pin(self, address: str, tls_fingerprint: str) -> str | None:
        """What to dial ``address`` with: its announced certificate, or plaintext where allowed."""
        if tls_fingerprint:
            return tls_fingerprint
        if self._allow_plaintext:
            return None
        raise PlaintextRefused(
            f"the node at {address} announced no TLS certificate; this gateway dials nodes only over TLS "
            "(allow_plaintext_nodes)"
        )

    async def health(self, address: str, tls_fingerprint: str = "") -> bytes:
        """One ``Health`` call (a ping: a few bytes each way); the caller's deadline bounds it.

        A ping carries nothing secret: without a fingerprint it goes over TLS unpinned (plaintext to a
        node that has no TLS)."""
        pin = tls_fingerprint or UNPINNED
        try:
            return await self._grpc.unary(
                address, codec.HEALTH_METHOD, b"", max_message_bytes=64 * 1024, pin=pin
            )
        except RpcError as err:
            raise StreamError(f"Health from {address} failed: {err}") from err

    async def info(self, address: str, tls_fingerprint: str = "") -> shard_service_pb2.NodeInfo:
        pin = self.pin(address, tls_fingerprint)
        try:
            data = await self._grpc.unary(
                address, codec.INFO_METHOD, b"", max_message_bytes=self._max_message_bytes, pin=pin
            )
        except RpcError as err:
            if err.code == "UNAUTHENTICATED":  # not the certificate the node announced: one line, no trace
                event(log, "node_tls_refused", level=logging.WARNING, address=address, error=str(err))
                raise CertificateRefused(f"Info from {address} failed: {err}") from err
            raise StreamError(f"Info from {address} failed: {err}") from err
        info = shard_service_pb2.NodeInfo.FromString(data)
        if tls_fingerprint and info.tls_fingerprint != tls_fingerprint:
            raise CertificateRefused(
                f"the node at {address} says it serves another TLS certificate than announced"
            )
        return info

    async def get_vocab(self, address: str, model_fingerprint: str, max_bytes: int) -> bytes:
        """The metadata-only GGUF of the model, checked by ``proto.vocab.VocabAssembler``."""
        assembler = VocabAssembler(model_fingerprint, max_total_bytes=max_bytes)
        request = shard_service_pb2.VocabRequest(
            model_fingerprint=model_fingerprint, max_chunk_bytes=DEFAULT_VOCAB_CHUNK_BYTES
        )
        most = max_bytes // DEFAULT_VOCAB_CHUNK_BYTES + 2
        try:
            chunks = await self._grpc.server_stream(
                address,
                codec.VOCAB_METHOD,
                request.SerializeToString(),
                max_messages=most,
                max_message_bytes=self._max_message_bytes,
                pin=UNPINNED,
            )
        except RpcError as err:
            transient = err.code == "UNAVAILABLE"
            raise StreamError(f"GetVocab from {address} failed: {err}", transient=transient) from err
        for raw in chunks:
            data = assembler.add(shard_service_pb2.VocabChunk.FromString(raw))
            if data is not None:
                return data
        raise StreamError(f"GetVocab from {address} ended early: missing {assembler.missing()}")

    async def manifest(self, address: str, model_fingerprint: str) -> bytes:
        """The model's manifest as the node holds it (``GetManifest``; not checked here)."""
        request = shard_service_pb2.ManifestRequest(model_fingerprint=model_fingerprint)
        try:
            data = await self._grpc.unary(
                address,
                MANIFEST_METHOD,
                request.SerializeToString(),
                max_message_bytes=MAX_PROOF_BYTES,
                pin=UNPINNED,
            )
        except RpcError as err:
            raise StreamError(f"GetManifest from {address} failed: {err}") from err
        return bytes(shard_service_pb2.ManifestReply.FromString(data).manifest_json)

    async def file_bytes(self, address: str, model_fingerprint: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the model file (``GetTensorBytes``: the header, or
        inside one tensor the node holds), in order, at most :data:`MAX_PROOF_BYTES`."""
        if length > MAX_PROOF_BYTES:
            raise StreamError(f"{length} bytes asked of {address} (at most {MAX_PROOF_BYTES})")
        request = shard_service_pb2.TensorBytesRequest(
            model_fingerprint=model_fingerprint,
            offset=offset,
            length=length,
            max_chunk_bytes=PROOF_CHUNK_BYTES,
        )
        try:
            chunks = await self._grpc.server_stream(
                address,
                TENSOR_BYTES_METHOD,
                request.SerializeToString(),
                max_messages=length // PROOF_CHUNK_BYTES + 2,
                max_message_bytes=PROOF_CHUNK_BYTES + 64 * 1024,
                pin=UNPINNED,
            )
        except RpcError as err:
            raise StreamError(f"GetTensorBytes from {address} failed: {err}") from err
        out = bytearray()
        for raw in chunks:
            chunk = shard_service_pb2.TensorBytesChunk.FromString(raw)
            if chunk.offset != offset + len(out) or len(out) + len(chunk.data) > length:
                raise StreamError(f"GetTensorBytes from {address} sent bytes out of order or out of range")
            out += chunk.data
        if len(out) != length:
            raise StreamError(f"GetTensorBytes from {address} sent {len(out)} of {length} bytes")
        return bytes(out)

    @asynccontextmanager
    async def open_stage_stream(self, address: str, tls_fingerprint: str = "") -> AsyncIterator[StageStream]:
        pin = self.pin(address, tls_fingerprint)
        async with self._grpc.open_stream(
            address,
            codec.SESSION_METHOD,
            max_message_bytes=self._max_message_bytes,
            max_buffered_bytes=4 * self._max_frame_bytes,
            max_buffered_messages=SEND_BUFFER_FRAMES,
            pin=pin,
        ) as stream:
            yield StageStream(stream)

    async def aclose(self) -> None:
        """Channels belong to the process's grpc runtime, which closes them."""
