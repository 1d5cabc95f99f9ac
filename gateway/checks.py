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

Across check fingerprints (another build, other CPU features) honest nodes
differ in low-order bits and, at near ties, in the greedy token: there only the
sampled reports are compared, with the calibrated :class:`Tolerance`, and runs
that part at a tolerated near tie are not compared afterwards
(``Comparator.parted_at``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.session_machine import StepReport
from proto.codec import Sampled

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


# Candidates (top logprobs) the last stage reports on every session while checks are on: what the
# cross-recipe tolerance compares (a near-tied token must be among the other run's candidates).
# Asked for on every session, checked or not, so a node cannot tell a check from other traffic.
CHECK_TOP_LOGPROBS = 4

# The tolerance's margin in nats, calibrated on honest pairs of two real builds (AVX2 and not) and
# the two kernel paths of one build: twice the largest difference any honest pair needed on a
# token both reported, over both bundled models (python -m sim.bench_cross_recipe; docs/security.md,
# Heterogeneity, has the figures and the false-positive and detection rates).
CROSS_RECIPE_MARGIN_NATS = 2.5

# Two reports of one node's own numbers (a token's logprob and the same token among its candidates)
# come from one computation: they agree to float32 rounding on the wire.
_SELF_SLACK = 1e-4
# Probability the candidates' rounded logprobs may miss (so a peaked head bounds the rest at about
# log(1e-3), never at -inf).
_MASS_SLACK = 1e-3


@dataclass(frozen=True)
class Tolerance:
    """When two honest nodes of other recipes (check fingerprints) may report one step differently.

    Other kernels round differently, so across recipes a step's digest differs and, at a near tie,
    so may the greedy token. Two last-stage reports ``a`` and ``b`` of one step (fed the same inputs)
    are *consistent* when:

    1. each is consistent with itself: its token's logprob is the one its candidates give that token
       (or, when the token is not among them, no larger than the smallest candidate); for plain
       greedy sampling its token is its own top candidate;
    2. the heads agree: every token both name (token or candidate) has logprobs within
       ``margin_nats`` in the two, and a token one names above the other's smallest candidate by
       more than the margin is among the other's candidates;
    3. for plain greedy sampling each run's token is within the margin of the other run's top
       logprob -- the runs may part only on a near tie;
    4. the same token ends generation in both or in neither.

    Without candidates (an old node) only the token, its flag and its logprob (within the margin) are
    compared. Pure; the margin is calibrated on honest pairs (``CROSS_RECIPE_MARGIN_NATS``).
    """

    margin_nats: float = CROSS_RECIPE_MARGIN_NATS

    def consistent(self, a: Sampled | None, b: Sampled | None, *, greedy: bool) -> bool:
        if a is None or b is None:
            return a is None and b is None
        if a.token_id == b.token_id and a.end_of_generation != b.end_of_generation:
            return False
        if not (_self_consistent(a, greedy) and _self_consistent(b, greedy)):
            return False
        if not a.top_logprobs or not b.top_logprobs:
            return a.token_id == b.token_id and abs(a.logprob - b.logprob) <= self.margin_nats
        heads_a, heads_b = _heads(a), _heads(b)
        for mine, theirs, other in ((heads_a, heads_b, b), (heads_b, heads_a, a)):
            floor = _floor(other)
            for token, lp in mine.items():
                there = theirs.get(token)
                if there is None:
                    if lp > floor + self.margin_nats:
                        return False  # it would be among the other's candidates were it this likely
                elif abs(lp - there) > self.margin_nats:
                    return False
        if greedy:
            for run, other, other_heads in ((a, b, heads_b), (b, a, heads_a)):
                top = max(other_heads.values())
                there = other_heads.get(run.token_id)
                if there is not None and there < top - self.margin_nats:
                    return False
                if there is None and _floor(other) < top - self.margin_nats:
                    return False  # not among the other's candidates, so already too far below
        return True


def _floor(s: Sampled) -> float:
    """The most a token not among ``s``'s candidates can have: at most the smallest candidate's
    logprob, and at most the probability the candidates leave."""
    lps = [lp for _, lp in s.top_logprobs]
    left = max(0.0, 1.0 - sum(math.exp(lp) for lp in lps)) + _MASS_SLACK
    return min(min(lps), math.log(left))


def _heads(s: Sampled) -> dict[int, float]:
    heads = dict(s.top_logprobs)
    heads.setdefault(s.token_id, s.logprob)
    return heads


def _self_consistent(s: Sampled, greedy: bool) -> bool:
    if not s.top_logprobs:
        return True
    listed = dict(s.top_logprobs)
    lps = [lp for _, lp in s.top_logprobs]
    if any(x < y - _SELF_SLACK for x, y in zip(lps, lps[1:], strict=False)):
        return False  # candidates come in descending order
    if s.token_id in listed:
        if abs(listed[s.token_id] - s.logprob) > _SELF_SLACK:
            return False
    elif s.logprob > min(lps) + _SELF_SLACK:
        return False
    return not greedy or s.logprob >= max(lps) - _SELF_SLACK


def plain_greedy(
    temperature: float,
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: bool = False,
    grammar: bool = False,
) -> bool:
    """Whether the token is the argmax of the logits the logprobs come from (no adjustment): then
    the tolerance's near-tie rule applies."""
    return (
        temperature <= 0.0
        and repetition_penalty == 1.0
        and frequency_penalty == 0.0
        and presence_penalty == 0.0
        and not logit_bias
        and not grammar
    )


def agree(
    a: StepReport,
    b: StepReport,
    exact: bool = True,
    tolerance: Tolerance | None = None,
    *,
    greedy: bool = False,
) -> bool:
    """Two reports of the same step say the same thing: bit for bit (digest and sampled token with
    its logprobs) when both runs share one runtime recipe; across recipes (another build, other CPU
    features: honest nodes may differ in low-order bits) the sampled reports must be consistent
    under ``tolerance`` (:class:`Tolerance`; docs/security.md, Heterogeneity)."""
    if exact:
        return a.digest == b.digest and _same_sampled(a.sampled, b.sampled)
    return (tolerance or Tolerance()).consistent(a.sampled, b.sampled, greedy=greedy)


def comparable(a: StepReport, b: StepReport, exact: bool = True) -> bool:
    """Whether two reports of one step can be compared: always within a recipe; across recipes only
    where a token was sampled (hidden-state digests of other builds differ in low-order bits)."""
    return exact or (a.sampled is not None and b.sampled is not None)


def _parted(a: StepReport, b: StepReport) -> bool:
    return a.sampled is not None and b.sampled is not None and a.sampled.token_id != b.sampled.token_id


@dataclass(frozen=True)
class Divergence:
    key: Key
    reports: Mapping[str, StepReport]  # run name -> its report of that step


class Comparator:
    """The step reports of several runs of one request, keyed by (stage, positions).

    Across recipes (``exact`` False) two honest runs may sample different tokens at a near tie
    (:class:`Tolerance`); from there on they are fed different inputs, so their later steps are not
    compared: ``parted_at`` is the first position fed differently."""

    def __init__(
        self,
        runs: tuple[str, ...] = ("primary", "shadow"),
        max_reports: int = 200_000,
        *,
        exact: bool = True,
        tolerance: Tolerance | None = None,
        greedy: bool = False,
    ) -> None:
        # exact: every run shares one runtime recipe (bit for bit); else the tolerance of agree().
        self.exact = exact
        self.tolerance = tolerance or Tolerance()
        self.greedy = greedy
        self.parted_at: int | None = None
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

    def agree(self, a: StepReport, b: StepReport) -> bool:
        return agree(a, b, self.exact, self.tolerance, greedy=self.greedy)

    def add(self, run: str, report: StepReport, boundary: int | None = None, *, k: Key | None = None) -> bool:
        """Record a report (at layer ``boundary``, or under key ``k``); True when it disagrees with
        another run's report of the same step."""
        mine = self._reports.get(run)
        if mine is None or sum(len(r) for r in self._reports.values()) >= self._max:
            return False
        k = k if k is not None else key(report, boundary)
        mine[k] = report
        if self.parted_at is not None and k[1] >= self.parted_at:
            return False  # the runs were fed different tokens here: nothing to compare
        diverged = False
        for other, theirs in self._reports.items():
            if other == run or k not in theirs or not comparable(report, theirs[k], self.exact):
                continue
            self.compared += 1
            if not self.agree(report, theirs[k]):
                self._divergent.add(k)
                diverged = True
            elif not self.exact and _parted(report, theirs[k]):
                self._part(k[2])
        return diverged

    def _part(self, position: int) -> None:
        if self.parted_at is None or position < self.parted_at:
            self.parted_at = position
            self._divergent = {k for k in self._divergent if k[1] < position}

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


def verdict(
    divergence: Divergence,
    judge: StepReport,
    exact: bool = True,
    tolerance: Tolerance | None = None,
    *,
    greedy: bool = False,
) -> Verdict:
    """Decide between the two runs that parted at ``divergence`` with the judge's report of the step
    (across recipes, ``exact`` False: agreeing means consistent under ``tolerance``)."""
    k = divergence.key
    agreeing = [
        run for run, r in divergence.reports.items() if agree(r, judge, exact, tolerance, greedy=greedy)
    ]
    disagreeing = [run for run in divergence.reports if run not in agreeing]
    if len(agreeing) == 1 and len(disagreeing) == 1:
        liar = disagreeing[0]
        detail = "outvoted by the judge" + ("" if exact else " (across recipes: the calibrated tolerance)")
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
