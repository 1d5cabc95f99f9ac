"""The gateway's metric declarations (``common.metrics``).

Counters and histograms are pushed by the serving code; gauges are read at
scrape time from the live components (``GatewayService.gauges()``). Label
values are bounded: endpoints are the router's rules, statuses HTTP codes,
reasons fixed strings, and route labels at most :data:`MAX_ROUTE_LABELS`
distinct values (then ``"other"``).

Latency histograms, all in seconds (buckets ``common.metrics.LATENCY_BUCKETS_S``):

=================================================  ====================================================
``swarm_gateway_time_to_first_token_seconds``      request arrival to the first generated token
``swarm_gateway_time_per_output_token_seconds``    between consecutive generated tokens (decode)
``swarm_gateway_hop_latency_seconds``              one stage's share of a step: frame out to reply in
``swarm_gateway_queue_wait_seconds``               admission: arrival until a session slot was granted
``swarm_gateway_step_seconds``                     one decode step through the whole route
``swarm_gateway_session_seconds``                  Route Session wall time
``swarm_gateway_recovery_seconds``                 stage failure until generation could continue
``swarm_gateway_kv_wait_seconds``                  time one request (or preempted session) waited for KV
=================================================  ====================================================
"""

from __future__ import annotations

from common import metrics as m
from common.metrics import Labels

__all__ = ["MAX_ROUTE_LABELS", "SPECS", "Labels", "Metrics"]

MAX_ROUTE_LABELS = 64

