"""What the swarm dashboard shows, computed from the registry's rows: pure functions, no I/O.

:func:`build_state` turns a routing snapshot, the node rows, recent gateway
statistics and recent ledger rows into one JSON-ready dict (the payload of every
dashboard event; its fields are listed in docs/operations.md).

Bounds: at most :data:`MAX_NODE_ROWS` nodes, :data:`MAX_ROUTES` routes and
:data:`MAX_SERIES_POINTS` points per series are sent, whatever the swarm's size
(counts say how many there are in all).

A node is ``late`` when it is live in the registry but has not been heard from
for 1.5 heartbeat intervals: it still receives routes until it expires, but
the coverage map no longer counts it, so a node that died without saying
goodbye shows within about one heartbeat interval instead of at expiry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tracker.names import resolve_names
from tracker.snapshot import SwarmSnapshot

MAX_NODE_ROWS = 500
MAX_ROUTES = 32
MAX_SERIES_POINTS = 180
ROUTE_WINDOW_S = 60.0
LATE_FACTOR = 1.5


def coverage_counts(
    snapshot: SwarmSnapshot, fingerprint: str, n_layers: int, *, skip: frozenset[str] = frozenset()
) -> list[int]:
    """How many shards of the snapshot hold each layer ``0..n_layers-1`` (difference array)."""
    delta = [0] * (n_layers + 1)
    for s in snapshot.shards:
        if s.model_fingerprint != fingerprint or s.node_id in skip:
            continue
        a, b = max(0, s.start), min(n_layers, s.end)
        if a < b:
            delta[a] += 1
            delta[b] -= 1
    out, running = [], 0
    for i in range(n_layers):
        running += delta[i]
        out.append(running)
    return out


def gaps(counts: Sequence[int]) -> list[list[int]]:
    """Half-open ranges ``[a, b)`` of layers no node holds."""
    out: list[list[int]] = []
    start: int | None = None
    for i, c in enumerate(counts):
        if c == 0 and start is None:
            start = i
        elif c > 0 and start is not None:
            out.append([start, i])
            start = None
    if start is not None:
        out.append([start, len(counts)])
    return out


def route_label(hops: Iterable[tuple[str, int, int]]) -> str:
    """The gateways' route id: short node ids with spans, ``3fa2c1d0[0:15)>9bd1e2f3[15:30)``."""
    return ">".join(f"{node[:8]}[{a}:{b})" for node, a, b in hops)


def routes_in_use(
    reports: Sequence[Mapping[str, Any]],
    recent_usage: Sequence[tuple[str, str, str, int]],
    spans: Mapping[str, tuple[int, int]],
    *,
    now_s: float,
    fresh_s: float,
    window_s: float = ROUTE_WINDOW_S,
) -> list[dict[str, Any]]:
    """Routes carrying traffic: sessions now (the gateways' latest reports) and tokens per second
    over the last ``window_s`` (ledger rows grouped by request; a request's route is its nodes in
    layer order, its tokens the largest count any of its stages reported)."""
    sessions: dict[str, int] = {}
    latest: dict[str, Mapping[str, Any]] = {}
    for r in reports:
        if now_s - float(r["at_s"]) <= fresh_s:
            prev = latest.get(r["gateway_id"])
            if prev is None or r["at_s"] >= prev["at_s"]:
                latest[r["gateway_id"]] = r
    for r in latest.values():
        for entry in r.get("routes") or []:
            rid = str(entry.get("route_id", ""))
            sessions[rid] = sessions.get(rid, 0) + int(entry.get("sessions", 0))
    per_request: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for gateway, request, node, tokens in recent_usage:
        per_request.setdefault((gateway, request), []).append((node, tokens))
    tokens_by_route: dict[str, int] = {}
    requests_by_route: dict[str, int] = {}
    for entries in per_request.values():
        hops = sorted(
            ((node, *spans[node]) for node, _ in entries if node in spans), key=lambda h: (h[1], h[2])
        )
        if not hops:
            continue
        rid = route_label(hops)
        tokens_by_route[rid] = tokens_by_route.get(rid, 0) + max(t for _, t in entries)
        requests_by_route[rid] = requests_by_route.get(rid, 0) + 1
    out: list[dict[str, Any]] = [
        {
            "route_id": rid,
            "hops": _parse_route(rid),
            "sessions": sessions.get(rid, 0),
            "tokens_per_s": tokens_by_route.get(rid, 0) / window_s,
            "requests": requests_by_route.get(rid, 0),
        }
        for rid in set(sessions) | set(tokens_by_route)
    ]
    out.sort(key=lambda r: (-r["sessions"], -r["tokens_per_s"], r["route_id"]))
    return out[:MAX_ROUTES]


