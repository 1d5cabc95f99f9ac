"""Spot checks: compare two runs of the same request, find the first step where they part, judge it.

Splits are bit-exact: two honest nodes with the same runtime recipe, given
the same inputs, report the same output digest (stages before the last) and
the same sampled token and logprobs (the last stage), bit for bit. A checked
request therefore runs on two routes with the same layer boundaries and no
node in common -- the *primary* and the *shadow*, each an ordinary Route
Session, so a node cannot tell a check from real traffic -- and every step
report of one is compared with the other's report for the same stage and
positions (:class:`Comparator`).

Where they part, the first divergence (the earliest positions, then the
lowest stage: there, both stages had the same inputs) names two suspects; a
third run, the *judge*, on yet another route, reports the same step, and the
run that disagrees with the judge holds the liar (:func:`verdict`). Pure: no
I/O; the service (``gateway.serving``) runs the sessions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.session_machine import Sampled, StepReport

# (layer boundary, start, end): the layer a stage's output ends at and the step's positions. Runs
# of one request on routes cut alike compare at every stage; runs on routes cut differently (a
# shadow whose nodes together cover a span no other node holds) compare where their boundaries
# meet -- at least the model's end, the sampled token. Callers that give no boundary key by stage.
Key = tuple[int, int, int]


@dataclass(frozen=True)
class CheckPolicy:
    """Which requests are checked: a fraction at random, and every one touching a node on probation."""

    fraction: float = 0.05

    def wants(self, rng: random.Random, on_probation: bool) -> bool:
        return on_probation or rng.random() < self.fraction


def key(report: StepReport, boundary: int | None = None) -> Key:
    return (report.stage if boundary is None else boundary, report.start, report.end)


def _same_sampled(a: Sampled | None, b: Sampled | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.token_id == b.token_id
        and a.logprob == b.logprob
        and a.top_logprobs == b.top_logprobs
        and a.end_of_generation == b.end_of_generation
    )


def agree(a: StepReport, b: StepReport, exact: bool = True) -> bool:
    """Two reports of the same step say the same thing: bit for bit (digest and sampled token with
    its logprobs) when both runs share one runtime recipe; across recipes (another build, other CPU
    features: honest nodes may differ in low-order bits) the same sampled token, its end-of-generation
    flag and the same top candidates' order -- the tolerance (docs/security.md, Heterogeneity)."""
    if exact:
        return a.digest == b.digest and _same_sampled(a.sampled, b.sampled)
    return same_token_tolerant(a.sampled, b.sampled)


def comparable(a: StepReport, b: StepReport, exact: bool = True) -> bool:
    """Whether two reports of one step can be compared: always within a recipe; across recipes only
    where a token was sampled (hidden-state digests of other builds differ in low-order bits)."""
    return exact or (a.sampled is not None and b.sampled is not None)


