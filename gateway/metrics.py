"""Prometheus text exposition (format 0.0.4) for the gateway, written by hand (pure).

Counters and summaries accumulate here; gauges are read at render time from
the live components. Label values are bounded by construction: endpoints are
the router's rules, statuses are HTTP codes, reasons are fixed strings, and
route labels are capped at :data:`MAX_ROUTE_LABELS` distinct values (then
``"other"``).
"""

from __future__ import annotations

from collections.abc import Mapping

Labels = tuple[tuple[str, str], ...]
MAX_ROUTE_LABELS = 64

HELP: dict[str, tuple[str, str]] = {
    "swarm_gateway_http_requests_total": ("counter", "HTTP requests by endpoint and status code"),
    "swarm_gateway_rejections_total": ("counter", "requests refused before a session started, by reason"),
    "swarm_gateway_route_sessions_total": ("counter", "Route Sessions by route and outcome"),
    "swarm_gateway_prompt_tokens_total": ("counter", "prompt tokens prefilled through the swarm"),
    "swarm_gateway_completion_tokens_total": ("counter", "tokens generated through the swarm"),
    "swarm_gateway_client_disconnects_total": ("counter", "sessions cancelled because the client went away"),
    "swarm_gateway_usage_reports_total": ("counter", "usage reports sent to the tracker, by outcome"),
    "swarm_gateway_tracker_route_requests_total": ("counter", "route look-ups at the tracker, by outcome"),
    "swarm_gateway_time_to_first_token_seconds": ("summary", "request arrival to first generated token"),
    "swarm_gateway_session_seconds": ("summary", "Route Session wall time"),
    "swarm_gateway_hidden_relays_total": (
        "counter",
        "hidden-state frames this gateway relayed from one stage to the next",
    ),
    "swarm_gateway_sessions_active": ("gauge", "Route Sessions running now"),
    "swarm_gateway_requests_queued": ("gauge", "requests waiting for a session slot"),
    "swarm_gateway_route_inflight_sessions": ("gauge", "sessions running now on each cached route"),
    "swarm_gateway_routes_cached": ("gauge", "data-parallel routes in the route cache, by model"),
    "swarm_gateway_recoveries_total": (
        "counter",
        "stage failures recovered mid-generation, by kind (span: one stage replaced, route: whole route)"
        " and outcome",
    ),
    "swarm_gateway_recovery_seconds": (
        "summary",
        "time from a stage failure until generation could continue",
    ),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _fmt_value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Metrics:
    def __init__(self) -> None:
        self._counters: dict[str, dict[Labels, float]] = {}
        self._summaries: dict[str, tuple[int, float]] = {}
        self._routes: set[str] = set()

    def route_label(self, route_id: str) -> str:
        if route_id in self._routes or len(self._routes) < MAX_ROUTE_LABELS:
            self._routes.add(route_id)
            return route_id
        return "other"

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
        for name in sorted(set(self._counters) | set(self._summaries) | set(gauges)):
            kind, doc = HELP.get(name, ("untyped", name))
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")
            if name in self._summaries:
                count, total = self._summaries[name]
                lines.append(f"{name}_count {count}")
                lines.append(f"{name}_sum {total!r}")
            series = {**self._counters.get(name, {}), **gauges.get(name, {})}
            for labels, value in sorted(series.items()):
                lines.append(f"{name}{_fmt_labels(labels)} {_fmt_value(value)}")
        return "\n".join(lines) + "\n"
