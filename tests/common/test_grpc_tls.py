"""gRPC over TLS through the adapter: pinned certificates on loopback, one process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import trio

from common import tls
from common.grpc_adapter import UNPINNED, RpcError, StreamClosed, open_grpc
from tests.common.test_grpc_adapter import SERVICE


async def test_a_pinned_call_reaches_the_node_whose_certificate_it_names() -> None:
    cert, other = tls.generate_self_signed(), tls.generate_self_signed()
    async with open_grpc() as rt, trio.open_nursery() as nursery:
        port = await nursery.start(lambda **kw: rt.serve("127.0.0.1", 0, [SERVICE], tls=cert, **kw))
        address = f"127.0.0.1:{port}"
        with trio.fail_after(20):
            assert await rt.unary(address, "/test.Echo/Hello", b"you", pin=cert.fingerprint) == b"hello you"
            async with rt.open_stream(address, "/test.Echo/Session", pin=cert.fingerprint) as stream:
                await stream.send(b"abc")
                assert await stream.receive() == b"cba"
            got = await rt.server_stream(
                address, "/test.Echo/Chunks", b"2", max_messages=4, pin=cert.fingerprint
            )
            assert got == [b"0", b"1"]
            # Encrypted without a pin (public bytes from an address an operator typed).
            assert await rt.unary(address, "/test.Echo/Hello", b"x", pin=UNPINNED) == b"hello x"

            # Another certificate than announced: refused before any byte of the call is sent.
            with pytest.raises(RpcError) as refused:
                await rt.unary(address, "/test.Echo/Hello", b"you", pin=other.fingerprint)
            assert refused.value.code == "UNAUTHENTICATED"
            assert "not" in str(refused.value) and other.fingerprint[:16] in str(refused.value)
            async with rt.open_stream(address, "/test.Echo/Session", pin=other.fingerprint) as stream:
                with pytest.raises(StreamClosed) as closed:
                    await stream.send(b"abc")
                assert closed.value.code == "UNAUTHENTICATED"

            # A plaintext client gets nothing from a TLS port.
            with pytest.raises(RpcError) as plain:
                await rt.unary(address, "/test.Echo/Hello", b"you")
            assert plain.value.code == "UNAVAILABLE"
        nursery.cancel_scope.cancel()


async def test_grpcio_itself_refuses_another_certificate_once_a_pin_is_known() -> None:
    """The pin's certificate is read once; after that grpcio's own handshake is what refuses."""
    cert, other = tls.generate_self_signed(), tls.generate_self_signed()
    async with open_grpc() as rt, trio.open_nursery() as nursery:
        right = await nursery.start(lambda **kw: rt.serve("127.0.0.1", 0, [SERVICE], tls=cert, **kw))
        wrong = await nursery.start(lambda **kw: rt.serve("127.0.0.1", 0, [SERVICE], tls=other, **kw))
        with trio.fail_after(20):
            assert await rt.unary(f"127.0.0.1:{right}", "/test.Echo/Hello", b"a", pin=cert.fingerprint)
            with pytest.raises(RpcError) as refused:
                await rt.unary(f"127.0.0.1:{wrong}", "/test.Echo/Hello", b"a", pin=cert.fingerprint)
            assert refused.value.code == "UNAUTHENTICATED" and cert.fingerprint[:16] in str(refused.value)
        nursery.cancel_scope.cancel()


async def test_a_pin_is_refused_by_a_plaintext_server() -> None:
    cert = tls.generate_self_signed()
    async with open_grpc() as rt, trio.open_nursery() as nursery:
        port = await nursery.start(rt.serve, "127.0.0.1", 0, [SERVICE])
        with trio.fail_after(20):
            with pytest.raises(RpcError) as refused:
                await rt.unary(f"127.0.0.1:{port}", "/test.Echo/Hello", b"you", pin=cert.fingerprint)
            assert refused.value.code == "UNAUTHENTICATED"
            # Nobody there: unavailable, not a refusal of the peer.
            with pytest.raises(RpcError) as gone:
                await rt.unary("127.0.0.1:1", "/test.Echo/Hello", b"you", pin=cert.fingerprint)
            assert gone.value.code == "UNAVAILABLE"
            # Unpinned (public bytes) falls back to plaintext for a peer without TLS.
            assert await rt.unary(f"127.0.0.1:{port}", "/test.Echo/Hello", b"x", pin=UNPINNED) == b"hello x"
        nursery.cancel_scope.cancel()


def test_certificates_are_kept_private_and_reloaded(tmp_path: Path) -> None:
    made, created = tls.load_or_create_server_cert(tmp_path / "node")
    assert created and tls.is_fingerprint(made.fingerprint)
    assert stat.S_IMODE(os.stat(tmp_path / "node" / tls.KEY_FILE).st_mode) == 0o600
    again, created = tls.load_or_create_server_cert(tmp_path / "node")
    assert not created and again == made
    assert tls.fingerprint_pem(made.cert_pem) == made.fingerprint
    os.chmod(tmp_path / "node" / tls.KEY_FILE, 0o644)
    with pytest.raises(tls.TlsError, match="chmod 600"):
        tls.load_or_create_server_cert(tmp_path / "node")
    other = tls.generate_self_signed()
    (tmp_path / "k").write_bytes(other.key_pem)
    os.chmod(tmp_path / "k", 0o600)
    with pytest.raises(tls.TlsError, match="not the key"):
        tls.load_server_cert(tmp_path / "node" / tls.CERT_FILE, tmp_path / "k")


async def test_unpinned_calls_read_the_certificate_once_per_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ping (unpinned Health) must cost one round trip, not a TLS handshake of its own each time:
    round-trip samples would measure handshakes (3-4x the path's RTT on the emulated WAN)."""
    from common import grpc_adapter

    fetches: list[str] = []
    real = grpc_adapter.fetch_certificate

    async def counting(address: str) -> bytes:
        fetches.append(address)
        return await real(address)

    monkeypatch.setattr(grpc_adapter, "fetch_certificate", counting)
    cert = tls.generate_self_signed()
    async with open_grpc() as rt, trio.open_nursery() as nursery:
        port = await nursery.start(lambda **kw: rt.serve("127.0.0.1", 0, [SERVICE], tls=cert, **kw))
        address = f"127.0.0.1:{port}"
        with trio.fail_after(20):
            for _ in range(5):
                assert await rt.unary(address, "/test.Echo/Hello", b"x", pin=UNPINNED) == b"hello x"
            assert fetches == [address]
            # Nobody answers there any more: the next call reads the address afresh.
            with pytest.raises(RpcError):
                await rt.unary("127.0.0.1:1", "/test.Echo/Hello", b"x", pin=UNPINNED)
        nursery.cancel_scope.cancel()