def same_token_tolerant(a: Sampled | None, b: Sampled | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.token_id == b.token_id and a.end_of_generation == b.end_of_generation


@dataclass(frozen=True)
class Divergence:
    key: Key
    reports: Mapping[str, StepReport]  # run name -> its report of that step


class Comparator:
    """The step reports of several runs of one request, keyed by (stage, positions)."""

    def __init__(
        self, runs: tuple[str, ...] = ("primary", "shadow"), max_reports: int = 200_000, *, exact: bool = True
    ) -> None:
        # exact: every run shares one runtime recipe (bit for bit); else the tolerance of agree().
        self.exact = exact
        self._reports: dict[str, dict[Key, StepReport]] = {run: {} for run in runs}
        self._divergent: set[Key] = set()
        self.compared = 0
        self._max = max_reports

    def add_run(self, run: str) -> None:
        self._reports.setdefault(run, {})

    def drop_run(self, run: str) -> None:
        self._reports.pop(run, None)

    @property
    def runs(self) -> tuple[str, ...]:
        return tuple(self._reports)

    def report(self, run: str, k: Key) -> StepReport | None:
        return self._reports.get(run, {}).get(k)

    def reports(self, run: str) -> list[StepReport]:
        return list(self._reports.get(run, {}).values())

    def keyed(self, run: str) -> list[tuple[Key, StepReport]]:
        return list(self._reports.get(run, {}).items())

    def add(self, run: str, report: StepReport, boundary: int | None = None, *, k: Key | None = None) -> bool:
        """Record a report (at layer ``boundary``, or under key ``k``); True when it disagrees with
        another run's report of the same step."""
        mine = self._reports.get(run)
        if mine is None or sum(len(r) for r in self._reports.values()) >= self._max:
            return False
        k = k if k is not None else key(report, boundary)
        mine[k] = report
        diverged = False
        for other, theirs in self._reports.items():
            if other == run or k not in theirs or not comparable(report, theirs[k], self.exact):
                continue
            self.compared += 1
            if not agree(report, theirs[k], self.exact):
                self._divergent.add(k)
                diverged = True
        return diverged

    def first_divergence(self) -> Divergence | None:
        """The earliest divergent step (by positions, then stage), with every run's report of it."""
        if not self._divergent:
            return None
        k = min(self._divergent, key=lambda k: (k[1], k[0]))
        return Divergence(k, {run: r[k] for run, r in self._reports.items() if k in r})

    def settled_before(self, k: Key, runs: tuple[str, str]) -> bool:
        """Both runs reported every step before ``k`` that either reported (nothing earlier is unknown)."""
        a, b = (self._reports[r] for r in runs)
        common = {x[0] for x in a} & {x[0] for x in b}  # boundaries both runs' routes have
        earlier = {x for x in (*a, *b) if x[0] in common and (x[1], x[0]) < (k[1], k[0])}
        return all(x in a and x in b for x in earlier)


@dataclass(frozen=True)
class Verdict:
    """``liar``: the run whose node lied at ``key`` (node ``node_id``); None: the judge agrees with
    neither (``detail`` says why) -- the request then fails instead of guessing."""

    key: Key
    liar: str | None
    node_id: str
    honest: tuple[str, ...]
    detail: str
    # Reached bit for bit within one runtime recipe. Across recipes (the tolerance) honest nodes
    # part on near-tied tokens now and then (docs/security.md, Heterogeneity): such a verdict
    # drops the run for this request but is no evidence for a ban.
    exact: bool = True


def verdict(divergence: Divergence, judge: StepReport, exact: bool = True) -> Verdict:
    """Decide between the two runs that parted at ``divergence`` with the judge's report of the step."""
    k = divergence.key
    agreeing = [run for run, r in divergence.reports.items() if agree(r, judge, exact)]
    disagreeing = [run for run, r in divergence.reports.items() if not agree(r, judge, exact)]
    if len(agreeing) == 1 and len(disagreeing) == 1:
        liar = disagreeing[0]
        detail = "outvoted by the judge" + ("" if exact else " (across recipes: the sampled token)")
        return Verdict(k, liar, divergence.reports[liar].node_id, tuple(agreeing), detail, exact)
    return Verdict(k, None, "", tuple(agreeing), f"the judge agrees with {agreeing or 'neither run'}", exact)


def trusted_verdict(divergence: Divergence, trusted: frozenset[str], exact: bool = True) -> Verdict | None:
    """No third node can judge (nobody else holds the span): a node on probation that contradicts a
    trusted one is the liar; None when both or neither are trusted (the request then fails)."""
    k = divergence.key
    runs = list(divergence.reports.items())
    if len(runs) != 2:
        return None
    (a, ra), (b, rb) = runs
    if (ra.node_id in trusted) == (rb.node_id in trusted) or ra.node_id == rb.node_id:
        return None
    honest, liar = (a, b) if ra.node_id in trusted else (b, a)
    return Verdict(
        k,
        liar,
        divergence.reports[liar].node_id,
        (honest,),
        "contradicted a trusted node; no third node could judge",
        exact,
    )


def divergence_stage(divergence: Divergence, run: str | None = None) -> int:
    """The stage index (in ``run``'s route, else the lowest) of the disputed step; the divergence's
    key holds the layer boundary, which routes cut differently share."""
    report = divergence.reports.get(run) if run else None
    if report is not None:
        return report.stage
    return min((r.stage for r in divergence.reports.values()), default=0)


def _describe(report: StepReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "node_id": report.node_id,
        "epoch": report.epoch,
        "step_id": report.step_id,
        "digest": report.digest.hex(),
    }
    if report.sampled is not None:
        out["token_id"] = report.sampled.token_id
        out["logprob"] = report.sampled.logprob
        out["top_logprobs"] = [list(p) for p in report.sampled.top_logprobs]
    return out


def evidence(
    gateway_id: str, request_id: str, result: Verdict, divergence: Divergence, judge: StepReport
) -> dict[str, Any]:
    """What a gateway tells the tracker about a verdict (it signs the whole as its own statement)."""
    _layer, start, end = divergence.key
    stage = divergence_stage(divergence, result.liar)
    return {
        "gateway_id": gateway_id,
        "request_id": request_id,
        "liar": result.node_id,
        "conclusive": result.liar is not None and result.exact,
        "stage": stage,
        "positions": [start, end],
        "reports": {run: _describe(r) for run, r in divergence.reports.items()},
        "judge": _describe(judge),
        "detail": result.detail,
        "time": time.time(),
    }
