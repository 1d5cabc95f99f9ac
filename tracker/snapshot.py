"""The immutable view of the swarm that route selection and placement read.

Pure data: no I/O, no clocks, no database. The tracker builds a
:class:`SwarmSnapshot` from its registry; the discrete-event simulator in
``sim/`` builds one from its simulated nodes. Both then call the same pure
functions (``tracker.routing.select_routes`` and
``tracker.placement.recommend_span``).

Latency: a hop's one-way latency is ``latency_ms[(a, b)]`` when given, else
half the RTT predicted by the two nodes' network coordinates, else
``default_latency_ms``; bandwidth: each node's announced uplink.

Layer ranges are half-open: a shard ``[start, end)`` holds blocks
``start .. end-1``; a model has layers ``0 .. n_layers-1`` and a route tiles
boundaries ``0 = b0 < b1 < ... < bk = n_layers`` with one shard per hop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tracker.coordinates import NetCoord


@dataclass(frozen=True)
class ModelInfo:
    fingerprint: str  # sha256 of the source GGUF, hex
    name: str
    n_layers: int
    n_embd: int
    architecture: str = "llama"
    # Layer boundaries a shard may start or end at (the model's published split points);
    # None: every boundary 0..n_layers. Some models can only be cut at some layers (or served whole).
    split_points: tuple[int, ...] | None = None
    # Bytes per layer and of the first/last stages' extras (token embeddings; LM head), known for a
    # model registered with its manifest (tracker/registry.py); None: unknown (capacity in layers only).
    layer_bytes: tuple[int, ...] | None = None
    first_extra_bytes: int = 0
    last_extra_bytes: int = 0

    def allows(self, start: int, end: int) -> bool:
        """True if ``[start, end)`` starts and ends at boundaries the model may be cut at."""
        if self.split_points is None:
            return True
        return start in self.split_points and end in self.split_points


@dataclass(frozen=True)
class ShardView:
    """One live shard served by one node."""

    node_id: str
    model_fingerprint: str
    start: int  # first layer, inclusive
    end: int  # last layer, exclusive
    # Measured on the node at start-up for this shard (whole shard, one token):
    decode_ms_per_token: float
    prefill_tokens_per_s: float
    # Live load from heartbeats:
    active_sessions: int = 0
    max_sessions: int = 1
    queue_depth: int = 0
    relayed: bool = False  # reached through a gateway's WebSocket relay
    address: str = ""  # host:port for direct gRPC, or relay id
    region: str = ""  # free-form locality hint for latency estimates
    # Free KV cache room reported by the last heartbeat (tokens); None = not reported.
    kv_free_tokens: int | None = None
    # The KV pool's size, the positions sessions hold now, and the most positions one session may hold
    # there, from the last heartbeat (None = not reported: an older node, or before its first one).
    kv_pool_tokens: int | None = None
    kv_used_tokens: int | None = None
    kv_session_max_tokens: int | None = None
    # Since the node started, from the last heartbeat (None = not reported): sessions preempted to make
    # room in its KV pool, and steps refused because the pool had no room (a gateway waits for KV).
    kv_preemptions: int | None = None
    kv_refusals: int | None = None
    # Heads of the KV block chains the node keeps, from its last heartbeat (common/prefix_chain.py).
    prefix_heads: tuple[str, ...] = ()
    # The node's network coordinate (tracker/coordinates.py); None = not measured yet.
    coord: NetCoord | None = None
    # The node's uplink (what it sends activations with), as announced; None = unknown.
    uplink_mbit_s: float | None = None
    # Not yet trusted: fewer spot checks passed than the tracker requires (routing adds a penalty).
    probation: bool = False
    # sha256 of the node's gRPC TLS certificate, as announced ("" = plaintext); diallers pin it.
    tls_fingerprint: str = ""
    # Earned trust: passed the join challenge against trusted nodes' answers, or passed
    # probation_checks spot checks (every node, where the tracker runs without probation). Only
    # trusted nodes move an unregistered model name (tracker/names.py).
    trusted: bool = False
    # The runtime recipe's fingerprint (proto/recipe.py: build, backend, KV type, attention) the
    # tracker's join challenge saw the node report; "" = not known (relayed, not challenged yet).
    # A route chains only shards of one recipe (unknown ones join any): tracker/recipes.py.
    recipe_fingerprint: str = ""
    # Listed in the operator's ``trusted_nodes``: trusted and off probation from its first announce
    # (gateways then need no checks of their own to count it trusted; evidence still bans it).
    operator_trusted: bool = False


@dataclass(frozen=True)
class SwarmSnapshot:
    models: tuple[ModelInfo, ...]
    shards: tuple[ShardView, ...]
    # Known one-way latency between two node ids (ms); pairs missing here are estimated from the
    # nodes' coordinates, or cost ``default_latency_ms`` when either has none (or an untrusted one).
    latency_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    default_latency_ms: float = 5.0
    relay_penalty_ms: float = 10.0
    # Network coordinates of the gateways (by gateway id) that reported RTT samples: a route for
    # a gateway is priced from where that gateway is (``select_routes(origin=...)``).
    gateway_coords: dict[str, NetCoord] = field(default_factory=dict)
    probation_penalty_ms: float = 0.0  # extra cost of a shard on probation
    # Model names an operator registered, and the one fingerprint each resolves to.
    registered_names: dict[str, str] = field(default_factory=dict)

    def model(self, fingerprint: str) -> ModelInfo | None:
        """The model with this fingerprint, or None."""
        for m in self.models:
            if m.fingerprint == fingerprint:
                return m
        return None

    @functools.cached_property
    def memo(self) -> dict[object, object]:
        """Scratch space for indexes derived from this snapshot (routing's per-model arrays): the
        snapshot never changes, so whatever is derived from it may be kept with it."""
        return {}

    @functools.cached_property
    def _by_boundary(self) -> _BoundaryIndex:
        index = _BoundaryIndex({}, {}, {}, {m.fingerprint: m.n_layers for m in self.models})
        for sh in self.shards:
            index.starting.setdefault((sh.model_fingerprint, sh.start), []).append(sh)
            index.ending.setdefault((sh.model_fingerprint, sh.end), []).append(sh)
            index.of_node.setdefault(sh.node_id, []).append(sh)
        return index

    def route_neighbours(self, node_id: str) -> list[ShardView]:
        """Shards a route may chain right after or before one of ``node_id``'s shards, the ring link
        (last stage to first) included: the links routing prices for this node. Built once per
        snapshot; O(neighbours) per call."""
        index = self._by_boundary
        out: list[ShardView] = []
        for sh in index.of_node.get(node_id, ()):
            fp = sh.model_fingerprint
            out += index.starting.get((fp, sh.end), ())
            out += index.ending.get((fp, sh.start), ())
            n_layers = index.n_layers.get(fp)
            if n_layers is not None and sh.end == n_layers and sh.start > 0:
                out += index.starting.get((fp, 0), ())
            if n_layers is not None and sh.start == 0 and sh.end < n_layers:
                out += index.ending.get((fp, n_layers), ())
        return [sh for sh in out if sh.node_id != node_id]


@dataclass(frozen=True)
class _BoundaryIndex:
    starting: dict[tuple[str, int], list[ShardView]]  # (model, first layer) -> shards
    ending: dict[tuple[str, int], list[ShardView]]  # (model, end layer) -> shards
    of_node: dict[str, list[ShardView]]
    n_layers: dict[str, int]
