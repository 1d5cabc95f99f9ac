"""proto.signing: envelopes, refusals, nonce cache, route tickets (pure)."""

from __future__ import annotations

import base64
import json

import pytest
from tracker_helpers import key

from proto.signing import (
    NonceCache,
    RouteTicket,
    SignatureError,
    TicketHop,
    canonical_json,
    make_payload,
    open_envelope,
    public_key_hex,
    sign_envelope,
    sign_route_ticket,
    verify_route_ticket,
)

NOW = 1_800_000_000.0


def open_(env: dict, nonces: NonceCache, now: float = NOW, kind: str = "heartbeat") -> dict:
    return open_envelope(env, kind=kind, now_s=now, skew_s=30.0, nonces=nonces)


def reason(fn, *args, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SignatureError) as info:
        fn(*args, **kw)
    return info.value.reason


def test_roundtrip_and_canonical_bytes() -> None:
    k = key(1)
    env = sign_envelope(k, make_payload("heartbeat", "node_id", k, NOW, {"b": 1, "a": "é"}))
    assert set(env) == {"payload", "signature", "public_key"}
    raw = base64.b64decode(env["payload"])
    assert raw == canonical_json(json.loads(raw))
    payload = open_(env, NonceCache())
    assert payload["node_id"] == public_key_hex(k) and payload["a"] == "é"


def test_refusals() -> None:
    k, other = key(1), key(2)
    nonces = NonceCache()
    good = sign_envelope(k, make_payload("heartbeat", "node_id", k, NOW, {}))
    forged = dict(good, signature=sign_envelope(other, {"x": 1})["signature"])
    assert reason(open_, forged, nonces) == "bad_signature"
    tampered = dict(good, payload=base64.b64encode(base64.b64decode(good["payload"]) + b" ").decode())
    assert reason(open_, tampered, nonces) == "bad_signature"
    # Signed by `other` but claiming to be `k`.
    impostor = sign_envelope(
        other, {**make_payload("heartbeat", "node_id", other, NOW, {}), "node_id": public_key_hex(k)}
    )
    assert reason(open_, impostor, nonces) == "key_mismatch"
    assert reason(open_, good, nonces, now=NOW + 31) == "stale_timestamp"
    assert reason(open_, good, nonces, now=NOW - 31) == "stale_timestamp"
    assert reason(open_, good, nonces, kind="announce") == "wrong_kind"
    assert len(nonces) == 0  # nothing refused consumed a nonce
    open_(good, nonces)
    assert reason(open_, good, nonces) == "replayed_nonce"
    for bad in (
        None,
        [],
        {"payload": "x"},
        dict(good, public_key="zz"),
        dict(good, payload="***"),
        dict(good, extra=1),
    ):
        assert reason(open_, bad, nonces) == "malformed_envelope"


def test_nonce_cache_expires_and_is_bounded() -> None:
    cache = NonceCache(max_entries=2)
    cache.check_and_add("k", "n" * 16, expires_at_s=10.0, now_s=0.0)
    cache.check_and_add("k", "m" * 16, expires_at_s=20.0, now_s=0.0)
    with pytest.raises(SignatureError) as info:
        cache.check_and_add("k", "o" * 16, expires_at_s=20.0, now_s=5.0)
    assert info.value.reason == "nonce_cache_full"
    cache.check_and_add("k", "o" * 16, expires_at_s=30.0, now_s=11.0)  # the first one expired
    assert len(cache) == 2
    cache.check_and_add("k", "n" * 16, expires_at_s=40.0, now_s=25.0)  # reusable after expiry


def test_route_ticket_verify() -> None:
    tracker, node = key(9), key(3)
    hops = (TicketHop(public_key_hex(node), 0, 30, "127.0.0.1:1"),)
    ticket = RouteTicket(public_key_hex(tracker), "s1", "ab" * 32, hops, NOW, NOW + 60)
    env = sign_route_ticket(tracker, ticket)
    got = verify_route_ticket(
        env,
        tracker_public_key=public_key_hex(tracker),
        now_s=NOW + 1,
        node_id=public_key_hex(node),
        model_fingerprint="ab" * 32,
    )
    assert got == ticket
    tpk = public_key_hex(tracker)
    assert (
        reason(verify_route_ticket, env, tracker_public_key=public_key_hex(node), now_s=NOW)
        == "untrusted_key"
    )
    assert reason(verify_route_ticket, env, tracker_public_key=tpk, now_s=NOW + 100) == "expired"
    assert (
        reason(verify_route_ticket, env, tracker_public_key=tpk, now_s=NOW, node_id=public_key_hex(key(4)))
        == "untrusted_key"
    )
    assert (
        reason(verify_route_ticket, env, tracker_public_key=tpk, now_s=NOW, model_fingerprint="cd" * 32)
        == "wrong_kind"
    )
    forged = dict(env, signature=sign_route_ticket(node, ticket)["signature"])
    assert reason(verify_route_ticket, forged, tracker_public_key=tpk, now_s=NOW) == "bad_signature"
