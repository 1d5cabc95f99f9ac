"""The tracker's metric declarations (``common.metrics``): counters pushed by the service, gauges
read from the registry at scrape time, the route-selection histogram.

Label sets are bounded by construction (endpoint rules, status codes, refusal
reasons, node states, outcomes) and by ``Spec.max_series`` besides.
"""

from __future__ import annotations

from common import metrics as m
from common.metrics import Labels

__all__ = ["SPECS", "Labels", "Metrics"]

# Per-node KV gauges: the first this many live nodes (by id) with a KV report; a bound, so a swarm of
# thousands does not become thousands of series (the dashboard and /v1/swarm list every node).
MAX_KV_NODES = 256

SPECS: dict[str, m.Spec] = {
    "swarm_tracker_http_requests_total": m.counter(
        "HTTP requests by endpoint and status code", "endpoint", "status"
    ),
    "swarm_tracker_http_request_seconds": m.histogram("HTTP request handling time by endpoint", "endpoint"),
    "swarm_tracker_refusals_total": m.counter("signed messages refused, by reason", "reason"),
    "swarm_tracker_rate_limited_total": m.counter(
        "requests refused over a quota, by scope (address_read, address_write, key, key_nonces)", "scope"
    ),
    "swarm_tracker_pruned_total": m.counter("rows of long-dead nodes and unused models deleted", "table"),
    "swarm_tracker_announces_total": m.counter("accepted node announcements"),
    "swarm_tracker_heartbeats_total": m.counter("accepted heartbeats"),
    "swarm_tracker_leaves_total": m.counter("nodes that left on purpose (signed leave)"),
    "swarm_tracker_expirations_total": m.counter("nodes expired for missing heartbeats"),
    "swarm_tracker_restorations_total": m.counter("expired or departed nodes that came back"),
    "swarm_tracker_route_requests_total": m.counter("route requests by outcome", "outcome"),
    "swarm_tracker_routes_issued_total": m.counter("routes handed out with a ticket"),
    "swarm_tracker_rebalance_advice_total": m.counter(
        "rebalancing questions answered, by advice (stay, or move and why)", "advice"
    ),
    "swarm_tracker_usage_tokens_total": m.counter("tokens recorded in the usage ledger"),
    "swarm_tracker_gateway_reports_total": m.counter("gateway statistics reports accepted"),
    "swarm_tracker_rtt_samples_total": m.counter("round-trip samples received (network coordinates)"),
    "swarm_tracker_periodic_runs_total": m.counter(
        "periodic maintenance rounds, by whether this replica held the lock", "outcome"
    ),
    "swarm_tracker_challenges_total": m.counter("node challenges finished, by outcome", "outcome"),
    "swarm_tracker_rechallenges_total": m.counter(
        "live nodes sent back to their challenge because a gateway could not reach them"
    ),
    "swarm_tracker_checks_credited_total": m.counter("spot checks passed, credited to nodes"),
    "swarm_tracker_evidence_total": m.counter(
        "verdicts reported by gateways, by whether they were conclusive", "conclusive"
    ),
    "swarm_tracker_bans_total": m.counter("nodes banned on conclusive evidence"),
    "swarm_tracker_route_selection_seconds": m.histogram("time spent in select_routes"),
    "swarm_tracker_nodes": m.gauge("registered nodes by state", "state"),
    "swarm_tracker_models": m.gauge("registered models"),
    "swarm_tracker_layer_coverage_min": m.gauge(
        "fewest live nodes holding any one layer, per model (0 = a gap)", "model", max_series=32
    ),
    "swarm_tracker_nonce_cache_entries": m.gauge("nonces remembered in this replica's memory"),
    "swarm_tracker_dashboard_clients": m.gauge("dashboard event streams open"),
    "swarm_tracker_replicas": m.gauge("tracker replicas heard from within the liveness window"),
    "swarm_tracker_node_kv_pool_tokens": m.gauge(
        "a live node's KV pool size in positions, from its heartbeat (nodes that report one)",
        "node",
        max_series=MAX_KV_NODES,
    ),
    "swarm_tracker_node_kv_used_tokens": m.gauge(
        "KV positions a live node's sessions hold, from its heartbeat", "node", max_series=MAX_KV_NODES
    ),
    "swarm_tracker_node_kv_free_tokens": m.gauge(
        "KV positions free on a live node, from its heartbeat", "node", max_series=MAX_KV_NODES
    ),
    "swarm_tracker_node_kv_preemptions": m.gauge(
        "sessions a live node preempted to make room in its KV pool since it started, from its heartbeat",
        "node",
        max_series=MAX_KV_NODES,
    ),
    "swarm_tracker_node_kv_refusals": m.gauge(
        "steps a live node refused since it started because its KV pool had no room (a gateway waited"
        " for KV), from its heartbeat",
        "node",
        max_series=MAX_KV_NODES,
    ),
    "swarm_tracker_kv_context_max_tokens": m.gauge(
        "per model, the largest context one session can hold on some complete route: kind=session (the"
        " nodes' per-session limits and pool sizes) or kind=free (what some route has free now)",
        "model",
        "kind",
        max_series=64,
    ),
}


class Metrics(m.Metrics):
    def __init__(self) -> None:
        super().__init__("tracker", SPECS)
