"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges, summaries.

No I/O and no dependencies; ``tracker.app`` serves :meth:`Metrics.render` at ``/metrics``.
Label sets are bounded by construction (endpoint names, status codes, refusal reasons).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

Labels = tuple[tuple[str, str], ...]

_HELP = {
    "swarm_tracker_http_requests_total": ("counter", "HTTP requests by endpoint and status code"),
    "swarm_tracker_refusals_total": ("counter", "signed messages refused, by reason"),
    "swarm_tracker_announces_total": ("counter", "accepted node announcements"),
    "swarm_tracker_heartbeats_total": ("counter", "accepted heartbeats"),
    "swarm_tracker_expirations_total": ("counter", "nodes expired for missing heartbeats"),
    "swarm_tracker_restorations_total": ("counter", "expired nodes that came back"),
    "swarm_tracker_route_requests_total": ("counter", "route requests by outcome"),
    "swarm_tracker_routes_issued_total": ("counter", "routes handed out with a ticket"),
    "swarm_tracker_usage_tokens_total": ("counter", "tokens recorded in the usage ledger"),
    "swarm_tracker_route_selection_seconds": ("summary", "time spent in select_routes"),
    "swarm_tracker_nodes": ("gauge", "registered nodes by state"),
    "swarm_tracker_models": ("gauge", "registered models"),
    "swarm_tracker_nonce_cache_entries": ("gauge", "nonces remembered for replay protection"),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _fmt_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v == int(v) else repr(float(v))


class Metrics:
    def __init__(self) -> None:
        self._counters: dict[str, dict[Labels, float]] = {}
        self._summaries: dict[str, tuple[int, float]] = {}

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        series = self._counters.setdefault(name, {})
        key = tuple(sorted(labels.items()))
        series[key] = series.get(key, 0.0) + amount

    def observe(self, name: str, value_s: float) -> None:
        count, total = self._summaries.get(name, (0, 0.0))
        self._summaries[name] = (count + 1, total + value_s)

    def counter(self, name: str, **labels: str) -> float:
        return self._counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def render(self, gauges: Mapping[str, Mapping[Labels, float]]) -> str:
        lines: list[str] = []
        names = sorted(set(self._counters) | set(self._summaries) | set(gauges))
        for name in names:
            kind, doc = _HELP.get(name, ("untyped", name))
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")
            if name in self._summaries:
                count, total = self._summaries[name]
                lines.append(f"{name}_count {count}")
                lines.append(f"{name}_sum {total!r}")
            for labels, value in sorted({**self._counters.get(name, {}), **gauges.get(name, {})}.items()):
                lines.append(f"{name}{_fmt_labels(labels)} {_fmt_value(value)}")
        return "\n".join(lines) + "\n"
