"""The one adapter between trio and grpcio: gRPC calls and servers as trio sees them.

grpcio's asyncio API (``grpc.aio``) is the only one that does not need a thread
per call, but it needs an asyncio event loop. Here that loop is trio-asyncio's,
running inside the service's own ``trio.run``: one thread, one scheduler
(trio's). Every grpc.aio object lives on that loop and is touched only by the
coroutines in this module; everything else in the project sees bytes through
:class:`MessageStream` and plain trio functions. docs/concurrency.md has the
measurements behind the choice (``python -m sim.bench_bridge``): on the 2-core
test VM a frame's round trip costs about 0.1 ms over plain asyncio this way,
against 0.16 ms for an asyncio loop in a second thread and 0.2 ms for trio as a
guest of the asyncio loop (whose I/O wait runs in a thread).

Crossing the two runtimes is a plain function call in the same thread: the
asyncio side appends to a stream's buffer and sets a ``trio.Event``; the trio
side puts into an ``asyncio.Queue`` and sets an ``asyncio.Event``. Nothing here
starts a thread. (grpcio itself polls its completion queue on a thread of its
own and wakes the loop through a socket; that is grpcio's, one wake-up per
completed operation.)

Bounds: every stream buffers at most ``max_buffered_bytes`` (and
``max_buffered_messages``) each way. The reader stops reading from gRPC while
the incoming buffer is full, so a peer that sends faster than the service
consumes is held back by HTTP/2 flow control; :meth:`MessageStream.send`
waits while the outgoing buffer is full (``try_send`` says no instead).

Errors: a call that fails or ends surfaces as :class:`StreamClosed` (with the
gRPC status when there is one) from ``receive``/``send``; a handler that raises
:class:`RpcAbort` ends its call with that status; any other exception in a
handler is logged once and ends the call with ``INTERNAL``.

TLS (docs/tls.md): a server given a :class:`common.tls.ServerCert` serves
only TLS. A client call names the peer's ``pin``: the sha256 fingerprint of the
certificate the peer announced (signed), :data:`UNPINNED` (encrypted when the
peer speaks TLS, plaintext when it does not, the peer never authenticated: only
for public bytes checked by hash, fetched from an address an operator typed,
such as a model's span from a peer), or ``None`` (plaintext; callers decide whether their
configuration allows it). grpcio has no hook to check a certificate's hash, so
the first dial of a pin reads the peer's certificate in a TLS handshake of our
own (trio's ``SSLStream``, nothing verified), refuses it unless its sha256 is
the pin, and then gives grpcio that certificate as the only trusted root, with
the fixed host name every node certificate carries
(``grpc.ssl_target_name_override``). grpcio's own handshake, on every
(re)connection, then accepts only a peer holding that certificate's key. A
certificate is fetched once per pin (its hash names it) and channels are kept
per (address, pin): a node that restarts with a new certificate is dialled on a
new channel.

Do not iterate grpc.aio calls with ``async for`` here: grpcio's Cython async
generators have no ``ag_frame``, which trio-asyncio's async-generator hooks
need; ``read()``/``write()`` are used instead.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

try:  # the C core's batch error (private module; absent in some builds)
    from grpc._cython import cygrpc as _cygrpc
except ImportError:  # pragma: no cover
    _cygrpc = None  # type: ignore[assignment]
import trio
import trio_asyncio

from common.tls import TLS_SERVER_NAME, ServerCert, fingerprint_der
from common.tls_dial import CERT_FETCH_TIMEOUT_S, NotTls, fetch_certificate

log = logging.getLogger("swarm.grpc")

DEFAULT_BUFFERED_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's own default
DEFAULT_BUFFERED_MESSAGES = 256
# ``pin`` of a call: TLS with whatever certificate the peer shows, or plaintext if it has no TLS (only
# for public, hash-checked bytes).
UNPINNED = "unpinned"
RETIRE_GRACE_S = 10.0  # a channel taken out of use lets its calls in flight finish this long
MAX_KNOWN_CERTS = 4096  # certificates remembered by pin (each ~600 bytes)
_END = object()


# grpcio's words for a TLS handshake it refused: the peer does not hold the pinned certificate.
_TLS_REFUSALS = ("CERTIFICATE_VERIFY_FAILED", "Tls handshake failed", "Ssl handshake failed")


class PinMismatch(Exception):
    """The peer's certificate is not the one it announced (or it speaks no TLS)."""


