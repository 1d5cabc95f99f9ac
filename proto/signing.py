"""Signed envelopes: how nodes, gateways and the tracker sign what they send.

Pure: pynacl, json and the standard library only; no I/O, no clock (callers pass
``now_s``), so nodes, gateways, the tracker and tests share one implementation.

Envelope (JSON object, exactly these three keys)::

    {"payload":    base64 (standard, padded) of the canonical JSON bytes,
     "signature":  base64 of the 64-byte ed25519 signature over those bytes,
     "public_key": hex of the signer's 32-byte ed25519 verify key}

Canonical JSON: UTF-8, keys sorted, no whitespace, no NaN/Infinity. The
signature covers the exact payload bytes, and :func:`open_envelope` verifies it
*before* decoding them: nothing from an unauthenticated payload is parsed.

Every signed payload carries::

    kind        what it is ("announce", "heartbeat", "usage", "route_ticket"); a
                signature for one kind is never accepted as another
    <signer>    the signer's id = hex public key ("node_id" for nodes,
                "gateway_id" for gateways, "tracker_id" for the tracker)
    timestamp   seconds since the Unix epoch (float) when it was signed
    nonce       16..64 characters of [0-9A-Za-z_-], unique per signer within the window

Refusals raise :class:`SignatureError` whose ``reason`` is one of
``malformed_envelope``, ``bad_signature``, ``key_mismatch``, ``wrong_kind``,
``stale_timestamp``, ``replayed_nonce``, ``nonce_cache_full``,
``untrusted_key``, ``expired``, and for gateway proofs ``missing_proof``, ``proof_mismatch``.

Replay protection: a message is accepted only if ``|now - timestamp| <= skew_s``
and its ``(public_key, nonce)`` is not in the :class:`NonceCache`; the cache
remembers a nonce until ``timestamp + skew_s`` has passed (after that the
timestamp check refuses the message anyway), and it is bounded: when full of
unexpired nonces it refuses new messages rather than forget old ones.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import nacl.exceptions
import nacl.signing

_NONCE_RE = re.compile(r"^[0-9A-Za-z_-]{16,64}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


class SignatureError(ValueError):
    """A signed message was refused; ``reason`` is a stable machine-readable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding that gets signed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def new_nonce() -> str:
    return base64.urlsafe_b64encode(os.urandom(18)).decode("ascii")


def public_key_hex(key: nacl.signing.SigningKey) -> str:
    return bytes(key.verify_key).hex()


def sign_envelope(key: nacl.signing.SigningKey, payload: Mapping[str, Any]) -> dict[str, str]:
    """Wrap ``payload`` (already carrying kind, signer id, timestamp, nonce) in a signed envelope."""
    body = canonical_json(dict(payload))
    signed = key.sign(body)
    return {
        "payload": base64.b64encode(body).decode("ascii"),
        "signature": base64.b64encode(signed.signature).decode("ascii"),
        "public_key": public_key_hex(key),
    }


def make_payload(
    kind: str, signer_field: str, key: nacl.signing.SigningKey, now_s: float, body: Mapping[str, Any]
) -> dict[str, Any]:
    """``body`` plus the envelope fields every signed payload carries."""
    out = dict(body)
    out.update(
        {"kind": kind, signer_field: public_key_hex(key), "timestamp": float(now_s), "nonce": new_nonce()}
    )
    return out


