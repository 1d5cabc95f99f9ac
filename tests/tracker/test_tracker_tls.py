"""The tracker over HTTPS (real hypercorn on loopback): a self-signed certificate made on first start,
clients that pin it (common.tls_http through common.tracker_client), and what they refuse."""

from __future__ import annotations

import datetime
import functools
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tracker_helpers import announce_for, key, test_config

from common.tls import HttpTls, fingerprint_pem, generate_self_signed
from common.tls_http import CertificatePinError
from common.tracker_client import TrackerClient
from tracker.config import TLS_CERT_FILE, TLS_KEY_FILE, ConfigError, TrackerConfig, load_config
from tracker.server import RunningTracker, load_tls, serve_tracker

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def running(config: TrackerConfig) -> AsyncIterator[RunningTracker]:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ready: list[RunningTracker] = []
        await nursery.start(
            functools.partial(serve_tracker, config, shutdown=shutdown, on_ready=ready.append)
        )
        try:
            yield ready[0]
        finally:
            shutdown.set()


def _pin_error(err: BaseException) -> CertificatePinError:
    """httpx raises ConnectError; the pin check's own error is its cause."""
    assert isinstance(err, httpx.ConnectError), repr(err)
    assert isinstance(err.__cause__, CertificatePinError), repr(err.__cause__)
    return err.__cause__


