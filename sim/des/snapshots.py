"""Builds the tracker's :class:`~tracker.snapshot.SwarmSnapshot` from simulated nodes, cheaply.

A real tracker sees membership at once (announcements) and load only at
heartbeats. So does this cache:

* every node has one immutable :class:`ShardView`; it is re-made only when
  that node's load is refreshed (``refresh_load``, called once per heartbeat
  interval) -- never per request;
* membership changes (join, leave, start serving) only mark the snapshot
  stale; the tuple of views is rebuilt lazily, once, the next time someone
  asks, which is an O(n) copy of pointers;
* two snapshots exist: *routable* (nodes that serve now) for route
  selection, and *placed* (also nodes still loading their shard) for
  placement, so joiners that arrive together do not all pick the same gap.

Latency, with network coordinates (``coordinates`` given: routing "tracker"):
each view carries the node's coordinate as the simulated tracker has it
(:mod:`sim.des.coords`) and its uplink (as announced), and
``default_latency_ms`` (the price of a hop to a node without a coordinate) is
the tracker's: the larger of the configured default and the 75th percentile of
predicted one-way latencies, recomputed at each load refresh.

Without (routing "blind", the tracker before coordinates): the snapshot's
``latency_ms`` is keyed by node pairs, which cannot scale to thousands of nodes
(n^2 entries). The cache fills it only for small swarms
(``max_latency_pairs_nodes``) with the real single-gateway star cost of a hop
``a -> b`` (``a -> gateway -> b``); larger swarms get the swarm's median one-way
latency as ``default_latency_ms``.
"""

from __future__ import annotations

import numpy as np

from sim.des.coords import SimCoordinates
from sim.des.node import LOADING, SERVING, SimNode
from tracker.coordinates import UNTRUSTED_ERROR, typical_one_way_ms
from tracker.placement import provide_spans
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot


