"""Reading a peer's TLS certificate and trusting it by its pin (trio; docs/tls.md).

grpcio and Python's ``ssl`` can trust a set of root certificates but cannot be
told "accept the certificate whose sha256 is X". So a dialler first reads the
peer's certificate in a TLS handshake of its own that verifies nothing
(:func:`fetch_certificate`), compares its hash with the pin, and then trusts
that one certificate as the only root for the real connection (grpcio:
``common.grpc_adapter``; a WebSocket: :func:`pinned_client_context`). The real
connection's handshake proves the peer holds the certificate's key.
"""

from __future__ import annotations

import ssl

import trio

from common.tls import TLS_SERVER_NAME, TlsError, fingerprint_der

CERT_FETCH_TIMEOUT_S = 5.0  # reading a peer's certificate, at most (a tarpit costs no more)


class NotTls(OSError):
    """The peer accepted the connection but completed no TLS handshake (plaintext, or not a server)."""


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise OSError(f"{address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


async def fetch_certificate(address: str, alpn: tuple[str, ...] = ("h2",)) -> bytes:
    """The certificate (DER) the TLS server at ``address`` shows, read without verifying anything.

    Only its hash is looked at (against a pin) before it is trusted (by grpcio, or
    :func:`pinned_client_context`). Bounded by
    :data:`CERT_FETCH_TIMEOUT_S` (``trio.TooSlowError``); a peer speaking no TLS raises
    :class:`NotTls`, one that cannot be reached another ``OSError``.
    """
    host, port = _split_host_port(address)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(list(alpn))
    with trio.fail_after(CERT_FETCH_TIMEOUT_S):
        tcp = await trio.open_tcp_stream(host, port)
        tls = trio.SSLStream(tcp, context, server_hostname=TLS_SERVER_NAME)
        try:
            await tls.do_handshake()
            der = tls.getpeercert(binary_form=True)
        except (trio.BrokenResourceError, ssl.SSLError) as err:
            raise NotTls(f"no TLS from {address}: {err}") from err
        finally:
            await trio.aclose_forcefully(tls)
    if not der:
        raise NotTls(f"{address} showed no certificate")
    return bytes(der)


async def pinned_client_context(address: str, pin: str) -> ssl.SSLContext:
    """A client context that trusts exactly the certificate whose sha256 is ``pin`` (host name
    unchecked: the pin names the peer). Reads the certificate at ``address`` once and checks its hash."""
    der = await fetch_certificate(address, alpn=("http/1.1",))
    got = fingerprint_der(der)
    if got != pin:
        raise TlsError(f"{address} shows TLS certificate {got[:16]}..., not the pinned {pin[:16]}...")
    context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA-issued leaf may be pinned too
    return context
