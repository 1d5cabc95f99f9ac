"""Route-ticket checks for OPEN (pure: pynacl via proto.signing, an injected clock).

``OpenSession.route_ticket`` carries the tracker's signed envelope (the
``ticket`` object of a ``/v1/routes`` answer) as JSON bytes
(``proto.signing.route_ticket_bytes``; any JSON encoding of the same object is
accepted, the signature covers the payload inside). A node accepts a ticket only if

* it is signed by the tracker key the node trusts (pinned in the config, or
  learned from the tracker's announce answer over the configured URL),
* it has not expired (``proto.signing.verify_route_ticket``, 5 s leeway),
* it is for this node's model and lists this node as a hop,
* that hop is exactly this node's shard.

Tickets are bearer tokens for their lifetime (a gateway re-opening after a
broken stream reuses its ticket), so no nonce is remembered here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proto.errors import TicketInvalidError
from proto.signing import SignatureError, route_ticket_envelope, verify_route_ticket


class TicketVerifier:
    """Callable ``(ticket_bytes, session_id) -> None`` that raises :class:`TicketInvalidError`."""

    def __init__(
        self,
        *,
        node_id: str,
        model_fingerprint: str,
        shard: tuple[int, int],
        tracker_public_key: str | None,
        clock: Callable[[], float] = time.time,
        insecure_accept_all: bool = False,
    ) -> None:
        self.node_id = node_id
        self.model_fingerprint = model_fingerprint
        self.shard = shard
        self.tracker_public_key = tracker_public_key
        self.clock = clock
        self.insecure_accept_all = insecure_accept_all
        self.accepted = 0
        self.refused = 0

    def trust(self, tracker_public_key: str) -> None:
        """Learn the tracker key (from its announce answer) when none was pinned."""
        if self.tracker_public_key is None:
            self.tracker_public_key = tracker_public_key

    def __call__(self, ticket: bytes, session_id: str) -> None:
        if self.insecure_accept_all:
            self.accepted += 1
            return
        try:
            self._check(ticket)
        except TicketInvalidError:
            self.refused += 1
            raise
        self.accepted += 1

    def _check(self, ticket: bytes) -> None:
        if self.tracker_public_key is None:
            raise TicketInvalidError("this node does not know its tracker's key yet (not announced)")
        try:
            parsed = verify_route_ticket(
                route_ticket_envelope(ticket),
                tracker_public_key=self.tracker_public_key,
                now_s=self.clock(),
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
