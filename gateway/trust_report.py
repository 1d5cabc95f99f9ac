"""What this gateway tells the tracker about trust: spot checks passed, verdicts, measured node speeds.

* **Checks and evidence.** The service's :class:`gateway.node_standing.NodeStanding`
  counts the spot checks each node passed (``checks_passed``) and queues the
  verdicts of disagreements (``evidence``, dicts of ``gateway.checks.evidence``).
  :func:`report_trust_loop` drains both every :data:`REPORT_INTERVAL_S` seconds
  into signed ``POST /v1/checks`` and ``POST /v1/evidence`` calls. A report
  that fails in transit is kept for the next round (the queue is bounded where
  verdicts are added: the oldest are dropped first, counted here as
  ``outcome="dropped"``; at most ``proto.announce.MAX_CHECK_ENTRIES`` nodes per
  checks report); one the tracker refuses (400: malformed, 403: this gateway
  is not registered) is dropped and logged, since sending it again cannot help.
* **Measured speed.** :class:`ObservedSpeed` turns a finished Route
  Session's per-token decode time (its machine's ``ewma_step_s``) into each
  stage's share, by the stages' layer counts, and averages them per node
  until the statistics reporter (``gateway/stats_report.py``) sends them as
  ``GatewayStats.nodes``. The tracker routes with the larger of a node's
  claim and this, so a node claiming to be fast gains nothing. The share
  includes the network time of the route, spread the same way.

Bounded: at most :data:`MAX_OBSERVED_NODES` nodes are averaged between two
reports (others wait for the next interval).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import httpx
import trio

from common.logs import event
from common.tracker_client import TrackerClient, TrackerClientError
from proto.announce import (
    MAX_CHECK_ENTRIES,
    MAX_CHECKS_PER_REPORT,
    MAX_NODE_SPEEDS,
    CheckPass,
    CheckResults,
    Evidence,
    NodeSpeed,
    PayloadError,
)

log = logging.getLogger("swarm.gateway.trust")
REPORT_INTERVAL_S = 2.0
MAX_OBSERVED_NODES = MAX_NODE_SPEEDS


class ObservedSpeed:
    """Per node and model: the sum and count of measured decode shares since the last drain."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, str], tuple[float, int]] = {}

    def record(self, run: Any, model_fingerprint: str) -> None:
        """Fold in a finished run (a Route Session, or a checked run holding several in ``runs``)."""
        sessions: Iterable[Any] = getattr(run, "runs", {}).values() if hasattr(run, "runs") else (run,)
        for session in sessions:
            machine = getattr(session, "machine", None)
            if machine is None:
                continue
            step_s = float(machine.statistics().ewma_step_s)
            stages = list(machine.stages)
            if not stages or math.isnan(step_s) or step_s <= 0:
                continue  # no decode steps measured (a prefill-only request)
            layers = max(s.end for s in stages) - min(s.start for s in stages)
            for stage in stages:
                share_ms = 1000.0 * step_s * (stage.end - stage.start) / max(1, layers)
                k = (stage.node_id, model_fingerprint)
                if k not in self._sums and len(self._sums) >= MAX_OBSERVED_NODES:
                    continue
                total, n = self._sums.get(k, (0.0, 0))
                self._sums[k] = (total + share_ms, n + 1)

    def drain(self) -> tuple[NodeSpeed, ...]:
        out = tuple(
            NodeSpeed(node, model, min(1e7, total / n), n)
            for (node, model), (total, n) in sorted(self._sums.items())
            if n > 0 and total > 0
        )
        self._sums.clear()
        return out


def _evidence(raw: Any) -> Evidence | None:
    try:
        return raw if isinstance(raw, Evidence) else Evidence.from_json(raw)
    except PayloadError as err:
        event(log, "evidence_malformed", level=logging.ERROR, error=str(err))
        return None


async def report_trust_once(service: Any, tracker: TrackerClient, *, timeout_s: float) -> dict[str, int]:
    """One round: the checks passed so far and every queued verdict; returns what was sent."""
    sent = {"checks": 0, "evidence": 0}
    standing = service.standing
    pending: list[Any] = standing.evidence
    while pending:
        item = _evidence(pending[0])
        if item is None:
            pending.pop(0)
            continue
        try:
            with trio.fail_after(timeout_s):
                await tracker.report_evidence(item)
        except TrackerClientError as err:
            if err.status >= 500:
                raise
            pending.pop(0)  # refused for good (malformed, or this gateway is not registered)
            service.metrics.inc("swarm_gateway_trust_reports_total", kind="evidence", outcome="refused")
            event(log, "evidence_refused", level=logging.ERROR, status=err.status, error=str(err))
            continue
        pending.pop(0)
        sent["evidence"] += 1
        service.metrics.inc("swarm_gateway_trust_reports_total", kind="evidence", outcome="ok")
    passed: dict[str, int] = standing.checks_passed
    while passed:
        batch = sorted(passed.items())[:MAX_CHECK_ENTRIES]
        results = CheckResults(
            service.gateway_id, tuple(CheckPass(n, min(c, MAX_CHECKS_PER_REPORT)) for n, c in batch if c > 0)
        )
        for node, _ in batch:
            del passed[node]
        if not results.passed:
            continue
        try:
            with trio.fail_after(timeout_s):
                await tracker.report_checks(results)
        except TrackerClientError as err:
            if err.status >= 500:
                for p in results.passed:  # back for the next round
                    standing.credit(p.node_id, p.checks)
                raise
            service.metrics.inc("swarm_gateway_trust_reports_total", kind="checks", outcome="refused")
            event(log, "checks_refused", level=logging.ERROR, status=err.status, error=str(err))
            continue
        except BaseException:
            for p in results.passed:
                standing.credit(p.node_id, p.checks)
            raise
        sent["checks"] += len(results.passed)
        service.metrics.inc("swarm_gateway_trust_reports_total", kind="checks", outcome="ok")
    return sent


async def report_trust_loop(
    service: Any,
    tracker: TrackerClient,
    *,
    timeout_s: float,
    interval_s: float = REPORT_INTERVAL_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Report checks and verdicts every ``interval_s`` until cancelled (failures retried next round)."""
    task_status.started()
    failing = False
    while True:
        await trio.sleep(interval_s)
        dropped = service.standing.take_evidence_dropped()
        if dropped:
            service.metrics.inc(
                "swarm_gateway_trust_reports_total", dropped, kind="evidence", outcome="dropped"
            )
        try:
            await report_trust_once(service, tracker, timeout_s=timeout_s)
            if failing:
                event(log, "trust_reports_resumed")
            failing = False
        except (TrackerClientError, httpx.HTTPError, trio.TooSlowError) as err:
            service.metrics.inc("swarm_gateway_trust_reports_total", kind="any", outcome="failed")
            if not failing:
                event(log, "trust_report_failed", level=logging.WARNING, error=repr(err))
            failing = True