class RpcError(Exception):
    """A gRPC call failed; ``code`` is the grpc status name (``"UNAVAILABLE"``...) when known."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class StreamClosed(RpcError):
    """The stream ended (peer finished, call failed or was cancelled)."""


class RpcAbort(Exception):
    """Raised by a handler: end the call with this status (``code``: a gRPC status name such as
    ``"RESOURCE_EXHAUSTED"``, so callers need not import grpc)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class CallInfo:
    peer: str
    metadata: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class StreamStatistics:
    messages_in: int
    messages_out: int
    bytes_in: int
    bytes_out: int
    buffered_in_bytes: int
    buffered_out_bytes: int


def _describe(err: BaseException) -> tuple[str, str]:
    code = getattr(err, "code", None)
    details = getattr(err, "details", None)
    name = "UNKNOWN"
    if callable(code):
        try:
            name = code().name
        except Exception:  # a half-built error object
            name = "UNKNOWN"
    text = details() if callable(details) else str(err)
    if name == "UNAVAILABLE" and any(m in text for m in _TLS_REFUSALS):
        name = "UNAUTHENTICATED"  # the peer is there but not the one pinned (or speaks no TLS)
    return name, f"{name}: {text}"


class MessageStream:
    """One gRPC stream as trio sees it: ``send``/``receive`` bytes, bounded in bytes each way.

    One task may receive while another sends. Only this module's coroutines
    touch the asyncio side (``_pump_in``/``_pump_out``).
    """

    def __init__(
        self,
        peer: str,
        *,
        max_buffered_bytes: int = DEFAULT_BUFFERED_BYTES,
        max_buffered_messages: int = DEFAULT_BUFFERED_MESSAGES,
    ) -> None:
        self.peer = peer
        self._max_bytes = max_buffered_bytes
        self._max_messages = max_buffered_messages
        self._in: collections.deque[bytes] = collections.deque()
        self._in_bytes = 0
        self._in_ready = trio.Event()
        self._in_room = asyncio.Event()
        self._in_room.set()
        self._out: asyncio.Queue[object] = asyncio.Queue()
        self._out_bytes = 0
        self._out_messages = 0
        self._out_room = trio.Event()
        self._in_end: StreamClosed | None = None  # why no more messages will arrive
        self._closed: StreamClosed | None = None  # the whole stream failed or was closed
        self._send_closed = False
        self._stats = [0, 0, 0, 0]  # messages in, out; bytes in, out

    # -- trio side --------------------------------------------------------------------------------

    async def receive(self) -> bytes:
        """The next message; :class:`StreamClosed` once the stream ended and every message was read."""
        while not self._in:
            if self._in_end is not None:
                raise self._in_end
            await self._in_ready.wait()
            self._in_ready = trio.Event()
        data = self._in.popleft()
        self._in_bytes -= len(data)
        if self._in_bytes < self._max_bytes and len(self._in) < self._max_messages:
            self._in_room.set()
        return data

    def try_send(self, data: bytes) -> bool:
        """Queue ``data`` if the outgoing buffer has room (False: full); raises if the stream is closed."""
        if self._closed is not None:
            raise self._closed
        if self._send_closed:
            raise StreamClosed("this side already finished sending", "CANCELLED")
        if self._out_messages and (
            self._out_bytes + len(data) > self._max_bytes or self._out_messages >= self._max_messages
        ):
            return False
        self._out_bytes += len(data)
        self._out_messages += 1
        self._out.put_nowait(data)
        return True

    async def send(self, data: bytes) -> None:
        """Queue ``data``, waiting while the outgoing buffer is full."""
        while not self.try_send(data):
            await self._out_room.wait()
            self._out_room = trio.Event()

    def close_sending(self) -> None:
        """Half-close: the peer sees the end of our messages once the queued ones are written."""
        if not self._send_closed:
            self._send_closed = True
            self._out.put_nowait(_END)

    def fail(self, reason: str, code: str = "CANCELLED") -> None:
        """End the stream locally (waiters get :class:`StreamClosed`); the call is cancelled by its owner."""
        self._close(StreamClosed(reason, code))

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def statistics(self) -> StreamStatistics:
        m_in, m_out, b_in, b_out = self._stats
        return StreamStatistics(m_in, m_out, b_in, b_out, self._in_bytes, self._out_bytes)

    # -- asyncio side (this module only) ------------------------------------------------------------

    def _end_input(self, exc: StreamClosed) -> None:
        if self._in_end is None:
            self._in_end = exc
        self._in_ready.set()

    def _close(self, exc: StreamClosed) -> None:
        if self._closed is None:
            self._closed = exc
        self._end_input(exc)
        self._out_room.set()
        self._in_room.set()
        self._out.put_nowait(_END)

    async def _pump_in(self, read: Callable[[], Awaitable[Any]]) -> None:
        try:
            while self._closed is None:
                await self._in_room.wait()
                data = await read()
                if data is grpc.aio.EOF:  # the peer finished sending; we may still send
                    self._end_input(StreamClosed(f"{self.peer} ended the stream", "OK"))
                    return
                self._in.append(data)
                self._in_bytes += len(data)
                self._stats[0] += 1
                self._stats[2] += len(data)
                if self._in_bytes >= self._max_bytes or len(self._in) >= self._max_messages:
                    self._in_room.clear()
                self._in_ready.set()
        except asyncio.CancelledError:
            self._close(StreamClosed("the call was cancelled", "CANCELLED"))
            raise
        except _CALL_ERRORS as err:
            code, text = _describe(err)
            self._close(StreamClosed(f"stream with {self.peer} failed: {text}", code))

    async def _pump_out(
        self, write: Callable[[bytes], Awaitable[None]], done_writing: Callable[[], Awaitable[None]] | None
    ) -> None:
        try:
            while True:
                item = await self._out.get()
                if item is _END:
                    if done_writing is not None and self._closed is None:
                        await done_writing()
                    return
                assert isinstance(item, bytes)  # only try_send puts bytes here
                await write(item)
                self._out_bytes -= len(item)
                self._out_messages -= 1
                self._stats[1] += 1
                self._stats[3] += len(item)
                self._out_room.set()
        except asyncio.CancelledError:
            self._close(StreamClosed("the call was cancelled", "CANCELLED"))
            raise
        except _CALL_ERRORS as err:
            code, text = _describe(err)
            self._close(StreamClosed(f"stream with {self.peer} failed: {text}", code))


