"""Volunteers coming and going: joins with placement, churn, heartbeats, coverage.

A joining volunteer draws a model (``node_share``), a hardware profile and a
location, asks the placement policy for a span as long as its memory allows
(on the *placed* snapshot, which includes nodes still loading), loads the
shard (``download_mbps``; instant if 0), then serves. Its online time is
exponential with mean ``mean_uptime_s``; it then crashes (probability
``crash_fraction``) or leaves gracefully: it stops taking sessions at once,
finishes the ones it has for up to ``drain_timeout_s``, then goes.

Coverage counts, per model and layer, the shards that are serving now
(draining ones no longer count: no new session can use them).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from sim.des.config import Scenario
from sim.des.events import EventLoop
from sim.des.geography import Endpoint, Geography
from sim.des.hardware import PROFILES, HardwareProfile, capacity_layers, step_cost
from sim.des.node import DRAINING, GONE, LOADING, SERVING, SimNode, WorkItem
from sim.des.policies import Placement
from sim.des.snapshots import SnapshotCache
from tracker.rebalance import advise


class Swarm:
    def __init__(
        self,
        scenario: Scenario,
        fingerprints: list[str],
        loop: EventLoop,
        geography: Geography,
        gateways: list[Endpoint],
        placement: Placement,
        cache: SnapshotCache,
        rng_nodes: random.Random,
        rng_churn: random.Random,
        rng_rebalance: random.Random | None = None,
        demand: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.sc = scenario
        self.cfg = scenario.nodes
        self.fingerprints = fingerprints
        self.loop = loop
        self.geo = geography
        self.gateways = gateways
        self.placement = placement
        self.cache = cache
        self.rng = rng_nodes
        self.rng_churn = rng_churn
        self.rng_rebalance = rng_rebalance or random.Random(0)
        self.demand = demand  # model fingerprint -> current demand (rebalancing)
        self.moves = 0
        self._spawned = 0  # nodes made: joins and moves (node ids)
        self.nodes: dict[str, SimNode] = {}  # every node that ever joined
        self.coverage: list[list[int]] = [[0] * m.n_layers for m in scenario.models]
        self.serving = 0
        self.crashes = 0
        self.graceful_leaves = 0
        self.joins = 0
        self._profiles = [PROFILES[p.profile] for p in self.cfg.profiles]
        self._profile_w = [p.share for p in self.cfg.profiles]
        self._model_w = [m.node_share for m in scenario.models]
        self.on_stage_lost: Callable[[SimNode, float], None] = lambda node, detect_s: None
        self.on_output: Callable[[SimNode, WorkItem, float], None] = lambda node, item, t: None  # wired later
        self.on_capacity: Callable[[int], None] = lambda model_index: None

    # -- arrivals ---------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.rebalance_interval_s > 0:
            self.loop.schedule_in(self.cfg.rebalance_interval_s, self._rebalance)
        for _ in range(self.cfg.initial):
            self.loop.schedule_at(self.rng_churn.uniform(0.0, self.cfg.bootstrap_s), self.join)
        if self.cfg.join_rate_per_s > 0:
            self.loop.schedule_in(self.rng_churn.expovariate(self.cfg.join_rate_per_s), self._poisson_join)

    def _poisson_join(self) -> None:
        self.join()
        self.loop.schedule_in(self.rng_churn.expovariate(self.cfg.join_rate_per_s), self._poisson_join)

    def join(self) -> None:
        rng = self.rng
        m = rng.choices(range(len(self.sc.models)), weights=self._model_w)[0] if len(self._model_w) > 1 else 0
        model = self.sc.models[m]
        profile = (
            rng.choices(self._profiles, weights=self._profile_w)[0]
            if len(self._profiles) > 1
            else self._profiles[0]
        )
        endpoint = self.geo.place_node()
        cap = capacity_layers(profile, model, self.cfg.max_layers)
        start, end = self.placement.choose(
            self.cache.placed(), self.fingerprints[m], model.n_layers, cap, rng
        )
        self.joins += 1
        self._spawn(m, profile, endpoint, start, end)

    def _spawn(self, m: int, profile: HardwareProfile, endpoint: Endpoint, start: int, end: int) -> SimNode:
        """A node of model ``m`` serving ``[start, end)`` once its shard is downloaded."""
        model = self.sc.models[m]
        self._spawned += 1
        node = SimNode(
            node_id=f"n{self._spawned:06d}",
            model_index=m,
            model_fingerprint=self.fingerprints[m],
            n_layers_model=model.n_layers,
            n_embd=model.n_embd,
            profile=profile,
            endpoint=endpoint,
            start=start,
            end=end,
            cost=step_cost(profile, model, end - start),
            gateway_latency_ms=[self.geo.one_way_ms(endpoint, g) for g in self.gateways],
            step_token_budget=self.sc.gateway.step_token_budget,
            loop=self.loop,
            on_output=self.on_output,
        )
        self.nodes[node.node_id] = node
        self.cache.add(node)
        load_s = 0.0
        if self.cfg.download_mbps > 0:
            load_s = (end - start) * model.layer_bytes * 8.0 / (self.cfg.download_mbps * 1e6)
        self.loop.schedule_in(load_s, self._ready, node)
        return node

    # -- rebalancing (tracker.rebalance) -----------------------------------------
    def _rebalance(self) -> None:
        """Some serving nodes ask whether to move; those told to drain and come back on the new span
        (the same volunteer: profile and place; a new node id, as a re-announce gives)."""
        self.loop.schedule_in(self.cfg.rebalance_interval_s, self._rebalance)
        serving = [n for n in self.nodes.values() if n.state == SERVING]
        if not serving:
            return
        rng = self.rng_rebalance
        asked = rng.sample(serving, min(self.cfg.rebalance_nodes_per_round, len(serving)))
        demand = self.demand()
        models = {fp: i for i, fp in enumerate(self.fingerprints)}
        for node in asked:
            if node.state != SERVING:
                continue
            caps = {
                fp: capacity_layers(node.profile, self.sc.models[i], self.cfg.max_layers)
                for fp, i in models.items()
            }
            move = advise(self.cache.routable(), node.node_id, caps, demand, rng=rng)
            if move is None:
                continue
            self.moves += 1
            self.leave_gracefully(node)
            self.graceful_leaves -= 1  # a move, not a departure
            self._spawn(models[move.model_fingerprint], node.profile, node.endpoint, move.start, move.end)

    def _ready(self, node: SimNode) -> None:
        if node.state != LOADING:
            return
        node.start_serving()
        self.cache.started_serving(node)
        self._cover(node, +1)
        if self.cfg.mean_uptime_s > 0:
            self.loop.schedule_in(self.rng_churn.expovariate(1.0 / self.cfg.mean_uptime_s), self._leave, node)
        self.on_capacity(node.model_index)

    # -- departures ---------------------------------------------------------------
    def _leave(self, node: SimNode) -> None:
        if node.state != SERVING:
            return
        if self.rng_churn.random() < self.cfg.crash_fraction:
            self.crash(node)
        else:
            self.leave_gracefully(node)

    def crash(self, node: SimNode) -> None:
        """The node vanishes now (also used by tests and fault injection)."""
        if node.state != SERVING:
            return
        self._cover(node, -1)
        self.cache.remove(node)
        self.crashes += 1
        node.crash()
        self.on_stage_lost(node, self.cfg.failure_detect_s)

    def leave_gracefully(self, node: SimNode) -> None:
        if node.state != SERVING:
            return
        self._cover(node, -1)
        self.cache.remove(node)
        self.graceful_leaves += 1
        node.state = DRAINING
        if not node.sessions:
            self._gone(node)
        else:
            self.loop.schedule_in(self.cfg.drain_timeout_s, self._drain_deadline, node)

    def _drain_deadline(self, node: SimNode) -> None:
        if node.state == DRAINING:
            self._gone(node)
            # The node says goodbye on its streams: the gateway knows at once.
            self.on_stage_lost(node, 0.0)

    def _gone(self, node: SimNode) -> None:
        node.crash()

    def session_left(self, node: SimNode) -> None:
        """A session released ``node``; a draining node with none left goes."""
        if node.state == DRAINING and not node.sessions:
            self._gone(node)

    def _cover(self, node: SimNode, delta: int) -> None:
        row = self.coverage[node.model_index]
        for layer in range(node.start, node.end):
            row[layer] += delta
        self.serving += delta

    def live_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.state != GONE]


__all__ = ["Swarm"]
