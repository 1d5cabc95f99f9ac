"""Route-ticket checks for OPEN (pure: pynacl via proto.signing, an injected clock).

``OpenSession.route_ticket`` carries the tracker's signed envelope (the
``ticket`` object of a ``/v1/routes`` answer) as JSON bytes
(``proto.signing.route_ticket_bytes``; any JSON encoding of the same object is
accepted, the signature covers the payload inside). A node accepts a ticket only if

* it is signed by the tracker key the node trusts (pinned in the config, or
  learned from the tracker's announce answer over the configured URL),
* it has not expired (``proto.signing.verify_route_ticket``, 5 s leeway),
* it is for this node's model and lists this node as a hop,
* that hop is exactly this node's shard,
* and, when the ticket names a gateway (``gateway_id``: the tracker issued it
  to a gateway that signed its route request), the OPEN carries that gateway's
  proof (``OpenSession.gateway_proof``, ``proto.signing.verify_open_proof``):
  signed by the named key, for this node, this session, this OPEN's epoch and
  step id and this very ticket, at most ``proof_skew_s`` old, with a nonce not
  seen before. So a ticket copied by anyone else -- another stage of the route,
  an observer -- opens nothing, and neither does a replayed OPEN.

A ticket that names no gateway is a bearer token for its lifetime (a tracker
with no registered gateways answering an unsigned request; docs/tracker.md),
so no nonce is remembered for tickets themselves. Proof nonces are kept in a
bounded :class:`proto.signing.NonceCache` until their window has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from node.session_machine import OpenClaim
from proto.errors import TicketInvalidError
from proto.signing import (
    OPEN_PROOF_SKEW_S,
    NonceCache,
    SignatureError,
    route_ticket_envelope,
    verify_open_proof,
    verify_route_ticket,
)


class TicketVerifier:
    """Callable ``(ticket_bytes, session_id, claim) -> None`` that raises :class:`TicketInvalidError`."""

    def __init__(
        self,
        *,
        node_id: str,
        model_fingerprint: str,
        shard: tuple[int, int],
        tracker_public_key: str | None,
        clock: Callable[[], float] = time.time,
        insecure_accept_all: bool = False,
        proof_skew_s: float = OPEN_PROOF_SKEW_S,
        max_proof_nonces: int = 100_000,
    ) -> None:
        self.node_id = node_id
        self.model_fingerprint = model_fingerprint
        self.shard = shard
        self.tracker_public_key = tracker_public_key
        self.clock = clock
        self.insecure_accept_all = insecure_accept_all
        self.proof_skew_s = proof_skew_s
        self.proof_nonces = NonceCache(max_proof_nonces)
        self.accepted = 0
        self.refused = 0
        self.bound = 0  # accepted tickets that named a gateway (and came with its proof)

    def trust(self, tracker_public_key: str) -> None:
        """Learn the tracker key (from its announce answer) when none was pinned."""
        if self.tracker_public_key is None:
            self.tracker_public_key = tracker_public_key

    def __call__(self, ticket: bytes, session_id: str, claim: OpenClaim) -> None:
        if self.insecure_accept_all:
            self.accepted += 1
            return
        try:
            self._check(ticket, session_id, claim)
        except TicketInvalidError:
            self.refused += 1
            raise
        self.accepted += 1

    def _check(self, ticket: bytes, session_id: str, claim: OpenClaim) -> None:
        if self.tracker_public_key is None:
            raise TicketInvalidError("this node does not know its tracker's key yet (not announced)")
        now = self.clock()
        try:
            parsed = verify_route_ticket(
                route_ticket_envelope(ticket),
                tracker_public_key=self.tracker_public_key,
                now_s=now,
                node_id=self.node_id,
                model_fingerprint=self.model_fingerprint,
            )
        except SignatureError as err:
            raise TicketInvalidError(f"route ticket refused ({err.reason}): {err.message}") from err
        hops = [h for h in parsed.hops if h.node_id == self.node_id]
        if all((h.start, h.end) != self.shard for h in hops):
            raise TicketInvalidError(
                f"route ticket names this node for layers {[(h.start, h.end) for h in hops]}, "
                f"it serves {list(self.shard)}"
            )
        if not parsed.gateway_id:
            return  # a bearer ticket (an open tracker, an unsigned route request)
        try:
            verify_open_proof(
                claim.gateway_proof,
                gateway_id=parsed.gateway_id,
                node_id=self.node_id,
                session_id=session_id,
                route_epoch=claim.route_epoch,
                step_id=claim.step_id,
                ticket=ticket,
                now_s=now,
                nonces=self.proof_nonces,
                skew_s=self.proof_skew_s,
            )
        except SignatureError as err:
            raise TicketInvalidError(
                f"route ticket is bound to gateway {parsed.gateway_id[:16]}; its proof was refused "
                f"({err.reason}): {err.message}"
            ) from err
        self.bound += 1