# What reading or writing a call can raise when the peer is gone: grpc's own errors, and the C core's
# batch error when the peer cancelled the call while replies were queued (a normal end of the
# stream for this side, not a handler failure to log with a traceback).
_CALL_ERRORS: tuple[type[BaseException], ...] = (
    grpc.RpcError,
    grpc.aio.AioRpcError,
    grpc.aio.UsageError,
    RuntimeError,
    *((_cygrpc.ExecuteBatchError,) if _cygrpc is not None else ()),
)

StreamHandler = Callable[[MessageStream, CallInfo], Awaitable[None]]
UnaryHandler = Callable[[bytes, CallInfo], Awaitable[bytes]]
ServerStreamHandler = Callable[[bytes, CallInfo], AsyncIterator[bytes]]


@dataclass(frozen=True)
class Service:
    """One gRPC service: method name -> trio handler (bytes in and out, no (de)serializers)."""

    name: str
    streams: Mapping[str, StreamHandler]
    unary: Mapping[str, UnaryHandler]
    server_streams: Mapping[str, ServerStreamHandler]


def _timeout() -> float | None:
    """The caller's trio deadline as a gRPC timeout (None: no deadline)."""
    deadline = trio.current_effective_deadline()
    if math.isinf(deadline):
        return None
    return max(0.001, deadline - trio.current_time())


