"""Sessions the tracker handed out recently: load that no heartbeat has reported yet.

Routing prices a shard by the load its node last reported (``active_sessions``, a
heartbeat interval old at worst). Between two heartbeats, every look-up would see the
same idle node and send its gateway there; so the tracker counts what it hands out
and routing adds it as ``extra_sessions`` (:func:`tracker.routing.select_routes`).
A look-up of ``k`` routes counts as one session spread over them (``1 / k`` per route:
a gateway places one session per route it asks for, and keeps the rest as spares).
A node's count ends with its next heartbeat (its report now includes what came), or
after ``max_age_s`` whatever happens.

Pure (no I/O, no clock: times are passed in) and bounded: at most ``max_nodes`` nodes
are counted, the oldest counts going first.
"""

from __future__ import annotations

from collections.abc import Iterable


class HandoutLedger:
    def __init__(self, max_age_s: float, max_nodes: int = 100_000) -> None:
        if max_age_s <= 0 or max_nodes < 1:
            raise ValueError("max_age_s must be > 0 and max_nodes >= 1")
        self.max_age_s = max_age_s
        self.max_nodes = max_nodes
        self._counts: dict[str, tuple[float, float]] = {}  # node id -> (sessions, since_s); oldest first

    def record(self, routes: Iterable[Iterable[str]], now_s: float) -> None:
        """One look-up's answer (the node ids of each route) was handed out at ``now_s``."""
        chosen = [tuple(r) for r in routes]
        if not chosen:
            return
        share = 1.0 / len(chosen)
        for route in chosen:
            for node in dict.fromkeys(route):
                sessions, since = self._counts.pop(node, (0.0, now_s))
                self._counts[node] = (sessions + share, since)
        while len(self._counts) > self.max_nodes:
            del self._counts[next(iter(self._counts))]

    def reported(self, node_id: str) -> None:
        """``node_id``'s heartbeat arrived: its load figures include what was handed out."""
        self._counts.pop(node_id, None)

    def extra(self, now_s: float) -> dict[str, float]:
        """Node id -> sessions handed out there and not reported yet (older counts are dropped)."""
        for node in [n for n, (_c, since) in self._counts.items() if now_s - since > self.max_age_s]:
            del self._counts[node]
        return {n: c for n, (c, _since) in self._counts.items()}

    def __len__(self) -> int:
        return len(self._counts)


__all__ = ["HandoutLedger"]