def _parse_route(route_id: str) -> list[dict[str, Any]]:
    hops = []
    for part in route_id.split(">"):
        node, _, span = part.partition("[")
        a, _, b = span.rstrip(")").partition(":")
        try:
            hops.append({"node": node, "start": int(a), "end": int(b)})
        except ValueError:
            hops.append({"node": part, "start": None, "end": None})
    return hops


def series(
    reports: Sequence[Mapping[str, Any]], *, now_s: float, window_s: float, points: int = MAX_SERIES_POINTS
) -> dict[str, list[float | None]]:
    """Per time bucket over the last ``window_s``: generated and prompt tokens per second and
    requests per second (sums over gateways), sessions (sum of each gateway's latest figure in
    the bucket), TTFT p50/p95 (the worst gateway's; None where nothing was observed)."""
    n = max(1, min(points, MAX_SERIES_POINTS))
    bucket = window_s / n
    start = now_s - window_s
    tokens = [0.0] * n
    prompt = [0.0] * n
    requests = [0.0] * n
    errors = [0.0] * n
    sessions_by_gw: list[dict[str, tuple[float, int]]] = [{} for _ in range(n)]
    p50: list[float | None] = [None] * n
    p95: list[float | None] = [None] * n
    for r in reports:
        at = float(r["at_s"])
        i = int((at - start) // bucket)
        if not 0 <= i < n:
            continue
        tokens[i] += r["completion_tokens"] / bucket
        prompt[i] += r["prompt_tokens"] / bucket
        requests[i] += r["requests"] / bucket
        errors[i] += r["errors"] / bucket
        prev = sessions_by_gw[i].get(r["gateway_id"])
        if prev is None or at >= prev[0]:
            sessions_by_gw[i][r["gateway_id"]] = (at, int(r["sessions_active"]))
        for target, key in ((p50, "ttft_p50_s"), (p95, "ttft_p95_s")):
            v = r.get(key)
            if v is not None and math.isfinite(v):
                cur = target[i]
                target[i] = v if cur is None else max(cur, v)
    # Buckets no report fell into are unknown, not zero, unless a gateway reported around them.
    have = [bool(sessions_by_gw[i]) for i in range(n)]
    sessions: list[float | None] = [
        float(sum(v for _, v in sessions_by_gw[i].values())) if have[i] else None for i in range(n)
    ]

    def known(values: list[float]) -> list[float | None]:
        return [round(v, 4) if have[i] else None for i, v in enumerate(values)]

    return {
        "t": [round(start + (i + 1) * bucket, 3) for i in range(n)],
        "tokens_per_s": known(tokens),
        "prompt_tokens_per_s": known(prompt),
        "requests_per_s": known(requests),
        "errors_per_s": known(errors),
        "sessions": sessions,
        "ttft_p50_s": p50,
        "ttft_p95_s": p95,
    }


def _node_row(n: Mapping[str, Any], now_s: float, late_after_s: float) -> dict[str, Any]:
    shard = n.get("shard") or {}
    hw = n.get("hardware") or {}
    state = n["state"]
    age = now_s - float(n["last_seen_s"])
    if state == "live" and age > late_after_s:
        state = "late"
    gpus = hw.get("gpus") or []
    return {
        "node_id": n["node_id"],
        "state": state,
        "region": n.get("region") or "",
        "address": (n.get("addresses") or [""])[0] if not n.get("relay") else "",
        "relay": bool(n.get("relay")),
        "model": shard.get("model_fingerprint"),
        "start": shard.get("start"),
        "end": shard.get("end"),
        "hardware": {
            "cpu_cores": hw.get("cpu_cores"),
            "ram_gb": round(hw.get("ram_bytes", 0) / 2**30, 1),
            "gpus": [g.get("name") for g in gpus],
            "backends": hw.get("backends") or [],
        },
        "decode_ms_per_token": shard.get("decode_ms_per_token"),
        "tokens_per_s": shard.get("tokens_per_s"),
        "active_sessions": shard.get("active_sessions"),
        "max_sessions": shard.get("max_sessions"),
        "queue_depth": shard.get("queue_depth"),
        "kv_used_tokens": shard.get("kv_used_tokens"),
        "kv_free_tokens": shard.get("kv_free_tokens"),
        "kv_pool_tokens": shard.get("kv_pool_tokens"),  # null: the node does not report a pool
        "kv_session_max_tokens": shard.get("kv_session_max_tokens"),
        # Since the node started (null: not reported): sessions preempted, steps refused for want of KV.
        "kv_preemptions": shard.get("kv_preemptions"),
        "kv_refusals": shard.get("kv_refusals"),
        "tokens_served_total": shard.get("tokens_served_total"),
        "version": n.get("software_version"),
        "last_seen_age_s": round(age, 1),
        "reputation": None,  # no reputation system yet
    }


_STATE_ORDER = {"live": 0, "late": 1, "expired": 2, "left": 3}


def build_state(
    *,
    now_s: float,
    tracker_id: str,
    replica_id: str,
    snapshot: SwarmSnapshot,
    nodes: Sequence[Mapping[str, Any]],
    node_counts: Mapping[str, int],
    reports: Sequence[Mapping[str, Any]],
    recent_usage: Sequence[tuple[str, str, str, int]],
    replicas: Sequence[Mapping[str, Any]],
    top_contributors: Mapping[str, Any],
    heartbeat_interval_s: float,
    series_window_s: float,
    unregistered_names: str = "trusted",
) -> dict[str, Any]:
    late_after = LATE_FACTOR * heartbeat_interval_s
    resolved = resolve_names(snapshot, unregistered_names)
    rows = [_node_row(n, now_s, late_after) for n in nodes]
    rows.sort(
        key=lambda r: (_STATE_ORDER.get(r["state"], 9), r["model"] or "", r["start"] or 0, r["node_id"])
    )
    late = frozenset(r["node_id"] for r in rows if r["state"] == "late")
    models = []
    for m in snapshot.models:
        counts = coverage_counts(snapshot, m.fingerprint, m.n_layers, skip=late)
        shards = [
            s for s in snapshot.shards if s.model_fingerprint == m.fingerprint and s.node_id not in late
        ]
        models.append(
            {
                "fingerprint": m.fingerprint,
                "name": m.name,
                "n_layers": m.n_layers,
                "coverage": counts,
                "gaps": gaps(counts),
                "live_nodes": len({s.node_id for s in shards}),
                "spans": sorted([s.start, s.end, s.node_id[:8]] for s in shards)[:MAX_NODE_ROWS],
                "trusted_nodes": len({s.node_id for s in shards if s.trusted}),
            }
        )
    # Which fingerprint each name resolves to, and why (tracker/names.py).
    names = [
        {
            "name": r.name,
            "fingerprint": r.fingerprint,
            "reason": r.reason,
            "registered": r.registered,
            "candidates": r.candidates,
        }
        for r in sorted(resolved.values(), key=lambda r: r.name)
    ][:MAX_NODE_ROWS]
    spans = {s.node_id: (s.start, s.end) for s in snapshot.shards}
    fresh = 3.0 * max(
        [float(r["interval_s"]) for r in reports[-64:]] or [5.0]
    )  # a gateway's routes count while its reports keep coming
    gateways: dict[str, dict[str, Any]] = {}
    for r in reports:
        g = gateways.get(r["gateway_id"])
        if g is None or r["at_s"] >= g["at_s"]:
            gateways[r["gateway_id"]] = {
                "gateway_id": r["gateway_id"],
                "url": r.get("url") or "",
                "at_s": r["at_s"],
                "sessions_active": r["sessions_active"],
                "requests_queued": r["requests_queued"],
                "live": now_s - float(r["at_s"]) <= fresh,
            }
    live_rows = [r for r in rows if r["state"] == "live"]
    return {
        "time": now_s,
        "tracker_id": tracker_id,
        "replica_id": replica_id,
        "replicas": list(replicas),
        "models": models,
        "names": names,
        # "live" counts the nodes heard from recently; "late" the registered-live ones that are not
        "node_counts": {
            **{s: 0 for s in ("live", "expired", "left")},
            **dict(node_counts),
            "live": max(0, int(node_counts.get("live", 0)) - len(late)),
            "late": len(late),
        },
        "nodes": rows[:MAX_NODE_ROWS],
        "nodes_truncated": len(nodes) > MAX_NODE_ROWS,
        "routes": routes_in_use(reports, recent_usage, spans, now_s=now_s, fresh_s=fresh),
        "series": series(reports, now_s=now_s, window_s=series_window_s),
        "gateways": sorted(gateways.values(), key=lambda g: g["gateway_id"]),
        "now": {
            "node_tokens_per_s": round(sum(r["tokens_per_s"] or 0.0 for r in live_rows), 2),
            "node_sessions": sum(r["active_sessions"] or 0 for r in live_rows),
            "gateway_sessions": sum(g["sessions_active"] for g in gateways.values() if g["live"]),
        },
        "top_contributors_24h": top_contributors.get("rows", []),
        "heartbeat_interval_s": heartbeat_interval_s,
    }