def _b64(value: Any, what: str, max_len: int) -> bytes:
    if not isinstance(value, str) or len(value) > max_len:
        raise SignatureError("malformed_envelope", f"envelope {what} must be a base64 string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as err:
        raise SignatureError("malformed_envelope", f"envelope {what} is not valid base64") from err


def verify_envelope(envelope: Any, *, max_payload_bytes: int = 1 << 20) -> tuple[bytes, str]:
    """Check the signature only; return ``(payload_bytes, public_key_hex)``. Decodes nothing."""
    if not isinstance(envelope, Mapping) or set(envelope) != {"payload", "signature", "public_key"}:
        raise SignatureError(
            "malformed_envelope", "envelope must be an object with exactly payload, signature, public_key"
        )
    pk = envelope["public_key"]
    if not isinstance(pk, str) or not _HEX64_RE.match(pk):
        raise SignatureError("malformed_envelope", "public_key must be 64 lowercase hex characters")
    payload = _b64(envelope["payload"], "payload", 4 * max_payload_bytes // 3 + 4)
    signature = _b64(envelope["signature"], "signature", 100)
    if len(signature) != 64:
        raise SignatureError("malformed_envelope", "signature must be 64 bytes")
    try:
        nacl.signing.VerifyKey(bytes.fromhex(pk)).verify(payload, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError) as err:
        raise SignatureError("bad_signature", "signature does not verify for this public key") from err
    return payload, pk


class NonceSink(Protocol):
    """Where :func:`open_envelope` records a nonce; raises :class:`SignatureError` to refuse it."""

    def check_and_add(self, public_key: str, nonce: str, expires_at_s: float, now_s: float) -> None: ...


class NonceCache:
    """Bounded set of recently seen ``(public_key, nonce)``, each kept until its expiry time."""

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._expiry: dict[tuple[str, str], float] = {}
        self._heap: list[tuple[float, tuple[str, str]]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def _expire(self, now_s: float) -> None:
        while self._heap and self._heap[0][0] < now_s:
            when, entry = heapq.heappop(self._heap)
            if self._expiry.get(entry) == when:
                del self._expiry[entry]

    def check_and_add(self, public_key: str, nonce: str, expires_at_s: float, now_s: float) -> None:
        self._expire(now_s)
        entry = (public_key, nonce)
        if entry in self._expiry:
            raise SignatureError("replayed_nonce", "nonce already used by this key")
        if len(self._expiry) >= self.max_entries:
            raise SignatureError("nonce_cache_full", "too many signed messages in the window; retry later")
        self._expiry[entry] = expires_at_s
        heapq.heappush(self._heap, (expires_at_s, entry))


def open_envelope(
    envelope: Any,
    *,
    kind: str,
    now_s: float,
    skew_s: float,
    nonces: NonceSink,
    signer_field: str = "node_id",
    max_payload_bytes: int = 1 << 20,
) -> dict[str, Any]:
    """Verify, then decode and check a signed message; return its payload.

    Order: signature, JSON shape, kind, signer id == public key, timestamp window,
    nonce (recorded last, so a refused message consumes nothing).
    """
    payload_bytes, pk = verify_envelope(envelope, max_payload_bytes=max_payload_bytes)
    try:
        payload = json.loads(payload_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise SignatureError("malformed_envelope", "payload is not UTF-8 JSON") from err
    if not isinstance(payload, dict):
        raise SignatureError("malformed_envelope", "payload must be a JSON object")
    if payload.get("kind") != kind:
        raise SignatureError("wrong_kind", f"expected a {kind!r} message, got {payload.get('kind')!r}")
    if payload.get(signer_field) != pk:
        raise SignatureError("key_mismatch", f"{signer_field} does not match the signing public key")
    ts = payload.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise SignatureError("malformed_envelope", "timestamp must be a number of seconds")
    if abs(now_s - ts) > skew_s:
        raise SignatureError(
            "stale_timestamp",
            f"timestamp is {now_s - ts:+.1f} s away from the receiver's clock (window {skew_s} s)",
        )
    nonce = payload.get("nonce")
    if not isinstance(nonce, str) or not _NONCE_RE.match(nonce):
        raise SignatureError("malformed_envelope", "nonce must be 16-64 characters of [0-9A-Za-z_-]")
    nonces.check_and_add(pk, nonce, float(ts) + skew_s, now_s)
    return payload


# --- route tickets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TicketHop:
    node_id: str
    start: int
    end: int
    address: str
    # sha256 of the node's gRPC TLS certificate as it announced it, so the pin a gateway dials is under
    # the tracker's signature. "" (a node serving plaintext, or a ticket from a tracker older than this
    # field): the key is left out of the signed hop, so such tickets are byte-for-byte what they were.
    tls_fingerprint: str = ""


@dataclass(frozen=True)
class RouteTicket:
    tracker_id: str
    session_id: str
    model_fingerprint: str
    hops: tuple[TicketHop, ...]
    issued_at_s: float
    expires_at_s: float
    # The gateway the ticket was issued to (its public key, hex): a node then opens a session with it
    # only on an OPEN that carries that gateway's signed proof (:func:`verify_open_proof`). Empty: a
    # bearer ticket (a tracker with no registered gateways answering an unsigned request).
    gateway_id: str = ""


def sign_route_ticket(key: nacl.signing.SigningKey, ticket: RouteTicket) -> dict[str, str]:
    payload: dict[str, Any] = {
        "kind": "route_ticket",
        "tracker_id": public_key_hex(key),
        "session_id": ticket.session_id,
        "model_fingerprint": ticket.model_fingerprint,
        "hops": [_ticket_hop_json(h) for h in ticket.hops],
        "timestamp": ticket.issued_at_s,
        "expires_at": ticket.expires_at_s,
        "nonce": new_nonce(),
    }
    if ticket.gateway_id:  # absent on bearer tickets, so their bytes are what they always were
        payload["gateway_id"] = ticket.gateway_id
    return sign_envelope(key, payload)


def _ticket_hop_json(hop: TicketHop) -> dict[str, Any]:
    out: dict[str, Any] = {"node_id": hop.node_id, "start": hop.start, "end": hop.end, "address": hop.address}
    if hop.tls_fingerprint:  # absent for plaintext nodes: older nodes and gateways parse what they always did
        out["tls_fingerprint"] = hop.tls_fingerprint
    return out


def _ticket_hop(h: Mapping[str, Any]) -> TicketHop:
    pin = h.get("tls_fingerprint", "")
    if not isinstance(pin, str) or (pin and not _HEX64_RE.match(pin)):
        raise SignatureError("malformed_envelope", "route ticket hop tls_fingerprint is not 64 lowercase hex")
    return TicketHop(str(h["node_id"]), int(h["start"]), int(h["end"]), str(h["address"]), pin)


def route_ticket_bytes(envelope: Mapping[str, Any]) -> bytes:
    """How a ticket travels in ``OpenSession.route_ticket``: the envelope's canonical JSON bytes."""
    return canonical_json(dict(envelope))


def route_ticket_envelope(data: bytes) -> Any:
    """The envelope back from ``OpenSession.route_ticket`` bytes (not verified yet)."""
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise SignatureError("malformed_envelope", "route ticket is not a JSON envelope") from err


def verify_route_ticket(
    envelope: Any,
    *,
    tracker_public_key: str,
    now_s: float,
    node_id: str | None = None,
    model_fingerprint: str | None = None,
    leeway_s: float = 5.0,
) -> RouteTicket:
    """What a node calls before spending memory on a session (and a gateway before it dials a route:
    gateway/route_tickets.py compares the hops, with their TLS pins, to the route's).

    Checks the tracker's signature and key, the expiry (with ``leeway_s`` for
    clock differences) and, when given, that ``node_id`` is a hop of the route and
    the model matches. Tickets are bearer tokens for their lifetime: a node may
    see the same one again when a gateway reconnects, so no nonce check here.
    """
    payload_bytes, pk = verify_envelope(envelope)
    if pk != tracker_public_key:
        raise SignatureError("untrusted_key", "route ticket not signed by the trusted tracker key")
    try:
        p = json.loads(payload_bytes.decode("utf-8"))
        if p.get("kind") != "route_ticket":
            raise SignatureError("wrong_kind", "not a route ticket")
        hops = tuple(_ticket_hop(h) for h in p["hops"])
        ticket = RouteTicket(
            tracker_id=str(p["tracker_id"]),
            session_id=str(p["session_id"]),
            model_fingerprint=str(p["model_fingerprint"]),
            hops=hops,
            issued_at_s=float(p["timestamp"]),
            expires_at_s=float(p["expires_at"]),
            gateway_id=str(p.get("gateway_id", "")),
        )
        if ticket.gateway_id and not _HEX64_RE.match(ticket.gateway_id):
            raise SignatureError("malformed_envelope", "route ticket gateway_id is not a public key")
    except SignatureError:
        raise
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise SignatureError("malformed_envelope", "route ticket payload is malformed") from err
    if ticket.tracker_id != pk:
        raise SignatureError("key_mismatch", "tracker_id does not match the signing key")
    if now_s > ticket.expires_at_s + leeway_s:
        raise SignatureError("expired", "route ticket has expired")
    if ticket.issued_at_s > now_s + leeway_s:
        raise SignatureError("stale_timestamp", "route ticket issued in the future")
    if model_fingerprint is not None and ticket.model_fingerprint != model_fingerprint:
        raise SignatureError("wrong_kind", "route ticket is for another model")
    if node_id is not None and all(h.node_id != node_id for h in ticket.hops):
        raise SignatureError("untrusted_key", "this node is not a hop of the route ticket")
    return ticket


# --- proofs of the gateway a ticket names ------------------------------------------------------

OPEN_PROOF_KIND = "open_proof"
OPEN_PROOF_SKEW_S = 60.0


def ticket_digest(ticket: bytes) -> str:
    """What an open proof names a ticket by: sha256 (hex) of the ``OpenSession.route_ticket`` bytes."""
    return hashlib.sha256(bytes(ticket)).hexdigest()


def sign_open_proof(
    key: nacl.signing.SigningKey,
    *,
    session_id: str,
    node_id: str,
    route_epoch: int,
    step_id: int,
    ticket: bytes,
    now_s: float,
) -> bytes:
    """A gateway's proof, for one OPEN to one node, that it holds the key its route ticket names.

    Signed per OPEN (fresh nonce and timestamp on every send, re-sends included), so a node can
    refuse a replayed proof outright. It travels as ``OpenSession.gateway_proof`` (JSON bytes).
    """
    body = {
        "session_id": session_id,
        "node_id": node_id,
        "route_epoch": int(route_epoch),
        "step_id": int(step_id),
        "ticket_sha256": ticket_digest(ticket),
    }
    envelope = sign_envelope(key, make_payload(OPEN_PROOF_KIND, "gateway_id", key, now_s, body))
    return canonical_json(envelope)


def verify_open_proof(
    proof: bytes,
    *,
    gateway_id: str,
    node_id: str,
    session_id: str,
    route_epoch: int,
    step_id: int,
    ticket: bytes,
    now_s: float,
    nonces: NonceSink,
    skew_s: float = OPEN_PROOF_SKEW_S,
) -> None:
    """What a node checks before it opens (or re-attaches) a session on a ticket that names a gateway.

    The proof must be signed by exactly ``gateway_id`` (the ticket's), be recent (``skew_s``), name
    this node, this OPEN's session, epoch and step id and this very ticket, and carry a nonce the
    node has not seen (``nonces``). Raises :class:`SignatureError`.
    """
    if not proof:
        raise SignatureError(
            "missing_proof", "the ticket names a gateway; the OPEN carries no proof from that gateway"
        )
    try:
        envelope = json.loads(bytes(proof).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise SignatureError("malformed_envelope", "gateway proof is not a JSON envelope") from err
    if isinstance(envelope, Mapping) and envelope.get("public_key") != gateway_id:
        raise SignatureError("untrusted_key", "gateway proof not signed by the gateway the ticket names")
    payload = open_envelope(
        envelope,
        kind=OPEN_PROOF_KIND,
        now_s=now_s,
        skew_s=skew_s,
        nonces=_Deferred(),
        signer_field="gateway_id",
        max_payload_bytes=4096,
    )
    expected = {
        "session_id": session_id,
        "node_id": node_id,
        "route_epoch": int(route_epoch),
        "step_id": int(step_id),
        "ticket_sha256": ticket_digest(ticket),
    }
    for name, value in expected.items():
        if payload.get(name) != value:
            raise SignatureError("proof_mismatch", f"gateway proof is for another {name.replace('_', ' ')}")
    # Recorded last, so a proof refused for another reason consumes nothing.
    nonces.check_and_add(gateway_id, str(payload["nonce"]), float(payload["timestamp"]) + skew_s, now_s)


class _Deferred:
    """A nonce sink that records nothing (the caller records the nonce once every check passed)."""

    def check_and_add(self, public_key: str, nonce: str, expires_at_s: float, now_s: float) -> None:
        return None
