"""Join challenges of relayed nodes, carried by the gateway that relays them.

A relayed node accepts no connections: the tracker cannot dial it. The gateway
it holds its WebSocket to can, so that gateway carries the tracker's challenge:

* ``POST /v1/relay/challenges`` (signed by the gateway, kind
  ``relay_challenge_poll``): ``{"gateway_id", "nodes": [{"node_id", "info"}]}``,
  the nodes connected to its relay with the ``NodeInfo`` each signed in its
  relay hello (base64). The answer, ``{"orders": [...]}``, holds for each of
  them that waits for its challenge and announced itself relayed through this
  gateway the challenge session's frames, written and signed by the tracker:
  ``{"node_id", "input_id", "frames": [b64 Frame], "release": b64 Frame,
  "max_replies", "timeout_s"}``.
* ``POST /v1/relay/challenge-results`` (kind ``relay_challenge_result``):
  ``{"gateway_id", "node_id", "info", "input_id", "replies": [b64 Frame],
  "error"}``: every frame the node answered, as received. The tracker judges
  them as it judges a challenge it dials (``tracker/challenger.py``): the
  digest of the rows, compared with trusted nodes' answers of the same input.

The gateway carries bytes and judges nothing; the node cannot tell this
challenge from a dialled one, and cannot report its own result. Only a
registered gateway may carry challenges (any gateway where the operator
registered none, as for every gateway report), and only for nodes that
announced themselves relayed through it. ``error`` (the node did not answer)
leaves the node ``challenging``: out of routing until a later round answers.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

from tracker.errors import BadRequest, NotFound

if TYPE_CHECKING:
    from tracker.service import Registry

MAX_POLL_NODES = 16  # nodes per poll (a gateway with more asks again next round)
MAX_REPLIES = 300  # frames per result (at most challenge_tokens + 1 are judged)


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as err:
        raise BadRequest(f"{what} is not base64") from err


def _node_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != 64:
        raise BadRequest(f"{what} must be a node id (64 hex)")
    try:
        bytes.fromhex(value)
    except ValueError as err:
        raise BadRequest(f"{what} must be a node id (64 hex)") from err
    return value


def _challenger(registry: Registry) -> Any:
    if registry.challenger is None or not registry.config.challenge_nodes:
        raise NotFound("this tracker does not challenge nodes")
    return registry.challenger


async def poll(registry: Registry, envelope: Any) -> dict[str, Any]:
    """``POST /v1/relay/challenges``: the challenges this gateway is to carry now."""
    challenger = _challenger(registry)
    payload, _nonce = registry.gate.open_envelope(envelope, "relay_challenge_poll", signer_field="gateway_id")
    gateway_id = str(payload["gateway_id"])
    nodes = payload.get("nodes")
    if not isinstance(nodes, list) or len(nodes) > MAX_POLL_NODES:
        raise BadRequest(f"nodes must be a list of at most {MAX_POLL_NODES}")
    infos: dict[str, bytes] = {}
    for i, entry in enumerate(nodes):
        if not isinstance(entry, dict):
            raise BadRequest(f"nodes[{i}] must be an object")
        infos[_node_id(entry.get("node_id"), f"nodes[{i}].node_id")] = _b64(
            entry.get("info"), f"nodes[{i}].info"
        )
    registry.trust.require_gateway(gateway_id, "relay_challenge_poll")
    return {"orders": await challenger.relay_orders(gateway_id, infos)}


async def result(registry: Registry, envelope: Any) -> dict[str, Any]:
    """``POST /v1/relay/challenge-results``: judge what a relayed node answered."""
    challenger = _challenger(registry)
    payload, _nonce = registry.gate.open_envelope(
        envelope,
        "relay_challenge_result",
        signer_field="gateway_id",
        max_payload_bytes=registry.config.registry_max_body_bytes,
    )
    gateway_id = str(payload["gateway_id"])
    node_id = _node_id(payload.get("node_id"), "node_id")
    info = _b64(payload.get("info"), "info")
    input_id = payload.get("input_id")
    error = payload.get("error", "")
    replies = payload.get("replies")
    if not isinstance(input_id, str) or not isinstance(error, str):
        raise BadRequest("input_id and error must be strings")
    if not isinstance(replies, list) or len(replies) > MAX_REPLIES:
        raise BadRequest(f"replies must be a list of at most {MAX_REPLIES}")
    frames = [_b64(r, f"replies[{i}]") for i, r in enumerate(replies)]
    registry.trust.require_gateway(gateway_id, "relay_challenge_result")
    outcome = await challenger.relay_result(gateway_id, node_id, info, input_id, frames, error)
    return {
        "node_id": node_id,
        "outcome": outcome.outcome,
        "routable": outcome.routable,
        "detail": outcome.detail,
    }