async def test_self_signed_tracker_pinned_by_clients(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = test_config(tmp_path, tls_self_signed=True)
    data = Path(config.data_dir)
    with trio.fail_after(30):
        async with running(config) as tracker:
            cert_pem = (data / TLS_CERT_FILE).read_bytes()
            pin = fingerprint_pem(cert_pem)
            assert tracker.url == f"https://127.0.0.1:{tracker.port}"
            assert (data / TLS_KEY_FILE).stat().st_mode & 0o777 == 0o600
            said = capsys.readouterr().err
            assert "made a self-signed TLS certificate" in said and pin in said  # printed on first start
            k = key(1)
            async with TrackerClient(tracker.url, k, tls=HttpTls((pin,))) as client:
                assert (await client.healthz())["status"] == "ok"
                assert (await client.announce(announce_for(k)))["created"] is True
                assert [n["node_id"] for n in (await client.swarm())["nodes"]] == [client.key_id]
            # Another pin: refused, naming the certificate shown and the pin expected.
            wrong = generate_self_signed().fingerprint
            async with TrackerClient(tracker.url, key(2), tls=HttpTls((wrong,))) as client:
                with pytest.raises(httpx.ConnectError) as info:
                    await client.healthz()
            refused = _pin_error(info.value)
            assert (refused.got, refused.pins) == (pin, (wrong,))
            assert f"shows TLS certificate sha256 {pin}, not the pinned {wrong}" in str(info.value)
            # No pin: verified against the system CAs, which do not know a self-signed certificate.
            async with TrackerClient(tracker.url, key(3)) as client:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await client.healthz()
            # Plain HTTP to the HTTPS port gets nowhere.
            async with TrackerClient(f"http://127.0.0.1:{tracker.port}", key(4)) as client:
                with pytest.raises(httpx.TransportError):
                    await client.healthz()
    # A restart keeps the certificate (the pin stays valid) and says nothing about making one.
    with trio.fail_after(30):
        async with running(config) as tracker:
            assert (data / TLS_CERT_FILE).read_bytes() == cert_pem
            assert "made a self-signed" not in capsys.readouterr().err
            async with TrackerClient(tracker.url, key(1), tls=HttpTls((pin,))) as client:
                assert (await client.healthz())["status"] == "ok"


async def test_replicas_with_their_own_certificates_fail_over_on_a_wrong_pin(tmp_path: Path) -> None:
    """Several pins, one per replica; a replica showing none of them is skipped like a dead one."""
    first = test_config(tmp_path / "a", tls_self_signed=True)
    second = replace(test_config(tmp_path / "b", tls_self_signed=True))
    with trio.fail_after(30):
        async with running(first) as t1, running(second) as t2:
            pin2 = fingerprint_pem((Path(second.data_dir) / TLS_CERT_FILE).read_bytes())
            urls = f"{t1.url},{t2.url}"
            async with TrackerClient(urls, key(1), tls=HttpTls((pin2,))) as client:
                assert (await client.healthz())["status"] == "ok"
                assert client.url == t2.url and client.failovers == 1
            # Neither pinned: the last failure surfaces, with the pin in its message.
            other = generate_self_signed().fingerprint
            async with TrackerClient(urls, key(1), tls=HttpTls((other,))) as client:
                with pytest.raises(httpx.ConnectError) as info:
                    await client.healthz()
            assert _pin_error(info.value).pins == (other,)


@pytest.mark.slow  # runs the swarm-tracker CLI
def test_tls_fingerprint_command(tmp_path: Path) -> None:
    """`swarm-tracker tls-fingerprint` prints the pin of the certificate the tracker serves."""
    data = tmp_path / "data"

    def shown(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tracker.cli", "tls-fingerprint", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    before = shown("--data-dir", str(data))
    assert before.returncode == 1 and "start the tracker once with --tls-self-signed" in before.stderr
    cert, made = load_tls(test_config(tmp_path, tls_self_signed=True))
    assert made
    after = shown("--data-dir", str(data))
    assert (after.returncode, after.stdout.strip()) == (0, cert.fingerprint), after.stderr
    given = shown("--tls-cert-file", str(data / TLS_CERT_FILE))
    assert given.stdout.strip() == cert.fingerprint


def _localhost_cert(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for DNS:localhost (what a CA file can vouch for, name checked)."""
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(k.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(k, hashes.SHA256())
    )
    where.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = where / "t.crt", where / "t.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


async def test_given_certificate_verified_against_a_ca_file(tmp_path: Path) -> None:
    cert, cert_key = _localhost_cert(tmp_path / "tls")
    config = test_config(tmp_path, tls_cert_file=str(cert), tls_key_file=str(cert_key))
    with trio.fail_after(30):
        async with running(config) as tracker:
            assert not (Path(config.data_dir) / TLS_CERT_FILE).exists()  # nothing made
            url = f"https://localhost:{tracker.port}"
            async with TrackerClient(url, key(1), tls=HttpTls(ca_file=str(cert))) as client:
                assert (await client.healthz())["status"] == "ok"
            # The name is checked when a CA vouches: 127.0.0.1 is not in the certificate.
            async with TrackerClient(tracker.url, key(1), tls=HttpTls(ca_file=str(cert))) as client:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await client.healthz()
            async with TrackerClient(
                tracker.url, key(1), tls=HttpTls((fingerprint_pem(cert.read_bytes()),))
            ) as c:
                assert (await c.healthz())["status"] == "ok"  # a pin needs no name


async def test_nothing_is_sent_before_the_pin_is_checked(tmp_path: Path) -> None:
    """A TLS server that records what it receives after the handshake: a client pinning another
    certificate closes the connection without writing a byte; one pinning this one sends its request."""
    cert = generate_self_signed()
    (tmp_path / "c.pem").write_bytes(cert.cert_pem)
    (tmp_path / "k.pem").write_bytes(cert.key_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    received: list[bytes] = []

    async def handler(tcp: trio.SocketStream) -> None:
        tls = trio.SSLStream(tcp, context, server_side=True)
        data = b""
        try:
            await tls.do_handshake()
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in data:
                    chunk = await tls.receive_some(65536)
                    if not chunk:
                        break
                    data += chunk
            if data:
                await tls.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            received.append(data)
            await trio.aclose_forcefully(tls)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            url = f"https://127.0.0.1:{listener.socket.getsockname()[1]}"
            wrong = generate_self_signed().fingerprint
            async with TrackerClient(url, key(1), tls=HttpTls((wrong,))) as client:
                with pytest.raises(httpx.ConnectError):
                    await client.healthz()
            async with TrackerClient(url, key(1), tls=HttpTls((cert.fingerprint,))) as client:
                assert await client.healthz() == {}
            nursery.cancel_scope.cancel()
    assert received[0] == b""  # the refused connection: not a byte of the request
    assert received[1].startswith(b"GET /healthz HTTP/1.1\r\n")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"tls_cert_file": "/x.crt"}, "tls_cert_file and tls_key_file go together"),
        ({"tls_cert_file": "/x.crt", "tls_key_file": "/x.key", "tls_self_signed": True}, "tls_self_signed"),
    ],
)
def test_tracker_tls_settings_refused(flags: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(env={}, flags=flags)


def test_client_pin_settings_refused() -> None:
    from gateway.config import ConfigError as GatewayConfigError
    from gateway.config import load_config as gateway_config
    from node.config import ConfigError as NodeConfigError
    from node.config import load_config as node_config

    pin = "ab" * 32
    cases = [
        ({"tracker_url": "http://t:7460", "tracker_tls_fingerprint": pin}, "need https:// tracker URLs"),
        ({"tracker_url": "https://t:7460", "tracker_tls_fingerprint": "abc"}, "not a SHA-256 fingerprint"),
        (
            {"tracker_url": "https://t:7460", "tracker_tls_fingerprint": pin, "tracker_ca_file": "/ca.pem"},
            "exclude each other",
        ),
    ]
    for flags, needle in cases:
        with pytest.raises(GatewayConfigError, match=needle):
            gateway_config(env={}, flags=flags)
        with pytest.raises(NodeConfigError, match=needle):
            node_config(env={}, flags={**flags, "model": "m.gguf"})
    ok = gateway_config(
        env={}, flags={"tracker_url": "https://t:7460", "tracker_tls_fingerprint": pin.upper()}
    )
    assert ok.tracker_tls() == HttpTls((pin,))
    # As `openssl x509 -noout -fingerprint -sha256` prints it; several pins, duplicates once.
    colons = ":".join(pin[i : i + 2] for i in range(0, 64, 2)).upper()
    other = "cd" * 32
    assert HttpTls.from_settings(f"{colons}, {other},{pin}") == HttpTls((pin, other))
