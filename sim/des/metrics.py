"""What a run measures, and the summary statistics over it.

Counting rule (conservation): every request that arrived is, at the end, in
exactly one of ``completed``, ``failed`` (with a reason) or ``in_flight`` (by
phase). :meth:`Metrics.request_counts` states it and the tests check it.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Series:
    t_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    active_sessions: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    recovering: list[int] = field(default_factory=list)
    serving_nodes: list[int] = field(default_factory=list)
    # per model: one row per sample, one count of serving shards per layer
    coverage: list[list[list[int]]] = field(default_factory=list)


class Metrics:
    def __init__(self, n_models: int) -> None:
        self.arrived = 0
        self.completed = 0
        self.failed: Counter[str] = Counter()
        self.tokens_delivered = 0
        self.ttft_s = array("d")
        self.inter_token_s = array("d")
        self.e2e_s = array("d")
        self.recoveries = 0  # stage losses repaired (session resumed)
        self.recovery_lost_s = 0.0  # outage time summed over those repairs
        self.recovery_durations_s = array("d")
        self.recovery_attempts = 0
        self.replayed_tokens = 0
        self.stages_per_session: Counter[int] = Counter()  # route length at admission
        self.series = Series(coverage=[[] for _ in range(n_models)])
        self._tokens_at_last_sample = 0

    # -- events -------------------------------------------------------------
    def token(self) -> None:
        self.tokens_delivered += 1

    def fail(self, reason: str) -> None:
        self.failed[reason] += 1

    def recovered(self, lost_s: float) -> None:
        self.recoveries += 1
        self.recovery_lost_s += lost_s
        self.recovery_durations_s.append(lost_s)

    def sample(
        self,
        t_s: float,
        interval_s: float,
        active: int,
        queued: int,
        recovering: int,
        serving_nodes: int,
        coverage: list[list[int]],
    ) -> None:
        s = self.series
        s.t_s.append(round(t_s, 6))
        s.tokens_per_s.append((self.tokens_delivered - self._tokens_at_last_sample) / interval_s)
        self._tokens_at_last_sample = self.tokens_delivered
        s.active_sessions.append(active)
        s.queued.append(queued)
        s.recovering.append(recovering)
        s.serving_nodes.append(serving_nodes)
        for m, row in enumerate(coverage):
            s.coverage[m].append(row)

    # -- summaries ------------------------------------------------------------
    def request_counts(self, in_flight_by_phase: dict[str, int]) -> dict[str, object]:
        in_flight = sum(in_flight_by_phase.values())
        failed = sum(self.failed.values())
        return {
            "arrived": self.arrived,
            "completed": self.completed,
            "failed": failed,
            "failed_by_reason": dict(sorted(self.failed.items())),
            "in_flight": in_flight,
            "in_flight_by_phase": dict(sorted(in_flight_by_phase.items())),
            "conserved": self.arrived == self.completed + failed + in_flight,
            # of the requests that ended, the share that completed
            "success_rate": round(self.completed / (self.completed + failed), 6)
            if self.completed + failed
            else None,
        }


def percentiles(values: array[float], scale: float = 1.0) -> dict[str, float | int | None]:
    if len(values) == 0:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "mean": None}
    a = np.frombuffer(values, dtype=np.float64) * scale
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"n": len(values), "p50": _r(p50), "p95": _r(p95), "p99": _r(p99), "mean": _r(a.mean())}


def gini(values: list[float]) -> float | None:
    """0 = perfectly even, towards 1 = all load on one node."""
    if not values:
        return None
    a = np.sort(np.asarray(values, dtype=np.float64))
    n = a.size
    total = a.sum()
    if total <= 0:
        return 0.0
    cum = np.cumsum(a)
    return _r((n + 1 - 2 * cum.sum() / total) / n)


def _r(x: float) -> float:
    return round(float(x), 6)
