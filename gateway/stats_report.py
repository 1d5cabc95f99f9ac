"""The gateway's periodic statistics report to the tracker (the swarm dashboard's time series).

Every ``stats_interval_s`` the gateway signs a :class:`proto.announce.GatewayStats`
with what happened since the previous report, read from its own metrics (so
the serving code needs nothing extra): requests finished and failed, prompt and
generated tokens, TTFT p50/p95 estimated from the TTFT histogram's buckets
observed in the interval, sessions and queue now, the sessions on each
cached route (at most ``proto.announce.MAX_ROUTE_STATS``, busiest first), the
decode time it measured of each node (``gateway/trust_report.py``: routing
trusts that rather than the node's claim), and the round trips measured to the
nodes of its routes since the last report (``common.rtt``; for the tracker's
network coordinates), and the nodes that did not answer its Info or OPEN in
time (the tracker challenges them again before routing to them).

A failed report is counted (``swarm_gateway_stats_reports_total{outcome}``)
and logged once per outage; the next interval reports the next delta, so an
outage loses only its own intervals' points, never more memory than one report.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from common.logs import event
from common.metrics import bucket_delta, quantile_from_buckets
from common.rtt import RttSampler, parse_hints
from common.tracker_client import TrackerClient, TrackerClientError
from proto.announce import MAX_ROUTE_STATS, GatewayStats, RouteStat

log = logging.getLogger("swarm.gateway.stats")
TTFT = "swarm_gateway_time_to_first_token_seconds"


@dataclass
class _Reading:
    requests: float
    errors: float
    prompt_tokens: float
    completion_tokens: float
    ttft: list[tuple[float, float]]


def _read(metrics: Any) -> _Reading:
    sessions = "swarm_gateway_route_sessions_total"
    ok = metrics.total(sessions, outcome="ok")
    failed = metrics.total(sessions, outcome="failed") + metrics.total(sessions, outcome="open_failed")
    return _Reading(
        requests=ok + metrics.total(sessions, outcome="failed"),
        errors=failed + metrics.total("swarm_gateway_rejections_total"),
        prompt_tokens=metrics.total("swarm_gateway_prompt_tokens_total"),
        completion_tokens=metrics.total("swarm_gateway_completion_tokens_total"),
        ttft=metrics.histogram_buckets(TTFT),
    )


def build_report(
    gateway_id: str,
    service: Any,
    before: _Reading | None,
    now: _Reading,
    interval_s: float,
    url: str,
    rtt: RttSampler | None = None,
) -> GatewayStats:
    """The report for one interval (``before`` is None for the first one: everything so far)."""

    def delta(name: str) -> int:
        return max(0, int(getattr(now, name) - (getattr(before, name) if before is not None else 0.0)))

    ttft = bucket_delta(now.ttft, before.ttft if before is not None else None)
    p50, p95 = quantile_from_buckets(ttft, 0.5), quantile_from_buckets(ttft, 0.95)
    stats = service.gate.statistics()
    inflight = sorted(service.routes.inflight().items(), key=lambda kv: (-kv[1], kv[0]))
    return GatewayStats(
        gateway_id=gateway_id,
        interval_s=max(0.001, interval_s),
        sessions_active=int(stats.active),
        requests_queued=int(stats.queued),
        requests=delta("requests"),
        errors=delta("errors"),
        prompt_tokens=delta("prompt_tokens"),
        completion_tokens=delta("completion_tokens"),
        ttft_p50_s=None if math.isnan(p50) else min(p50, 86_400.0),
        ttft_p95_s=None if math.isnan(p95) else min(p95, 86_400.0),
        routes=tuple(RouteStat(r[:400], int(n)) for r, n in inflight[:MAX_ROUTE_STATS] if n > 0),
        url=url[:255],
        nodes=service.observed.drain(),
        rtt_samples=rtt.take_samples() if rtt is not None else (),
        unreachable=service.standing.take_unreachable(),
    )


async def report_stats_loop(
    service: Any,
    tracker: TrackerClient,
    *,
    interval_s: float,
    timeout_s: float,
    url: str = "",
    rtt: RttSampler | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send one report per ``interval_s`` until cancelled."""
    task_status.started()
    before: _Reading | None = None
    last_t = trio.current_time()
    failing = False
    while True:
        await trio.sleep(interval_s)
        now_t = trio.current_time()
        reading = _read(service.metrics)
        report = build_report(service.gateway_id, service, before, reading, now_t - last_t, url, rtt)
        before, last_t = reading, now_t
        try:
            with trio.fail_after(timeout_s):
                answer = await tracker.report_stats(report)
            if rtt is not None:  # random nodes the tracker wants measured, besides our routes' nodes
                rtt.hint(parse_hints(answer.get("probe") if isinstance(answer, dict) else None))
            service.metrics.inc("swarm_gateway_stats_reports_total", outcome="ok")
            if failing:
                event(log, "stats_reports_resumed")
            failing = False
        except (TrackerClientError, httpx.HTTPError, trio.TooSlowError) as err:
            service.metrics.inc("swarm_gateway_stats_reports_total", outcome="failed")
            if not failing:
                event(log, "stats_report_failed", level=logging.WARNING, error=repr(err))
            failing = True
