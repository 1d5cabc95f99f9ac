"""Node certificates for gRPC over TLS, pinned by their SHA-256 fingerprint (docs/tls.md).

A node serves TLS with a self-signed ECDSA P-256 certificate it makes on first
start and keeps beside its identity key (``node-tls.key`` mode 0600,
``node-tls.crt``). No certificate authority: the node's signed announcement
carries the certificate's fingerprint (sha256 of its DER bytes, 64 lowercase
hex), and whoever dials the node (gateway, the previous stage, the tracker's
challenger) refuses any other certificate. ``common.grpc_adapter`` does the
dialling; this module (pure: no I/O loop) makes, loads and fingerprints
certificates; ``common.tls_dial`` reads a peer's certificate and builds a
client context that trusts one pin (the relay's ``wss://``).

Every node certificate names the same host, :data:`TLS_SERVER_NAME`, in its
subjectAltName: grpcio checks the certificate against a host name, and the
dialler tells it to expect this one (``grpc.ssl_target_name_override``). The
name carries no meaning; the pin does.

Why P-256: it is what grpcio's BoringSSL accepts for a server key on every
platform (Ed25519 certificates are not offered by its TLS stack), and signing a
handshake with it costs microseconds.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

TLS_SERVER_NAME = "swarm-node"
CERT_FILE = "node-tls.crt"
KEY_FILE = "node-tls.key"
CERT_VALIDITY_DAYS = 3650  # the pin, not the dates, is what is trusted; renew by deleting the files
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class TlsError(ValueError):
    """A certificate or key cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ServerCert:
    """A certificate and its private key (PEM), and the certificate's pin."""

    cert_pem: bytes
    key_pem: bytes
    fingerprint: str  # sha256 of the certificate's DER bytes, lowercase hex


def is_fingerprint(value: str) -> bool:
    return bool(_FINGERPRINT.match(value))


@dataclass(frozen=True)
class HttpTls:
    """How an https:// server's certificate is trusted (``common.tls_http`` does it): ``pins`` (sha256
    of the DER certificate, 64 hex each; any one may match), else ``ca_file`` or the system CAs."""

    pins: tuple[str, ...] = ()
    ca_file: str = ""

    @classmethod
    def from_settings(cls, fingerprints: str, ca_file: str = "") -> HttpTls:
        """From a config's ``*_tls_fingerprint`` (one pin, or several separated by commas) and CA file."""
        return cls(parse_fingerprints(fingerprints), ca_file)


def parse_fingerprints(text: str) -> tuple[str, ...]:
    """``"<64 hex>"`` or several separated by commas -> the pins (lowercase); TlsError for a bad one."""
    pins = tuple(dict.fromkeys(p.strip().lower().replace(":", "") for p in text.split(",") if p.strip()))
    for pin in pins:
        if not is_fingerprint(pin):
            raise TlsError(f"{pin[:20]!r} is not a SHA-256 fingerprint (64 hex digits)")
    return pins


def pin_settings_problem(name: str, urls: str, fingerprints: str, ca_file: str) -> str | None:
    """What is wrong with pinning ``fingerprints`` (or ``ca_file``) for the servers at ``urls``, or None.

    ``name`` is the setting's prefix (``tracker`` for ``tracker_tls_fingerprint``/``tracker_ca_file``)."""
    try:
        pins = parse_fingerprints(fingerprints)
    except TlsError as err:
        return f"{name}_tls_fingerprint: {err}"
    if pins and ca_file:
        return f"{name}_tls_fingerprint and {name}_ca_file exclude each other: a pin trusts no CA"
    plain = [u.strip() for u in urls.split(",") if u.strip() and not u.strip().startswith("https://")]
    if (pins or ca_file) and plain:
        return f"{name}_tls_fingerprint and {name}_ca_file need https:// {name} URLs (got {plain[0]!r})"
    return None


def fingerprint_der(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def fingerprint_pem(pem: bytes) -> str:
    """The pin of the first certificate in ``pem`` (a chain's leaf)."""
    try:
        text = pem.decode("ascii")
        end = text.index(ssl.PEM_FOOTER) + len(ssl.PEM_FOOTER)
        der = ssl.PEM_cert_to_DER_cert(text[text.index(ssl.PEM_HEADER) : end])
    except (ValueError, UnicodeDecodeError) as err:
        raise TlsError(f"not a PEM certificate: {err}") from err
    return fingerprint_der(der)


def generate_self_signed(
    common_name: str = TLS_SERVER_NAME, dns_names: tuple[str, ...] = (TLS_SERVER_NAME,)
) -> ServerCert:
    """A fresh P-256 key and a self-signed certificate for ``dns_names`` (default :data:`TLS_SERVER_NAME`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ServerCert(cert_pem, key_pem, fingerprint_der(cert.public_bytes(serialization.Encoding.DER)))


def load_server_cert(cert_path: Path, key_path: Path) -> ServerCert:
    """An operator's (or a previous start's) certificate and key; the key must be private (0600)."""
    try:
        cert_pem = cert_path.read_bytes()
        key_pem = key_path.read_bytes()
        mode = key_path.stat().st_mode & 0o777
    except OSError as err:
        raise TlsError(f"cannot read the TLS certificate or key: {err}") from err
    if mode & 0o077:
        raise TlsError(
            f"{key_path} has mode {mode:o}; a private key must not be readable by others (chmod 600)"
        )
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except (ValueError, TypeError) as err:
        raise TlsError(
            f"{cert_path} / {key_path}: not a PEM certificate and an unencrypted PEM key: {err}"
        ) from err
    if cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise TlsError(f"{key_path} is not the key of the certificate {cert_path}")
    return ServerCert(cert_pem, key_pem, fingerprint_der(cert.public_bytes(serialization.Encoding.DER)))


def load_or_create_server_cert(
    directory: Path,
    *,
    cert_name: str = CERT_FILE,
    key_name: str = KEY_FILE,
    common_name: str = TLS_SERVER_NAME,
) -> tuple[ServerCert, bool]:
    """The certificate kept in ``directory`` (made now if there is none), and whether it was made now.

    ``cert_name``/``key_name``: the files' names (a node's by default); ``common_name``: the subject
    and only DNS name of a certificate made now.

    The key is written first, with ``O_CREAT | O_EXCL`` and mode 0600, so two
    processes starting at once cannot both write one; the certificate follows.
    """
    cert_path, key_path = directory / cert_name, directory / key_name
    if cert_path.exists() and key_path.exists():
        return load_server_cert(cert_path, key_path), False
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    made = generate_self_signed(common_name, (common_name,))
    try:
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # a key without its certificate: refuse rather than guess
        raise TlsError(
            f"{key_path} exists without {cert_path}; "
            "remove it (a new certificate is made) or restore the pair"
        ) from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(made.key_pem)
    tmp = cert_path.with_suffix(".partial")
    tmp.write_bytes(made.cert_pem)
    tmp.replace(cert_path)
    return made, True
