"""What a gateway checks of a route before it dials anything on it (pure: proto.signing, no I/O, no clock).

A ``/v1/routes`` answer travels over plain HTTP unless the tracker sits behind
TLS, so everything in it except the tracker-signed ticket could have been
written by whoever is between the gateway and the tracker. A gateway therefore
uses a route only if its ticket

* is an envelope signed by the tracker key the gateway trusts (``tracker_id``
  of its config, or the key it learned on first use; docs/gateway.md),
* has not expired (the gateway's clock, with :data:`LEEWAY_S` for clocks that
  differ, as nodes allow),
* is for the model the answer names,
* names this gateway or no gateway (a ticket bound to another gateway opens
  nothing: nodes ask for that gateway's proof),
* and lists exactly the route's hops: the same nodes in the same order with the
  same spans, addresses and TLS certificate fingerprints.

The hops the gateway then dials, and the pins it checks certificates against
and passes to the stage before (``PushTarget.tls_fingerprint``), are the
ticket's: an answer whose unsigned hop list says anything else is refused as a
whole route (:class:`TicketRefused`), never patched. A ticket from a tracker
that signs no fingerprints (older than this check) lists none, so every TLS
hop of it differs and the route is refused: trackers are upgraded before
gateways.

Refusal reasons (``TicketRefused.reason``, the metric's label): those of
:class:`proto.signing.SignatureError` (``malformed_envelope``,
``bad_signature``, ``untrusted_key`` for a ticket signed by another key,
``key_mismatch``, ``expired``, ``stale_timestamp``, ``wrong_kind``), and
``wrong_model``, ``other_gateway``, ``hops_mismatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from proto.signing import RouteTicket, SignatureError, TicketHop, route_ticket_envelope, verify_route_ticket

LEEWAY_S = 5.0  # the same clock leeway nodes allow (proto.signing.verify_route_ticket)


class TicketRefused(ValueError):
    """A route whose ticket does not vouch for it; ``reason`` is a stable label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class RouteHop(Protocol):
    """What is compared of each hop (``gateway.routes.Hop`` has these and more)."""

    @property
    def node_id(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def tls_fingerprint(self) -> str: ...


def _fields(hop: RouteHop | TicketHop) -> tuple[str, int, int, str, str]:
    return (hop.node_id, hop.start, hop.end, hop.address, hop.tls_fingerprint)


_FIELD_NAMES = ("node_id", "start", "end", "address", "tls_fingerprint")


def verify_route(
    ticket: bytes,
    hops: Sequence[RouteHop],
    *,
    model_fingerprint: str,
    tracker_id: str,
    gateway_id: str,
    now_s: float,
) -> RouteTicket:
    """The verified ticket of a route whose answer listed ``hops``; raises :class:`TicketRefused`."""
    try:
        parsed = verify_route_ticket(
            route_ticket_envelope(ticket), tracker_public_key=tracker_id, now_s=now_s, leeway_s=LEEWAY_S
        )
    except SignatureError as err:
        raise TicketRefused(err.reason, f"route ticket refused: {err.message}") from err
    if parsed.model_fingerprint != model_fingerprint:
        raise TicketRefused("wrong_model", "the route ticket is for another model than the answer names")
    if parsed.gateway_id and parsed.gateway_id != gateway_id:
        raise TicketRefused(
            "other_gateway", f"the route ticket is bound to gateway {parsed.gateway_id[:16]}, not this one"
        )
    if len(parsed.hops) != len(hops):
        raise TicketRefused(
            "hops_mismatch", f"the answer lists {len(hops)} hops, the signed ticket {len(parsed.hops)}"
        )
    for i, (signed, answered) in enumerate(zip(parsed.hops, hops, strict=True)):
        for name, want, got in zip(_FIELD_NAMES, _fields(signed), _fields(answered), strict=True):
            if want != got:
                raise TicketRefused(
                    "hops_mismatch",
                    f"hop {i} ({signed.node_id[:8]}): the answer's {name} {got!r} is not the signed {want!r}",
                )
    return parsed
