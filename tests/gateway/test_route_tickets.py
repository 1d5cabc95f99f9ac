"""The gateway's check of route tickets: a route is dialled only as its tracker-signed ticket lists it."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import nacl.signing
import pytest
import trio

from gateway.config import ConfigError, GatewayConfig
from gateway.errors import NoRoute
from gateway.metrics import Metrics
from gateway.route_tickets import TicketRefused, verify_route
from gateway.routes import Hop, RouteCache
from gateway.tracker_key import LEARNED_FILE, TrackerKey, resolve_tracker_key
from node.session_machine import OpenClaim
from node.tickets import TicketVerifier
from proto.signing import (
    RouteTicket,
    TicketHop,
    canonical_json,
    public_key_hex,
    sign_open_proof,
    sign_route_ticket,
)

TRACKER = nacl.signing.SigningKey(bytes([1]) * 32)
OTHER = nacl.signing.SigningKey(bytes([2]) * 32)
GATEWAY = nacl.signing.SigningKey(bytes([3]) * 32)
TRACKER_ID, GATEWAY_ID = public_key_hex(TRACKER), public_key_hex(GATEWAY)
MODEL = "ab" * 32
NOW = 1_800_000_000.0
A, B = "a" * 64, "b" * 64
PIN_A, PIN_B, PIN_X = "1a" * 32, "2b" * 32, "ee" * 32


def _hops() -> tuple[Hop, ...]:
    return (
        Hop(A, 0, 15, "10.0.0.1:7000", tls_fingerprint=PIN_A),
        Hop(B, 15, 30, "10.0.0.2:7000", tls_fingerprint=PIN_B),
    )


def _ticket(hops: tuple[Hop, ...], *, key: nacl.signing.SigningKey = TRACKER, ttl_s: float = 300.0) -> bytes:
    signed = tuple(TicketHop(h.node_id, h.start, h.end, h.address, h.tls_fingerprint) for h in hops)
    ticket = RouteTicket(
        public_key_hex(key), "s" * 32, MODEL, signed, NOW, NOW + ttl_s, gateway_id=GATEWAY_ID
    )
    return canonical_json(sign_route_ticket(key, ticket))


def _refusal(
    ticket: bytes, hops: tuple[Hop, ...], *, now_s: float = NOW, tracker_id: str = TRACKER_ID
) -> str:
    with pytest.raises(TicketRefused) as err:
        verify_route(
            ticket, hops, model_fingerprint=MODEL, tracker_id=tracker_id, gateway_id=GATEWAY_ID, now_s=now_s
        )
    return err.value.reason


def test_a_ticket_that_lists_the_routes_hops_and_pins_verifies() -> None:
    hops = _hops()
    parsed = verify_route(
        _ticket(hops), hops, model_fingerprint=MODEL, tracker_id=TRACKER_ID, gateway_id=GATEWAY_ID, now_s=NOW
    )
    assert [h.tls_fingerprint for h in parsed.hops] == [PIN_A, PIN_B]


def test_a_tampered_fingerprint_or_address_in_the_answer_is_refused() -> None:
    hops = _hops()
    ticket = _ticket(hops)
    swapped_pin = (dataclasses.replace(hops[0], tls_fingerprint=PIN_X), hops[1])
    assert _refusal(ticket, swapped_pin) == "hops_mismatch"
    swapped_address = (hops[0], dataclasses.replace(hops[1], address="203.0.113.9:7000"))
    assert _refusal(ticket, swapped_address) == "hops_mismatch"
    both = (dataclasses.replace(hops[0], address="203.0.113.9:7000", tls_fingerprint=PIN_X), hops[1])
    assert _refusal(ticket, both) == "hops_mismatch"
    assert _refusal(ticket, (dataclasses.replace(hops[0], end=14), hops[1])) == "hops_mismatch"
    assert _refusal(ticket, hops[:1]) == "hops_mismatch"
    assert _refusal(ticket, (dataclasses.replace(hops[0], tls_fingerprint=""), hops[1])) == "hops_mismatch"


def test_a_ticket_signed_by_another_key_or_expired_or_altered_is_refused() -> None:
    hops = _hops()
    assert _refusal(_ticket(hops, key=OTHER), hops) == "untrusted_key"
    assert _refusal(_ticket(hops), hops, tracker_id=public_key_hex(OTHER)) == "untrusted_key"
    assert _refusal(_ticket(hops, ttl_s=60.0), hops, now_s=NOW + 66.0) == "expired"
    ticket = _ticket(hops, ttl_s=60.0)  # within the clock leeway: still good
    verify_route(
        ticket, hops, model_fingerprint=MODEL, tracker_id=TRACKER_ID, gateway_id=GATEWAY_ID, now_s=NOW + 64.0
    )
    # the pin rewritten inside the signed payload: the signature no longer holds
    forged = ticket.replace(b'"payload":"', b'"payload":"A', 1)
    assert _refusal(forged, hops) in ("bad_signature", "malformed_envelope")
    assert _refusal(b"not json", hops) == "malformed_envelope"


def test_a_ticket_for_another_model_or_gateway_is_refused() -> None:
    hops = _hops()
    with pytest.raises(TicketRefused) as err:
        verify_route(
            _ticket(hops),
            hops,
            model_fingerprint="cd" * 32,
            tracker_id=TRACKER_ID,
            gateway_id=GATEWAY_ID,
            now_s=NOW,
        )
    assert err.value.reason == "wrong_model"
    with pytest.raises(TicketRefused) as err:
        verify_route(
            _ticket(hops),
            hops,
            model_fingerprint=MODEL,
            tracker_id=TRACKER_ID,
            gateway_id="c" * 64,
            now_s=NOW,
        )
    assert err.value.reason == "other_gateway"


def test_tickets_without_pins_keep_their_old_bytes_and_nodes_accept_tickets_with_pins() -> None:
    plain = TicketHop(A, 0, 30, "10.0.0.1:7000")
    payload = sign_route_ticket(TRACKER, RouteTicket(TRACKER_ID, "s" * 32, MODEL, (plain,), NOW, NOW + 60))
    assert b"tls_fingerprint" not in base64.b64decode(payload["payload"])
    # A node checks a ticket that carries pins as before (its parser takes the new key).
    pinned = (Hop(A, 0, 30, "10.0.0.1:7000", tls_fingerprint=PIN_A),)
    ticket = _ticket(pinned)
    verifier = TicketVerifier(
        node_id=A, model_fingerprint=MODEL, shard=(0, 30), tracker_public_key=TRACKER_ID, clock=lambda: NOW
    )
    proof = sign_open_proof(
        GATEWAY, session_id="s" * 32, node_id=A, route_epoch=1, step_id=1, ticket=ticket, now_s=NOW
    )
    verifier(ticket, "s" * 32, OpenClaim(route_epoch=1, step_id=1, gateway_proof=proof))
    assert verifier.accepted == 1


# ------------------------------------------------------------------- the route cache drops bad routes


class _Tracker:
    key_id = GATEWAY_ID

    def __init__(self, answer: dict, tracker_id: str = TRACKER_ID) -> None:
        self.answer = answer
        self.tracker_id = tracker_id
        self.healthz_calls = 0

    async def routes(self, model: str, **_: object) -> dict:
        return self.answer

    async def healthz(self) -> dict:
        self.healthz_calls += 1
        return {"status": "ok", "tracker_id": self.tracker_id}


def _route_json(hops: tuple[Hop, ...], ticket: bytes) -> dict:
    return {
        "hops": [
            {
                "node_id": h.node_id,
                "start": h.start,
                "end": h.end,
                "address": h.address,
                "tls_fingerprint": h.tls_fingerprint,
            }
            for h in hops
        ],
        "ticket": json.loads(ticket),
        "expires_at": NOW + 10_000,  # unsigned: the cache keeps the ticket's expiry instead
        "expected_ms_per_token": 5,
    }


def _answer(*routes: dict) -> dict:
    return {"model": {"fingerprint": MODEL, "name": "m", "n_layers": 30}, "routes": list(routes)}


def _cache(tracker: _Tracker, key: TrackerKey, metrics: Metrics) -> RouteCache:
    return RouteCache(
        tracker,  # type: ignore[arg-type]
        k=2,
        ttl_s=10,
        tracker_timeout_s=5,
        metrics=metrics,
        tracker_key=key,
        clock=lambda: NOW,
    )


def test_the_cache_drops_a_tampered_route_keeps_the_good_one_and_503s_when_none_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = _hops()
    other = (Hop("c" * 64, 0, 30, "10.0.0.3:7000", tls_fingerprint=PIN_B),)
    tampered = (dataclasses.replace(other[0], address="203.0.113.9:7000", tls_fingerprint=PIN_X),)
    metrics = Metrics()
    tracker = _Tracker(_answer(_route_json(tampered, _ticket(other)), _route_json(good, _ticket(good))))
    cache = _cache(tracker, TrackerKey(TRACKER_ID), metrics)

    async def main() -> None:
        got = await cache.routes("m")
        assert [r.hops for r in got.routes] == [good]
        assert got.routes[0].expires_at_s == NOW + 300.0  # the signed expiry, not the answer's
        tracker.answer = _answer(_route_json(tampered, _ticket(other)))
        cache.invalidate("m")
        with pytest.raises(NoRoute, match="valid ticket"):
            await cache.routes("m")

    with caplog.at_level("WARNING", logger="swarm.gateway"):
        trio.run(main)
    refused = [r for r in caplog.records if r.getMessage() == "route_ticket_refused"]
    assert len(refused) == 2  # one line per dropped route
    text = metrics.render({})
    assert 'swarm_gateway_route_tickets_refused_total{reason="hops_mismatch"} 2.0' in text
    assert 'swarm_gateway_tracker_route_requests_total{outcome="refused"} 1.0' in text
    assert tracker.healthz_calls == 0  # a pinned key is never asked of the tracker


def test_trust_on_first_use_learns_the_key_once_and_keeps_it(tmp_path: Path) -> None:
    good = _hops()
    tracker = _Tracker(_answer(_route_json(good, _ticket(good))))
    learned = tmp_path / LEARNED_FILE
    cache = _cache(tracker, TrackerKey(learn_into=learned), Metrics())

    async def main() -> None:
        assert len((await cache.routes("m")).routes) == 1
        cache.invalidate("m")
        await cache.routes("m")

    trio.run(main)
    assert tracker.healthz_calls == 1
    assert learned.read_text().strip() == TRACKER_ID
    # The next start pins what was learned, and the config's tracker_id wins over it.
    config = GatewayConfig(data_dir=str(tmp_path))
    assert trio.run(resolve_tracker_key, config).known == TRACKER_ID
    pinned = dataclasses.replace(config, tracker_id=public_key_hex(OTHER))
    assert trio.run(resolve_tracker_key, pinned).known == public_key_hex(OTHER)


def test_without_a_tracker_key_or_permission_to_learn_it_the_gateway_does_not_start(tmp_path: Path) -> None:
    config = GatewayConfig(data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="tracker_id is not set"):
        trio.run(resolve_tracker_key, config)
    allowed = dataclasses.replace(config, trust_tracker_on_first_use=True)
    assert trio.run(resolve_tracker_key, allowed).known == ""
    with pytest.raises(ConfigError, match="64 lowercase hex"):
        dataclasses.replace(config, tracker_id="XYZ").validate()