SPECS: dict[str, m.Spec] = {
    "swarm_gateway_http_requests_total": m.counter(
        "HTTP requests by endpoint and status code", "endpoint", "status"
    ),
    "swarm_gateway_rejections_total": m.counter(
        "requests refused before a session started, by reason", "reason"
    ),
    "swarm_gateway_route_sessions_total": m.counter(
        "Route Sessions by route and outcome", "route", "outcome", max_series=8 * MAX_ROUTE_LABELS
    ),
    "swarm_gateway_prompt_tokens_total": m.counter("prompt tokens prefilled through the swarm"),
    "swarm_gateway_completion_tokens_total": m.counter("tokens generated through the swarm"),
    "swarm_gateway_spec_windows_total": m.counter(
        "speculative decode windows (a token and its drafts) verified by a route's last stage"
    ),
    "swarm_gateway_spec_window_tokens_total": m.counter(
        "tokens those windows produced (accepted drafts plus the correction; / windows = tokens per pass)"
    ),
    "swarm_gateway_spec_drafted_tokens_total": m.counter("drafted tokens those windows carried"),
    "swarm_gateway_client_disconnects_total": m.counter("sessions cancelled because the client went away"),
    "swarm_gateway_client_stalls_total": m.counter(
        "sessions ended because a streaming client read nothing for client_stall_s"
    ),
    "swarm_gateway_auth_total": m.counter(
        "requests by authentication outcome: key, anonymous, invalid_api_key, missing_api_key", "outcome"
    ),
    "swarm_gateway_quota_rejections_total": m.counter(
        "requests refused by a per-key or anonymous quota, by limit: sessions, tokens_per_minute, "
        "max_tokens, identities",
        "limit",
    ),
    "swarm_gateway_usage_reports_total": m.counter(
        "usage reports sent to the tracker, by outcome", "outcome"
    ),
    "swarm_gateway_unreachable_nodes_total": m.counter(
        "nodes that did not answer Info or OPEN in time (dead, stopped, a tarpit): routed around "
        "for avoid_unreachable_s and named to the tracker"
    ),
    "swarm_gateway_stats_reports_total": m.counter(
        "statistics reports sent to the tracker (dashboard), by outcome", "outcome"
    ),
    "swarm_gateway_trust_reports_total": m.counter(
        "spot-check results and verdicts sent to the tracker, by kind and outcome", "kind", "outcome"
    ),
    "swarm_gateway_tracker_route_requests_total": m.counter(
        "route look-ups at the tracker, by outcome (ok, no_route, unreachable, an HTTP status; refused: no "
        "route had a valid ticket; stale: "
        "the tracker failed and routes with valid tickets were served from the cache)",
        "outcome",
    ),
    "swarm_gateway_route_tickets_refused_total": m.counter(
        "routes dropped because their tracker-signed ticket does not vouch for them, by reason (expired,"
        " untrusted_key, bad_signature, hops_mismatch: the answer's hops, addresses or certificate pins"
        " differ from the signed ones, ...)",
        "reason",
    ),
    "swarm_gateway_prefix_reuse_total": m.counter(
        "requests that could reuse a kept prefix (warm conversations), by outcome (hit, miss)", "outcome"
    ),
    "swarm_gateway_prefix_reused_tokens_total": m.counter(
        "prompt positions taken from KV kept on the route instead of prefilled"
    ),
    "swarm_gateway_conversation_turns_total": m.counter(
        "conversation turns answered (requests naming a conversation_id)"
    ),
    "swarm_gateway_conversation_compactions_total": m.counter(
        "conversation turns that had to leave more of the history out to fit the context"
    ),
    "swarm_gateway_conversation_summaries_total": m.counter(
        "summaries the model wrote of left-out history (conversation_compaction = summary)"
    ),
    "swarm_gateway_conversation_refusals_total": m.counter(
        "conversation turns refused, by reason (conversation_full, conversation_gone)", "reason"
    ),
    "swarm_gateway_hidden_relays_total": m.counter(
        "hidden-state frames this gateway relayed from one stage to the next"
    ),
    "swarm_gateway_checks_total": m.counter(
        "spot checks (a request also run on a second route), by outcome: started, passed, liar_caught,"
        " inconclusive, abandoned (the shadow failed), parted (two recipes parted at a near tie the"
        " tolerance accepts: unchecked from there), no_shadow (no second route), unconfirmable (nodes"
        " on probation no route can check: another route taken)",
        "outcome",
    ),
    "swarm_gateway_cross_recipe_checks_total": m.counter(
        "spot checks whose runs span more than one check fingerprint (another build or CPU features),"
        " compared with the calibrated tolerance instead of bit for bit"
    ),
    "swarm_gateway_recoveries_total": m.counter(
        "stage failures recovered mid-generation, by kind (span: one stage replaced, route: whole route)"
        " and outcome",
        "kind",
        "outcome",
    ),
    "swarm_gateway_time_to_first_token_seconds": m.histogram("request arrival to first generated token"),
    "swarm_gateway_time_per_output_token_seconds": m.histogram("time between consecutive generated tokens"),
    "swarm_gateway_hop_latency_seconds": m.histogram(
        "one stage's share of a step: frame sent to reply received"
    ),
    "swarm_gateway_queue_wait_seconds": m.histogram(
        "arrival until the admission gate granted a session slot"
    ),
    "swarm_gateway_step_seconds": m.histogram("one decode step through the whole route"),
    "swarm_gateway_session_seconds": m.histogram("Route Session wall time"),
    "swarm_gateway_recovery_seconds": m.histogram(
        "time from a stage failure until generation could continue"
    ),
    "swarm_gateway_kv_wait_seconds": m.histogram(
        "time a request, or a preempted session, waited for a route with KV room"
    ),
    "swarm_gateway_kv_waits_total": m.counter(
        "waits for KV room by outcome: served (a route had room), timed_out (kv_wait_s passed: 503"
        " kv_exhausted), rejected (the wait was full: 503 kv_exhausted), left (the client went away)",
        "outcome",
    ),
    "swarm_gateway_preemptions_total": m.counter(
        "sessions a node preempted (freed their KV for an older session), by outcome: resumed (re-prefilled"
        " and generating again), failed (preempted more than max_preemptions times, or no room came)",
        "outcome",
    ),
    "swarm_gateway_prompt_too_long_total": m.counter(
        "requests refused with 413 prompt_too_long (prompt plus max_tokens past every route's context)"
    ),
    "swarm_gateway_kv_waiting": m.gauge("requests and preempted sessions waiting for KV room now"),
    "swarm_gateway_kv_overdue_total": m.counter(
        "requests waiting for KV room that reached the starvation bound (kv_admission_max_bypass or "
        "kv_admission_max_wait_s) and went first",
        scraped=True,
    ),
    "swarm_gateway_kv_holding_sessions": m.gauge(
        "this gateway's sessions holding their whole prompt on the node now (from their first token to "
        "their end or preemption)",
        "node",
    ),
    "swarm_gateway_kv_holding_sessions_peak": m.gauge(
        "the most of this gateway's sessions that held their whole prompt on the node at once", "node"
    ),
    "swarm_gateway_sessions_active": m.gauge("Route Sessions running now"),
    "swarm_gateway_requests_queued": m.gauge("requests waiting for a session slot"),
    "swarm_gateway_route_inflight_sessions": m.gauge(
        "sessions running now on each cached route", "route", max_series=MAX_ROUTE_LABELS + 1
    ),
    "swarm_gateway_routes_cached": m.gauge("data-parallel routes in the route cache, by model", "model"),
    "swarm_gateway_conversations_live": m.gauge("conversations this gateway keeps now (conversation_id)"),
}


class Metrics(m.Metrics):
    def __init__(self) -> None:
        super().__init__("gateway", SPECS)

    def route_label(self, route_id: str) -> str:
        """The route's own id while fewer than :data:`MAX_ROUTE_LABELS` were seen, else ``"other"``."""
        return self.bounded_label("route", route_id)
