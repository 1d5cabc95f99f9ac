"""What this gateway knows of nodes' standing (pure; the caller passes the clock): whom it routes
around, the spot checks each passed here, and what waits to go to the tracker.

* **Avoided.** A node caught lying is avoided until a deadline (``exclude_liars_s``, shorter across
  recipes); a node that was silent when dialled (dead, not the node announced) for
  ``avoid_unreachable_s``. :meth:`NodeStanding.avoided` drops expired entries as it answers.
* **Passes.** Checks each node passed as seen by this gateway: a node leaves probation here after
  ``probation_checks`` of them (:meth:`NodeStanding.on_probation`; the tracker's flag counts too).
* **For the tracker.** Checks passed since the last report (``POST /v1/checks``), verdicts
  (``POST /v1/evidence``; gateway/trust_report.py drains both) and silent nodes (named in the next
  statistics report, gateway/stats_report.py).

Bounded: at most ``max_nodes`` nodes in each table (the least recently touched go first: a node
forgotten by the pass table is on probation here again, the safe side), at most
``max_evidence`` queued verdicts (the oldest dropped first, counted in ``evidence_dropped``), at
most ``max_unreported`` silent nodes per statistics report.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

MAX_NODES = 4096
MAX_PENDING_EVIDENCE = 256
MAX_UNREACHABLE_REPORTED = 64  # node ids waiting for the next statistics report (proto.announce)


def _touch(table: OrderedDict[str, Any], key: str, value: Any, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


class NodeStanding:
    def __init__(
        self,
        *,
        max_nodes: int = MAX_NODES,
        max_evidence: int = MAX_PENDING_EVIDENCE,
        max_unreported: int = MAX_UNREACHABLE_REPORTED,
    ) -> None:
        if min(max_nodes, max_evidence, max_unreported) < 1:
            raise ValueError("NodeStanding bounds must be >= 1")
        self.max_nodes = max_nodes
        self.max_evidence = max_evidence
        self.max_unreported = max_unreported
        self._liars: OrderedDict[str, float] = OrderedDict()  # node id -> avoided until (clock time)
        self._silent: OrderedDict[str, float] = OrderedDict()
        self._passes: OrderedDict[str, int] = OrderedDict()  # node id -> checks passed here, ever
        # To the tracker (drained by the reporters; what a failed report puts back stays bounded).
        self.checks_passed: OrderedDict[str, int] = OrderedDict()  # since the last checks report
        self.evidence: list[dict[str, Any]] = []  # verdicts (gateway.checks.evidence), oldest first
        self.evidence_dropped = 0
        self.unreachable_to_report: set[str] = set()

    # -- whom to route around -----------------------------------------------------------------

    def avoid_liar(self, node_id: str, until: float) -> None:
        _touch(self._liars, node_id, until, self.max_nodes)

    def avoid_silent(self, node_id: str, until: float | None) -> None:
        """A node silent when dialled: avoided until ``until`` (None: not avoided), and named to the
        tracker in the next statistics report."""
        if until is not None:
            _touch(self._silent, node_id, until, self.max_nodes)
        if len(self.unreachable_to_report) < self.max_unreported:
            self.unreachable_to_report.add(node_id)

    def avoided(self, now: float) -> frozenset[str]:
        """The nodes this gateway routes around now: caught lying, or silent when last dialled."""
        for table in (self._liars, self._silent):
            for node, until in list(table.items()):
                if until <= now:
                    del table[node]
        return frozenset(self._liars) | frozenset(self._silent)

    def avoided_silent(self, now: float) -> frozenset[str]:
        """The nodes routed around only for being silent when last dialled (not caught lying)."""
        return self.avoided(now) & frozenset(self._silent) - frozenset(self._liars)

    # -- checks -------------------------------------------------------------------------------

    def passed(self, node_ids: Iterable[str]) -> None:
        """Each of ``node_ids`` passed one spot check here."""
        for node in node_ids:
            _touch(self._passes, node, self._passes.get(node, 0) + 1, self.max_nodes)
            self.credit(node, 1)

    def credit(self, node_id: str, checks: int) -> None:
        """``checks`` passed checks of ``node_id`` to report (again, after a failed report)."""
        _touch(self.checks_passed, node_id, self.checks_passed.get(node_id, 0) + checks, self.max_nodes)

    def passes(self, node_id: str) -> int:
        return self._passes.get(node_id, 0)

    def on_probation(self, node_id: str, tracker_says: bool, needed: int) -> bool:
        """On probation here: the tracker flags it, or this gateway saw it pass fewer than ``needed``
        checks (``needed`` 0: nothing is, a swarm whose operator trusts every node)."""
        return needed > 0 and (tracker_says or self.passes(node_id) < needed)

    # -- for the tracker ------------------------------------------------------------------------

    def add_evidence(self, item: dict[str, Any]) -> None:
        self.evidence.append(item)
        if len(self.evidence) > self.max_evidence:
            dropped = len(self.evidence) - self.max_evidence
            del self.evidence[:dropped]
            self.evidence_dropped += dropped

    def take_evidence_dropped(self) -> int:
        """Verdicts dropped since the last call (the queue was full)."""
        out, self.evidence_dropped = self.evidence_dropped, 0
        return out

    def take_unreachable(self) -> tuple[str, ...]:
        """The silent nodes to name in this statistics report (each once)."""
        out = tuple(sorted(self.unreachable_to_report))
        self.unreachable_to_report.clear()
        return out