class Grpc:
    """The process's grpc.aio runtime; made by :func:`open_grpc`, one per ``trio.run``."""

    def __init__(self, loop: trio_asyncio.TrioEventLoop, nursery: trio.Nursery) -> None:
        self._loop = loop
        self._nursery = nursery
        self._channels: dict[tuple[str, int, str | None], grpc.aio.Channel] = {}
        self._certs: dict[str, bytes] = {}  # pin -> its certificate (PEM), read once from the peer
        # address -> what an unpinned call there trusts (its certificate, or None: plaintext), read
        # once: a ping must not pay a TLS handshake of its own each time (it would measure that).
        self._unpinned: dict[str, bytes | None] = {}
        # Channels taken out of use while calls may still run on them: closed with a grace period
        # (RETIRE_GRACE_S) in the background, and at the latest when the runtime closes.
        self._retired: set[grpc.aio.Channel] = set()

    # -- clients -------------------------------------------------------------------------------------

    def _channel(
        self, address: str, max_message_bytes: int, pin: str | None, root: bytes | None
    ) -> grpc.aio.Channel:
        """One channel (one HTTP/2 connection) per address, message limit and pin, shared by its calls.

        Called from this module's asyncio coroutines only: grpc.aio binds a channel to the
        running asyncio loop when it is made.
        """
        key = (address, max_message_bytes, pin)
        channel = self._channels.get(key)
        if channel is None:
            options: list[tuple[str, Any]] = [
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.enable_retries", 0),
            ]
            if root is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                options.append(("grpc.ssl_target_name_override", TLS_SERVER_NAME))
                credentials = grpc.ssl_channel_credentials(root_certificates=root)
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            self._channels[key] = channel
        return channel

    async def _root(self, address: str, pin: str | None) -> bytes | None:
        """The certificate (PEM) grpcio is to trust for ``pin`` at ``address``; None for plaintext.

        Raises :class:`PinMismatch` when the peer shows another certificate or no TLS at all.
        """
        if pin is None:
            return None
        if pin == UNPINNED:
            if address in self._unpinned:
                return self._unpinned[address]
        else:
            known = self._certs.get(pin)
            if known is not None:
                return known
        try:
            der = await fetch_certificate(address)
        except NotTls:
            if pin == UNPINNED:  # the peer speaks no TLS: public, hash-checked bytes go in plaintext
                self._remember_unpinned(address, None)
                return None
            raise
        if pin != UNPINNED:
            got = fingerprint_der(der)
            if got != pin:
                raise PinMismatch(
                    f"the node at {address} shows TLS certificate {got[:16]}..., "
                    f"not {pin[:16]}... as announced"
                )
        pem = ssl.DER_cert_to_PEM_cert(der).encode("ascii")
        if pin != UNPINNED:
            if len(self._certs) >= MAX_KNOWN_CERTS:
                self._certs.pop(next(iter(self._certs)))
            self._certs[pin] = pem
        else:
            self._remember_unpinned(address, pem)
        return pem

    def _remember_unpinned(self, address: str, root: bytes | None) -> None:
        if len(self._unpinned) >= MAX_KNOWN_CERTS:
            self._unpinned.pop(next(iter(self._unpinned)))
        self._unpinned[address] = root

    def _forget_unpinned(self, address: str, pin: str | None, code: str) -> None:
        """An unpinned call that could not connect or was refused: the address may now hold another
        node (another certificate, or none); the next call reads it afresh on a new channel."""
        if pin == UNPINNED and code in ("UNAVAILABLE", "UNAUTHENTICATED"):
            self._unpinned.pop(address, None)
            # Not closed at once: that would cancel the calls still in flight on it (other pings),
            # which then end in asyncio.CancelledError. Nor only dropped: a channel collected after
            # its runtime's loop closed delivers its last events to that closed loop, which fails
            # whichever runtime is running then (seen as "Event loop is closed" in a later test).
            for key in [k for k in self._channels if k[0] == address and k[2] == UNPINNED]:
                self._retire(self._channels.pop(key))

    def _retire(self, channel: grpc.aio.Channel) -> None:
        self._retired.add(channel)

        async def close() -> None:
            try:
                with trio.move_on_after(RETIRE_GRACE_S + 2):
                    await self._in_aio(lambda: channel.close(grace=RETIRE_GRACE_S))
            finally:
                self._retired.discard(channel)

        self._nursery.start_soon(close)

    async def _in_aio(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        return await self._loop.run_aio_coroutine(fn())

    @asynccontextmanager
    async def open_stream(
        self,
        address: str,
        method: str,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_BUFFERED_BYTES,
        max_buffered_messages: int = DEFAULT_BUFFERED_MESSAGES,
        pin: str | None = None,
    ) -> AsyncIterator[MessageStream]:
        """A bidirectional stream to ``address``; leaving cancels the call (after queued sends on success).

        A peer that fails the pin gives a stream that is already closed (``UNAUTHENTICATED``).
        """
        stream = MessageStream(
            address, max_buffered_bytes=max_buffered_bytes, max_buffered_messages=max_buffered_messages
        )
        try:
            root = await self._root(address, pin)
        except (PinMismatch, OSError, trio.TooSlowError) as err:
            code = _pin_code(err)
            stream.fail(f"stream to {address} failed: {code}: {_pin_failure(address, err)}", code)
            yield stream
            return
        started, finished = trio.Event(), trio.Event()

        async def run_call() -> None:
            try:
                channel = self._channel(address, max_message_bytes, pin, root)
                call = channel.stream_stream(method)(metadata=tuple(metadata) or None)
            finally:
                started.set()
            pumps = [
                asyncio.ensure_future(stream._pump_in(call.read)),
                asyncio.ensure_future(stream._pump_out(call.write, call.done_writing)),
            ]
            try:
                await asyncio.gather(*pumps)
            finally:
                for p in pumps:
                    p.cancel()
                call.cancel()

        # The call lives until this context exits, whatever cancels the code using it meanwhile (a
        # shielded close, RELEASE/CANCEL on the way out of a cancelled request, still gets through). It
        # runs in the runtime's nursery so the caller's exceptions are not wrapped in a group here.
        call_scope = trio.CancelScope(shield=True)

        async def pump() -> None:
            try:
                with call_scope:
                    await self._loop.run_aio_coroutine(run_call())
            except Exception as err:  # a broken call: its stream reports it
                stream.fail(f"stream to {address} failed: {type(err).__name__}: {err}", "UNKNOWN")
            finally:
                started.set()
                finished.set()

        self._nursery.start_soon(pump)
        await started.wait()
        try:
            yield stream
        finally:
            stream.fail("the stream was closed by this side")
            call_scope.cancel()
            with trio.CancelScope(shield=True):
                await finished.wait()

    async def unary(
        self,
        address: str,
        method: str,
        request: bytes,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        pin: str | None = None,
    ) -> bytes:
        """One unary call; the deadline is the caller's trio deadline."""
        root = await self._checked_root(address, method, pin)
        timeout = _timeout()

        async def call() -> bytes:
            channel = self._channel(address, max_message_bytes, pin, root)
            try:
                reply: bytes = await channel.unary_unary(method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                code, text = _describe(err)
                self._forget_unpinned(address, pin, code)
                raise RpcError(f"{method} on {address} failed: {text}{_pinned(pin, code)}", code) from err
            return reply

        return await self._in_aio(call)  # type: ignore[no-any-return]

    async def server_stream(
        self,
        address: str,
        method: str,
        request: bytes,
        *,
        max_messages: int,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        pin: str | None = None,
    ) -> list[bytes]:
        """A server-streaming call read whole (at most ``max_messages``); deadline as for :meth:`unary`."""
        root = await self._checked_root(address, method, pin)
        timeout = _timeout()

        async def call() -> list[bytes]:
            channel = self._channel(address, max_message_bytes, pin, root)
            out: list[bytes] = []
            rpc = channel.unary_stream(method)(request, timeout=timeout)
            try:
                while (item := await rpc.read()) is not grpc.aio.EOF:
                    out.append(item)
                    if len(out) > max_messages:
                        rpc.cancel()
                        raise RpcError(f"{method} on {address} sent more than {max_messages} messages")
            except grpc.aio.AioRpcError as err:
                code, text = _describe(err)
                self._forget_unpinned(address, pin, code)
                raise RpcError(f"{method} on {address} failed: {text}{_pinned(pin, code)}", code) from err
            return out

        return await self._in_aio(call)  # type: ignore[no-any-return]

    async def _checked_root(self, address: str, method: str, pin: str | None) -> bytes | None:
        try:
            return await self._root(address, pin)
        except (PinMismatch, OSError, trio.TooSlowError) as err:
            raise RpcError(
                f"{method} on {address} failed: {_pin_code(err)}: {_pin_failure(address, err)}",
                _pin_code(err),
            ) from err

    async def aclose(self) -> None:
        channels, self._channels = [*self._channels.values(), *self._retired], {}
        for channel in channels:
            with trio.move_on_after(2):
                await self._in_aio(channel.close)

    # -- servers ---------------------------------------------------------------------------------------

    def _handlers(self, service: Service) -> grpc.GenericRpcHandler:
        loop = self._loop
        handlers: dict[str, grpc.RpcMethodHandler] = {}

        def info(context: grpc.aio.ServicerContext) -> CallInfo:
            meta = tuple((str(k), str(v)) for k, v in (context.invocation_metadata() or ()))
            return CallInfo(peer=context.peer(), metadata=meta)

        async def abort(context: grpc.aio.ServicerContext, err: BaseException) -> None:
            if isinstance(err, RpcAbort):
                await context.abort(getattr(grpc.StatusCode, err.code, grpc.StatusCode.UNKNOWN), err.details)
            log.error("gRPC handler failed: %s: %s", type(err).__name__, err, exc_info=err)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

        for name, stream_fn in service.streams.items():

            async def stream_behavior(
                _requests: Any, context: grpc.aio.ServicerContext, fn: StreamHandler = stream_fn
            ) -> None:
                stream = MessageStream(context.peer())
                pumps = [
                    asyncio.ensure_future(stream._pump_in(context.read)),
                    asyncio.ensure_future(stream._pump_out(context.write, None)),
                ]
                try:
                    await loop.trio_as_future(fn, stream, info(context))
                    stream.close_sending()
                    await pumps[1]  # replies queued before the handler returned still go out
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # the handler's failure ends this call only
                    await abort(context, err)
                finally:
                    stream.fail("the call ended")
                    for p in pumps:
                        p.cancel()

            handlers[name] = grpc.stream_stream_rpc_method_handler(stream_behavior)

        for name, unary_fn in service.unary.items():

            async def unary_behavior(
                request: bytes, context: grpc.aio.ServicerContext, fn: UnaryHandler = unary_fn
            ) -> bytes:
                try:
                    reply: bytes = await loop.trio_as_future(fn, request, info(context))
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    await abort(context, err)
                    raise  # abort raises; this line is never reached
                return reply

            handlers[name] = grpc.unary_unary_rpc_method_handler(unary_behavior)

        for name, server_stream_fn in service.server_streams.items():

            async def server_stream_behavior(
                request: bytes, context: grpc.aio.ServicerContext, fn: ServerStreamHandler = server_stream_fn
            ) -> None:
                async def collect() -> list[bytes]:
                    return [item async for item in fn(request, info(context))]

                try:
                    items: list[bytes] = await loop.trio_as_future(collect)
                    for item in items:
                        await context.write(item)
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    await abort(context, err)

            handlers[name] = grpc.unary_stream_rpc_method_handler(server_stream_behavior)
        return grpc.method_handlers_generic_handler(service.name, handlers)

    async def serve(
        self,
        host: str,
        port: int,
        services: Sequence[Service],
        *,
        options: Sequence[tuple[str, Any]] = (),
        shutdown_grace_s: float = 5.0,
        tls: ServerCert | None = None,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; ``task_status.started(port)`` once listening. Stops with a grace period.

        With ``tls`` the port speaks only TLS with that certificate; without, only plaintext.
        """
        where = f"{host}:{port}"

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(options=list(options))
            server.add_generic_rpc_handlers(tuple(self._handlers(s) for s in services))
            try:
                if tls is None:
                    bound = server.add_insecure_port(where)
                else:
                    credentials = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)])
                    bound = server.add_secure_port(where, credentials)
            except RuntimeError as err:  # grpc raises RuntimeError("Failed to bind ...")
                raise OSError(f"gRPC cannot listen on {where}: {err}") from err
            if bound == 0:
                raise OSError(f"gRPC cannot listen on {where}")
            await server.start()
            return server, bound

        server, bound = await self._in_aio(start)
        try:
            task_status.started(bound)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(shutdown_grace_s + 1):
                await self._in_aio(lambda: server.stop(shutdown_grace_s))


def _pinned(pin: str | None, code: str) -> str:
    return f" (not the certificate pinned, {pin[:16]}...)" if code == "UNAUTHENTICATED" and pin else ""


def _pin_code(err: BaseException) -> str:
    """UNAUTHENTICATED: the peer answered but is not the one pinned (or speaks no TLS);
    UNAVAILABLE: it could not be reached or did not answer in time."""
    return "UNAUTHENTICATED" if isinstance(err, PinMismatch | NotTls) else "UNAVAILABLE"


def _pin_failure(address: str, err: BaseException) -> str:
    if isinstance(err, PinMismatch):
        return str(err)
    if isinstance(err, trio.TooSlowError):
        return f"no TLS handshake with {address} within {CERT_FETCH_TIMEOUT_S:g} s"
    if isinstance(err, NotTls):
        return f"refused: {err} (a pinned node serves TLS)"
    return f"cannot connect to {address}: {type(err).__name__}: {err}"


_open: list[Grpc] = []  # the runtime open in this process, and how many holders share it


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """grpcio's completion queue is global to the process and hands each event to the loop its
    call or channel was made on. An event of an earlier runtime (a channel collected after that
    ``trio.run`` ended: tests run several in one process) finds that loop closed and raises in the
    running one's callback, failing whatever runs there. Such an event belongs to nobody alive:
    logged and dropped. Every other error goes to trio_asyncio's handler (raised into trio)."""
    err = context.get("exception")
    handle = repr(context.get("handle", ""))
    if isinstance(err, RuntimeError) and "Event loop is closed" in str(err) and "_handle_events" in handle:
        log.warning("dropped a gRPC event of a runtime that has ended: %s", err)
        return
    loop.default_exception_handler(context)


@asynccontextmanager
async def open_grpc() -> AsyncIterator[Grpc]:
    """The grpc.aio runtime of this process: open it in the service's root nursery.

    grpcio's completion queue is global to the process, so there is one
    runtime at a time: a nested ``open_grpc`` (two services in one test
    process) shares the one already open.
    """
    if _open:
        _open.append(_open[0])
        try:
            yield _open[0]
        finally:
            _open.pop()
        return
    async with trio_asyncio.open_loop() as loop, trio.open_nursery() as nursery:
        loop.set_exception_handler(_exception_handler)
        runtime = Grpc(loop, nursery)
        _open.append(runtime)
        try:
            yield runtime
        finally:
            _open.clear()
            with trio.CancelScope(shield=True):
                await runtime.aclose()
            nursery.cancel_scope.cancel()
