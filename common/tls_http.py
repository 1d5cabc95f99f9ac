"""HTTPS to a server pinned by its certificate's SHA-256 (trio + httpx; docs/tls.md, "The tracker over
HTTPS").

Nodes, gateways and the command-line tools reach the tracker over HTTP(S)
through ``common.tracker_client.TrackerClient``, which builds its httpx client
here. :class:`common.tls.HttpTls` says how a server's certificate is trusted:

- ``pins`` given: every new connection's TLS handshake is finished, the
  certificate the server showed is hashed (sha256 of its DER bytes) and
  compared with the pins *before a byte of the request is written*; any other
  certificate ends the connection with :class:`CertificatePinError` ("... shows
  TLS certificate A, not the pinned B"). Names and dates are not looked at (a
  self-signed certificate is what a pin is for); the handshake proves the
  server holds the key of the certificate it showed.
- no pins: the usual verification -- the system CA store, or ``ca_file``.

httpx has no hook between handshake and request, so the check sits in the
network backend of the connection pool (httpcore's), which opens every
connection the client makes: no connection reaches the HTTP layer unchecked,
keep-alive reconnections included.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

from common.tls import HttpTls, fingerprint_der


class CertificatePinError(httpcore.ConnectError):
    """The server showed a certificate that is not pinned (httpx surfaces it as ``httpx.ConnectError``,
    with this as its ``__cause__``): a connection failure like a refused one, with its own message."""

    def __init__(self, server: str, got: str, pins: tuple[str, ...]) -> None:
        self.server = server
        self.got = got
        self.pins = pins
        expected = " or ".join(pins)
        super().__init__(f"{server} shows TLS certificate sha256 {got}, not the pinned {expected}")


def pin_refusal(err: BaseException) -> CertificatePinError | None:
    """The pin check's refusal behind ``err`` (an ``httpx.ConnectError``), or None for another failure."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None or isinstance(seen, CertificatePinError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _ssl_reason(err: BaseException) -> str | None:
    """The ``ssl.SSLError`` behind a failed handshake (httpcore and trio wrap it without its text)."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return " ".join(str(seen).split())
        seen = seen.__cause__ or seen.__context__
    return None


class _CheckedStream(httpcore.AsyncNetworkStream):
    """A TCP connection whose ``start_tls`` refuses any certificate but the pinned ones (with pins),
    and says why a handshake failed."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, server: str, pins: tuple[str, ...]) -> None:
        self._inner = inner
        self._server = server
        self._pins = pins

    # httpcore's stream interface takes timeouts as arguments (ASYNC109: its signature, not ours).
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        try:
            tls = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        except httpcore.ConnectError as err:
            why = _ssl_reason(err)
            if why is None:
                raise
            raise httpcore.ConnectError(f"TLS handshake with {self._server} failed: {why}") from err
        if not self._pins:
            return tls
        ssl_object = tls.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        got = fingerprint_der(bytes(der)) if der else "(none)"
        if got not in self._pins:
            await tls.aclose()
            raise CertificatePinError(self._server, got, self._pins)
        return tls

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, pins: tuple[str, ...]) -> None:
        self._inner = httpcore.TrioBackend()
        self._pins = pins

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        inner = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        server = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return _CheckedStream(inner, server, self._pins)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _context(tls: HttpTls) -> ssl.SSLContext:
    """With pins: encryption without name or chain checks (the pin, compared after the handshake, is
    the check); else the usual verification against the CA file or the system CAs."""
    context = ssl.create_default_context(cafile=None if tls.pins else tls.ca_file or None)
    if tls.pins:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class _CheckedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, tls: HttpTls) -> None:
        context = _context(tls)
        super().__init__(verify=context)
        # httpx builds its pool with the default network backend; the same pool with the checking one
        # (httpx offers no other way to reach the moment between handshake and request).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context, network_backend=_CheckedBackend(tls.pins)
        )


def async_client(tls: HttpTls, *, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """An httpx client (no timeouts of its own: the caller's ``trio.fail_after`` bounds calls) that
    trusts https:// servers as ``tls`` says. ``transport`` (tests) replaces all of it."""
    if transport is not None:
        return httpx.AsyncClient(timeout=None, transport=transport)
    # With pins, no proxies from the environment: they would get transports of their own, unpinned.
    return httpx.AsyncClient(timeout=None, transport=_CheckedTransport(tls), trust_env=not tls.pins)
