"""One simulated run: wire the parts, play the scenario, summarise.

:func:`run` is a pure function of the scenario (seeds included): the same
scenario gives the same ``result["metrics"]``, ``["timeseries"]`` and
``["requests"]``, byte for byte once serialised. Only ``result["performance"]``
(wall time, events per second of this machine) differs between runs.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from pathlib import Path
from typing import Any

from sim.des.config import Scenario
from sim.des.coords import SimCoordinates, gateway_key
from sim.des.events import EventLoop
from sim.des.gateway import Gateways
from sim.des.geography import PRESETS, Geography
from sim.des.metrics import Metrics, gini, percentiles
from sim.des.node import SERVING
from sim.des.policies import Placement, Routing
from sim.des.session import Session
from sim.des.snapshots import SnapshotCache
from sim.des.swarm import Swarm
from sim.des.workload import Request, poisson_requests, trace_requests
from tracker.routing import RoutingCosts
from tracker.snapshot import ModelInfo


def _rng(seed: int, stream: str) -> random.Random:
    # str seeds hash with SHA-512 inside random: stable across processes and PYTHONHASHSEED.
    return random.Random(f"{seed}/{stream}")


def _fingerprint(name: str) -> str:
    return hashlib.sha256(f"sim-model:{name}".encode()).hexdigest()


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        sc = scenario
        self.sc = sc
        seed = sc.run.seed
        self.loop = EventLoop()
        self.metrics = Metrics(len(sc.models))
        self.recent_busy: dict[str, float] = {}  # node id -> recent busy share (policy.recent_busy_ms)
        self._busy_seen: dict[str, float] = {}  # node id -> its busy seconds at the last heartbeat
        self.fingerprints = [_fingerprint(m.name) for m in sc.models]
        region_model = PRESETS[sc.network.preset]
        self.geo = Geography(
            region_model,
            sc.network.access_latency_ms_min,
            sc.network.access_latency_ms_max,
            _rng(seed, "geography"),
        )
        gw_regions = sc.network.gateway_regions or (region_model.regions[0],)
        self.gateway_endpoints = [self.geo.place_in(r) for r in gw_regions]
        infos = tuple(
            ModelInfo(fingerprint=fp, name=m.name, n_layers=m.n_layers, n_embd=m.n_embd)
            for fp, m in zip(self.fingerprints, sc.models, strict=True)
        )
        # What the tracker assumes for a hop it has no measurement for: the median one-way
        # latency between two random volunteers, doubled because every hop passes the gateway.
        typical = statistics.median(
            self.geo.one_way_ms(self.geo.place_node(), self.gateway_endpoints[0]) for _ in range(101)
        )
        # Network coordinates, measured in the simulation, for routing "tracker" (sim/des/coords.py).
        self.coords: SimCoordinates | None = None
        if sc.policy.routing == "tracker":
            self.coords = SimCoordinates(
                self.geo,
                self.gateway_endpoints,
                _rng(seed, "coordinates"),
                probes_per_heartbeat=sc.network.rtt_probes_per_heartbeat,
                noise=sc.network.rtt_noise,
            )
        self.cache = SnapshotCache(
            infos,
            default_latency_ms=round(2 * typical, 3),
            single_gateway=len(self.gateway_endpoints) == 1,
            coordinates=self.coords,
        )
        self.swarm = Swarm(
            sc,
            self.fingerprints,
            self.loop,
            self.geo,
            self.gateway_endpoints,
            Placement(sc.policy.placement),
            self.cache,
            _rng(seed, "nodes"),
            _rng(seed, "churn"),
            _rng(seed, "rebalance"),
            self._demand,
        )
        coords = self.coords
        self.routing = Routing(
            sc.policy.routing,
            self._latency_to_gateway,
            (lambda g: coords.coord(gateway_key(g))) if coords is not None else (lambda g: None),
            RoutingCosts(
                activation_bytes_per_value=2.0,  # the simulated frames are f16
                batch_growth_per_session=sc.policy.batch_growth_per_session,
                queue_wait_weight=sc.policy.queue_wait_weight,
                uplink_queue_share=sc.policy.uplink_queue_share,
                occupancy_weight=sc.policy.occupancy_weight,
                max_occupancy=sc.policy.max_occupancy,
                gateway_leg_weight=sc.policy.gateway_leg_weight,
                recent_busy_ms=sc.policy.recent_busy_ms,
            ),
            recent_busy=(lambda: self.recent_busy) if sc.policy.recent_busy_ms > 0 else None,
        )
        self.gateways = Gateways(
            sc.gateway,
            sc.models,
            self.fingerprints,
            len(self.gateway_endpoints),
            sc.network.gateway_bandwidth_mbps,
            sc.nodes.heartbeat_interval_s,
            self.loop,
            self.swarm.nodes,
            self.cache,
            self.routing,
            self.metrics,
            _rng(seed, "routing"),
            self.swarm.session_left,
            geo=self.geo,
        )
        self.swarm.on_output = self.gateways.on_output
        self.swarm.on_stage_lost = self.gateways.stage_lost
        self.swarm.on_capacity = self.gateways.drain_queues
        self._requests = self._workload(_rng(seed, "workload"))
        self._next_sid = 0

    def _demand(self) -> dict[str, float]:
        """Per model: the sessions the gateways hold or queue now (what rebalancing weighs)."""
        out = dict.fromkeys(self.fingerprints, 0.0)
        for s in self.gateways.sessions.values():
            out[self.fingerprints[s.model_index]] += 1.0
        return out

    def _latency_to_gateway(self, node_id: str, gateway: int) -> float:
        return self.swarm.nodes[node_id].gateway_latency_s[gateway] * 1000.0

    def _workload(self, rng: random.Random):
        w = self.sc.workload
        if w.kind == "trace":
            path = Path(w.trace_file)
            if not path.is_absolute():
                path = Path(self.sc.source_dir or ".") / path
            return trace_requests(path, [m.name for m in self.sc.models], self.sc.run.duration_s, w.start_s)
        shares = [m.request_share for m in self.sc.models]
        return poisson_requests(w, shares, self.sc.run.duration_s, rng, [m.name for m in self.sc.models])

    # -- events ---------------------------------------------------------------
    def _schedule_next_request(self) -> None:
        req: Request | None = next(self._requests, None)
        if req is not None:
            self.loop.schedule_at(req.t_s, self._arrive, req)

    def _arrive(self, req: Request) -> None:
        self._next_sid += 1
        # Clients are spread like volunteers; each uses its nearest gateway.
        g = 0
        if len(self.gateway_endpoints) > 1:
            client = self.geo.place_node()
            g = min(
                range(len(self.gateway_endpoints)),
                key=lambda i: self.geo.one_way_ms(client, self.gateway_endpoints[i]),
            )
        s = Session(self._next_sid, req.model_index, g, self.loop.now, req.prompt_tokens, req.output_tokens)
        self.gateways.submit(s)
        self._schedule_next_request()

    def _track_busy(self) -> None:
        """Each serving node's recent busy share (what its heartbeat's served tokens tell a tracker):
        an exponential average, per heartbeat interval, of the share of it the node spent computing."""
        dt = self.sc.nodes.heartbeat_interval_s
        keep = 0.5 ** (dt / self.sc.policy.recent_busy_halflife_s)
        seen, recent = self._busy_seen, {}
        for n in self.swarm.nodes.values():
            if n.state != SERVING:
                continue
            nid = n.node_id
            before = seen.get(nid)
            seen[nid] = n.busy_s
            share = 0.0 if before is None else min((n.busy_s - before) / dt, 1.0)
            recent[nid] = keep * self.recent_busy.get(nid, 0.0) + (1.0 - keep) * share
        for nid in [k for k in seen if k not in recent]:
            del seen[nid]
        self.recent_busy = recent

    def _heartbeat(self) -> None:
        if self.sc.policy.recent_busy_ms > 0:
            self._track_busy()
        if self.coords is not None:
            serving = {n.node_id: n.endpoint for n in self.swarm.nodes.values() if n.state == SERVING}
            live = self.coords.sync(serving)
            self.coords.heartbeat(self.loop.now, live, self.gateways.push_pairs(), self.gateways.pools())
        self.cache.refresh_load()
        self.gateways.drain_queues()
        self.loop.schedule_in(self.sc.nodes.heartbeat_interval_s, self._heartbeat)

    def _sample(self) -> None:
        dt = self.sc.run.sample_interval_s
        self.metrics.sample(
            self.loop.now,
            dt,
            self.gateways.active_count(),
            self.gateways.queued_count(),
            self.gateways.recovering_count(),
            self.swarm.serving,
            [list(row) for row in self.swarm.coverage],
        )
        if self.loop.now + dt <= self.sc.run.duration_s + 1e-9:
            self.loop.schedule_in(dt, self._sample)

    # -- the run ---------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        self.swarm.start()
        self._schedule_next_request()
        self.loop.schedule_in(self.sc.nodes.heartbeat_interval_s, self._heartbeat)
        self.loop.schedule_in(self.sc.run.sample_interval_s, self._sample)
        self.loop.run_until(self.sc.run.duration_s)
        wall = time.perf_counter() - wall0
        result = self._summarise()
        events = self.loop.events_processed
        coords_s = self.coords.wall_s if self.coords is not None else 0.0
        tracker_s = self.swarm.placement.wall_s + self.routing.wall_s + coords_s
        result["performance"] = {
            "wall_time_s": round(wall, 3),
            "events": events,
            "events_per_s": round(events / wall, 1) if wall > 0 else None,
            # wall time inside the tracker's pure functions (placement, route selection)
            "placement_wall_s": round(self.swarm.placement.wall_s, 3),
            "route_selection_wall_s": round(self.routing.wall_s, 3),
            "coordinates_wall_s": round(coords_s, 3),
            "events_per_s_excluding_tracker": round(events / (wall - tracker_s), 1)
            if wall > tracker_s
            else None,
        }
        return result

    def _model_demand(self) -> list[float]:
        """Per model (scenario order): its share of the workload's requests (0 = never asked for;
        a model a burst names, or any model of a trace, counts as asked for)."""
        w = self.sc.workload
        named = {b.model for b in w.bursts if b.model}
        if w.kind == "trace":
            return [1.0] * len(self.sc.models)
        return [m.request_share if m.name not in named else max(m.request_share, 1.0) for m in self.sc.models]

    def _summarise(self) -> dict[str, Any]:
        sc, m = self.sc, self.metrics
        end = sc.run.duration_s
        served = [n for n in self.swarm.nodes.values() if n.state != "loading"]
        util = [n.utilization(end) for n in served]
        mean_util = sum(util) / len(util) if util else 0.0
        counts = m.request_counts(self.gateways.in_flight_by_phase())
        cov = m.series.coverage
        coverage_summary = []
        t_series = m.series.t_s
        for i, model in enumerate(sc.models):
            # From the first request on: the swarm forming before then is in the time series only.
            rows = [r for t, r in zip(t_series, cov[i], strict=True) if t >= sc.workload.start_s]
            mins = [min(r) for r in rows] if rows else []
            coverage_summary.append(
                {
                    "model": model.name,
                    "min_layer_coverage_mean": round(sum(mins) / len(mins), 3) if mins else None,
                    "min_layer_coverage_worst": min(mins) if mins else None,
                    "share_of_samples_fully_covered": round(sum(1 for x in mins if x > 0) / len(mins), 4)
                    if mins
                    else None,
                }
            )
        return {
            "scenario": sc.run.name,
            "policy": {"placement": sc.policy.placement, "routing": sc.policy.routing},
            "data_plane": sc.gateway.data_plane,
            "seed": sc.run.seed,
            "duration_s": end,
            "requests": counts,
            "metrics": {
                "throughput_tokens_per_s": round(m.tokens_delivered / end, 4),
                "tokens_delivered": m.tokens_delivered,
                "ttft_s": percentiles(m.ttft_s),
                "per_token_latency_ms": percentiles(m.inter_token_s, 1000.0),
                "end_to_end_s": percentiles(m.e2e_s),
                "recovery": {
                    "recoveries": m.recoveries,
                    "attempts": m.recovery_attempts,
                    "time_lost_s": round(m.recovery_lost_s, 4),
                    "outage_s": percentiles(m.recovery_durations_s),
                    "replayed_token_layers_stages": m.replayed_tokens,
                },
                "load_balance": {
                    "nodes": len(util),
                    "utilization_mean": round(mean_util, 6),
                    "utilization_gini": gini(util),
                    "utilization_max_over_mean": round(max(util) / mean_util, 4) if mean_util > 0 else None,
                    **load_breakdown(served, util, {i for i, w in enumerate(self._model_demand()) if w > 0}),
                },
                "coverage": coverage_summary,
                "swarm": {
                    "joins": self.swarm.joins,
                    "crashes": self.swarm.crashes,
                    "graceful_leaves": self.swarm.graceful_leaves,
                    "moves": self.swarm.moves,
                    "serving_at_end": self.swarm.serving,
                },
                "stages_per_session": {str(k): v for k, v in sorted(m.stages_per_session.items())},
                "route_selector_calls": self.routing.calls,
                "snapshot_builds": self.cache.builds,
                "events_processed": self.loop.events_processed,
            },
            "timeseries": {
                "t_s": m.series.t_s,
                "tokens_per_s": [round(x, 4) for x in m.series.tokens_per_s],
                "active_sessions": m.series.active_sessions,
                "queued": m.series.queued,
                "recovering": m.series.recovering,
                "serving_nodes": m.series.serving_nodes,
                "coverage_by_model": {model.name: cov[i] for i, model in enumerate(sc.models)},
            },
        }


def run(scenario: Scenario) -> dict[str, Any]:
    return Simulation(scenario).run()


def load_breakdown(nodes: list[Any], util: list[float], demanded: set[int]) -> dict[str, Any]:
    """Who carries the load: the Gini over the nodes of demanded models only (a node of a model
    nobody asks for can carry nothing, whatever the routing), over the nodes that carried any,
    and the busy time by hardware profile and by region (share of all busy time, and of nodes)."""
    total = sum(util) or 1.0
    on_demand = [u for n, u in zip(nodes, util, strict=True) if n.model_index in demanded]
    carried = [u for u in util if u > 0]
    groups: dict[str, dict[str, dict[str, float]]] = {"by_profile": {}, "by_region": {}}
    for n, u in zip(nodes, util, strict=True):
        for key, name in (("by_profile", n.profile.name), ("by_region", n.endpoint.region)):
            g = groups[key].setdefault(name, {"nodes": 0.0, "busy_share": 0.0, "carried_any": 0.0})
            g["nodes"] += 1
            g["busy_share"] += u / total
            g["carried_any"] += 1 if u > 0 else 0
    return {
        "nodes_of_demanded_models": len(on_demand),
        "utilization_gini_demanded_models": gini(on_demand),
        "nodes_that_carried_load": len(carried),
        "utilization_gini_carried": gini(carried),
        **{
            key: {
                name: {
                    "nodes": int(g["nodes"]),
                    "carried_any": int(g["carried_any"]),
                    "busy_share": round(g["busy_share"], 4),
                }
                for name, g in sorted(v.items())
            }
            for key, v in groups.items()
        },
    }
