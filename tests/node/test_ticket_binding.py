"""Route tickets bound to a gateway (pure): the ticket names the gateway, the OPEN carries its proof.

A ticket copied by another stage of the route, an observer or a client with a
key of its own opens nothing; neither does a replayed OPEN, a proof for
another node, session, epoch or ticket, or a stale one. Bearer tickets (no
gateway named) keep working without a proof.
"""

from __future__ import annotations

import nacl.signing
import pytest

from node.session_machine import OpenClaim
from node.tickets import TicketVerifier
from proto.errors import TicketInvalidError
from proto.signing import (
    RouteTicket,
    SignatureError,
    TicketHop,
    canonical_json,
    public_key_hex,
    route_ticket_envelope,
    sign_open_proof,
    sign_route_ticket,
    verify_route_ticket,
)

NOW = 1_800_000_000.0
ME = "1" * 64
OTHER = "2" * 64
MODEL = "f" * 64
TRACKER = nacl.signing.SigningKey(b"\x01" * 32)
GATEWAY = nacl.signing.SigningKey(b"\x02" * 32)
INTRUDER = nacl.signing.SigningKey(b"\x03" * 32)


def ticket(gateway: str = public_key_hex(GATEWAY), key: nacl.signing.SigningKey = TRACKER) -> bytes:
    hops = (TicketHop(ME, 0, 15, "127.0.0.1:1"), TicketHop(OTHER, 15, 30, "127.0.0.1:2"))
    t = RouteTicket("x", "s" * 32, MODEL, hops, NOW, NOW + 300, gateway_id=gateway)
    return canonical_json(sign_route_ticket(key, t))


def proof(
    t: bytes,
    *,
    key: nacl.signing.SigningKey = GATEWAY,
    node: str = ME,
    sid: str = "sess",
    epoch: int = 1,
    step: int = 1,
    at: float = NOW,
) -> OpenClaim:
    data = sign_open_proof(
        key, session_id=sid, node_id=node, route_epoch=epoch, step_id=step, ticket=t, now_s=at
    )
    return OpenClaim(route_epoch=1, step_id=1, gateway_proof=data)


def verifier(now: list[float] | None = None) -> TicketVerifier:
    clock = now or [NOW]
    return TicketVerifier(
        node_id=ME,
        model_fingerprint=MODEL,
        shard=(0, 15),
        tracker_public_key=public_key_hex(TRACKER),
        clock=lambda: clock[0],
    )


def test_the_ticket_names_the_gateway_under_the_trackers_signature() -> None:
    parsed = verify_route_ticket(
        route_ticket_envelope(ticket()), tracker_public_key=public_key_hex(TRACKER), now_s=NOW
    )
    assert parsed.gateway_id == public_key_hex(GATEWAY)
    bearer = verify_route_ticket(
        route_ticket_envelope(ticket(gateway="")), tracker_public_key=public_key_hex(TRACKER), now_s=NOW
    )
    assert bearer.gateway_id == ""
    with pytest.raises(SignatureError, match="gateway_id"):
        verify_route_ticket(
            route_ticket_envelope(ticket(gateway="not-a-key")),
            tracker_public_key=public_key_hex(TRACKER),
            now_s=NOW,
        )


def test_a_bound_ticket_opens_with_its_gateways_proof_only() -> None:
    v = verifier()
    t = ticket()
    v(t, "sess", proof(t))
    assert v.accepted == 1 and v.bound == 1
    cases = {
        "missing_proof": OpenClaim(1, 1, b""),
        "untrusted_key": proof(t, key=INTRUDER),  # a client with a key of its own
        "proof_mismatch.*node": proof(t, node=OTHER),  # the proof another stage received
        "proof_mismatch.*session": proof(t, sid="other"),
        "proof_mismatch.*ticket": proof(ticket(gateway=public_key_hex(GATEWAY))),  # another ticket
        "stale_timestamp": proof(t, at=NOW - 120),
        "malformed_envelope": OpenClaim(1, 1, b"\xff{"),
    }
    for reason, claim in cases.items():
        with pytest.raises(TicketInvalidError, match=reason):
            v(t, "sess", claim)
    assert v.accepted == 1 and v.refused == len(cases)


def test_the_proof_covers_the_opens_epoch_and_step() -> None:
    v = verifier()
    t = ticket()
    reattach = proof(t, epoch=2, step=40)
    with pytest.raises(TicketInvalidError, match="route epoch"):
        v(t, "sess", OpenClaim(3, 40, reattach.gateway_proof))  # a proof for epoch 2 used for epoch 3
    with pytest.raises(TicketInvalidError, match="step id"):
        v(t, "sess", OpenClaim(2, 41, reattach.gateway_proof))
    v(t, "sess", OpenClaim(2, 40, reattach.gateway_proof))


def test_a_replayed_proof_is_refused_and_a_refused_one_consumes_nothing() -> None:
    v = verifier()
    t = ticket()
    claim = proof(t)
    with pytest.raises(TicketInvalidError, match="proof_mismatch"):
        v(t, "another-session", claim)  # refused: its nonce is not spent
    v(t, "sess", claim)
    with pytest.raises(TicketInvalidError, match="replayed_nonce"):
        v(t, "sess", claim)  # the same OPEN again (a copy taken off the wire)


def test_a_ticket_signed_by_another_tracker_naming_the_gateway_is_still_refused() -> None:
    t = ticket(key=INTRUDER)
    with pytest.raises(TicketInvalidError, match="untrusted_key"):
        verifier()(t, "sess", proof(t))


def test_bearer_tickets_need_no_proof() -> None:
    v = verifier()
    v(ticket(gateway=""), "sess", OpenClaim(1, 1, b""))
    assert v.accepted == 1 and v.bound == 0
