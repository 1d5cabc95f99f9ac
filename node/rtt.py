"""The node's round-trip sampler (``common.rtt``), wired to this node: what it pings and how.

Targets, in order: the nodes this node pushes hidden states to right now (its
push links' targets), then the peers the tracker's last heartbeat answer asked
for (``probe``: random live nodes, so coordinates span the swarm, and nodes
that measured this one, so every pair is checked from both sides). A ping is
one gRPC ``Health`` call through ``common.grpc_adapter`` (a few bytes each way;
the peer answers from memory). Samples go out with the next heartbeat
(``Heartbeat.rtt_samples``). Bounds: ``common.rtt.RttSettings``.
"""

from __future__ import annotations

from common.grpc_adapter import UNPINNED, Grpc
from common.rtt import RttSampler, RttSettings, Target
from node.push import PushLinks
from proto import codec

PING_MAX_MESSAGE_BYTES = 64 * 1024


def push_targets(pushes: PushLinks) -> list[Target]:
    """(node id, address) of the push links open now (read-only look at the links' targets)."""
    return [
        (link.target.node_id, link.target.address)
        for link in list(pushes._links.values())  # PushLinks offers no other view of its links
        if link.target.node_id and link.target.address
    ]


def _pin(pushes: PushLinks, address: str) -> str:
    """The TLS pin of a push target at ``address``; UNPINNED for a peer the tracker named (a ping
    carries nothing secret: TLS if the peer serves it, its certificate unchecked)."""
    for link in list(pushes._links.values()):
        if link.target.address == address and link.target.tls_fingerprint:
            return link.target.tls_fingerprint
    return UNPINNED


def node_sampler(grpc_rt: Grpc, pushes: PushLinks, node_id: str, settings: RttSettings) -> RttSampler:
    async def ping(address: str) -> bytes:
        return await grpc_rt.unary(
            address,
            codec.HEALTH_METHOD,
            b"",
            max_message_bytes=PING_MAX_MESSAGE_BYTES,
            pin=_pin(pushes, address),
        )

    return RttSampler(ping, lambda: push_targets(pushes), settings, own_id=node_id)