class SnapshotCache:
    def __init__(
        self,
        models: tuple[ModelInfo, ...],
        default_latency_ms: float,
        single_gateway: bool,
        max_latency_pairs_nodes: int = 150,
        coordinates: SimCoordinates | None = None,
    ) -> None:
        self.models = models
        self._coords = coordinates
        self._base_default_ms = default_latency_ms
        self.default_latency_ms = default_latency_ms
        self._single_gateway = single_gateway
        self._max_pairs_nodes = max_latency_pairs_nodes
        self._nodes: dict[str, SimNode] = {}  # serving or loading
        self._views: dict[str, ShardView] = {}  # latest view of every node ever seen (also draining, gone)
        self._fields: dict[str, dict[str, object]] = {}  # node id -> its view's fields (see _view)
        # The two snapshots' contents, kept current so a rebuild is a C-level tuple(dict.values()).
        self._placed_views: dict[str, ShardView] = {}  # loading or serving
        self._routable_views: dict[str, ShardView] = {}  # serving
        self._routable: SwarmSnapshot | None = None
        self._placed: SwarmSnapshot | None = None
        self.version = 0  # grows whenever the routable snapshot's content changes
        self.builds = 0  # how many times a snapshot tuple was actually rebuilt
        # The placed views' spans as columns, in the placed snapshot's order (a node that comes back
        # goes last, as in the dict; a gone one is masked out), so placement need not read 10 000
        # views at every join (tracker.placement.provide_spans).
        self._model_at = {m.fingerprint: i for i, m in enumerate(models)}
        self._col: dict[str, int] = {}
        self._cols = 0
        self._start = np.zeros(1024, dtype=np.intp)
        self._end = np.zeros(1024, dtype=np.intp)
        self._decode = np.zeros(1024)
        self._model = np.full(1024, -1, dtype=np.intp)  # -1: gone (or a model not in the list)

    # -- membership ---------------------------------------------------------
    def add(self, node: SimNode) -> None:
        nid = node.node_id
        self._nodes[nid] = node
        view = self._views[nid] = self._placed_views[nid] = self._view(node)
        self._placed_span(view)
        self._placed = None
        if node.state == SERVING:
            self._routable_views[nid] = view
            self._routable = None
            self.version += 1

    def started_serving(self, node: SimNode) -> None:
        nid = node.node_id
        self._views[nid] = self._placed_views[nid] = self._routable_views[nid] = view = self._view(node)
        self._placed_span(view)
        self._routable = None
        self._placed = None
        self.version += 1

    def remove(self, node: SimNode) -> None:
        """The node stops being routable (crash, or graceful leave begins)."""
        nid = node.node_id
        if self._nodes.pop(nid, None) is not None:
            self._placed_views.pop(nid, None)
            col = self._col.pop(nid, None)
            if col is not None:
                self._model[col] = -1
            self._routable_views.pop(nid, None)
            self._routable = None
            self._placed = None
            self.version += 1

    def refresh_load(self) -> None:
        """Heartbeat: every live node's load (and its latest coordinate) reaches the tracker."""
        nodes = self._nodes
        for nid in self._routable_views:
            self._views[nid] = self._placed_views[nid] = self._routable_views[nid] = view = self._view(
                nodes[nid]
            )
            self._placed_span(view)
        if self._coords is not None:
            placed = [
                c
                for v in self._routable_views.values()
                if (c := v.coord) is not None and c.error <= UNTRUSTED_ERROR
            ]
            self.default_latency_ms = max(self._base_default_ms, typical_one_way_ms(placed) or 0.0)
        self._routable = None
        self._placed = None
        self.version += 1

    # -- snapshots ------------------------------------------------------------
    def view(self, node_id: str) -> ShardView:
        return self._views[node_id]

    def routable(self) -> SwarmSnapshot:
        if self._routable is None:
            shards = tuple(self._routable_views.values())
            self._routable = SwarmSnapshot(
                models=self.models,
                shards=shards,
                latency_ms=self._latency_pairs(shards),
                default_latency_ms=self.default_latency_ms,
            )
            self.builds += 1
        return self._routable

    def placed(self) -> SwarmSnapshot:
        if self._placed is None:
            self._placed = snap = SwarmSnapshot(
                models=self.models,
                shards=tuple(self._placed_views.values()),
                default_latency_ms=self.default_latency_ms,
            )
            n = self._cols
            for i, m in enumerate(self.models):
                mine = self._model[:n] == i
                provide_spans(
                    snap,
                    m.fingerprint,
                    m.n_layers,
                    self._start[:n][mine],
                    self._end[:n][mine],
                    self._decode[:n][mine],
                )
            self.builds += 1
        return self._placed

    def _placed_span(self, view: ShardView) -> None:
        """Keep the columns in step with ``_placed_views`` (call after each assignment there)."""
        col = self._col.get(view.node_id)
        if col is None:
            col = self._col[view.node_id] = self._cols
            self._cols += 1
            if col >= len(self._model):
                grow = 2 * len(self._model)
                self._start = np.resize(self._start, grow)
                self._end = np.resize(self._end, grow)
                self._decode = np.resize(self._decode, grow)
                self._model = np.concatenate(
                    [self._model, np.full(grow - len(self._model), -1, dtype=np.intp)]
                )
        self._start[col] = view.start
        self._end[col] = view.end
        self._decode[col] = view.decode_ms_per_token
        self._model[col] = self._model_at.get(view.model_fingerprint, -1)

    def _latency_pairs(self, shards: tuple[ShardView, ...]) -> dict[tuple[str, str], float]:
        if self._coords is not None or not self._single_gateway or len(shards) > self._max_pairs_nodes:
            return {}
        to_gw = {s.node_id: self._nodes[s.node_id].gateway_latency_s[0] * 1000.0 for s in shards}
        return {(a, b): to_gw[a] + to_gw[b] for a in to_gw for b in to_gw if a != b}

    def _view(self, node: SimNode) -> ShardView:
        loading = node.state == LOADING
        active = 0 if loading else len(node.sessions)
        queued = 0 if loading else node.queue_depth
        coord = self._coords.coord(node.node_id) if self._coords is not None else None
        fields = self._fields.get(node.node_id)
        if fields is None:
            view = ShardView(
                node_id=node.node_id,
                model_fingerprint=node.model_fingerprint,
                start=node.start,
                end=node.end,
                decode_ms_per_token=node.single_token_ms,
                prefill_tokens_per_s=node.prefill_tokens_per_s,
                active_sessions=active,
                max_sessions=node.profile.max_sessions,
                queue_depth=queued,
                address=node.node_id,
                region=node.endpoint.region,
                coord=coord,
                uplink_mbit_s=node.profile.uplink_mbps if self._coords is not None else None,
            )
            self._fields[node.node_id] = dict(vars(view))
            return view
        # The same view as ShardView(...) above (only load and coordinate change between a node's
        # views), made by copying the node's fields: the generated __init__ of a frozen dataclass
        # sets its 25 fields one by one, and this runs for every node at every heartbeat.
        fields["active_sessions"] = active
        fields["queue_depth"] = queued
        fields["coord"] = coord
        view = _new_view(ShardView)
        view.__dict__.update(fields)
        return view


_new_view = object.__new__
