"""A checked request: the same request on two routes at once; a token reaches the client once both agree.

:class:`CheckedSession` has the interface of a :class:`~gateway.route_session.RouteSession`
(``begin``, ``next_token``, ``finished``, ``usage``), so the service runs a
checked request like any other. Underneath, a *primary* and a *shadow* Route
Session -- ordinary sessions on routes with the same layer boundaries and no
node in common, started with ``report_steps`` -- compute the same request
(same prompt, same seed). Every step report goes into a
:class:`~gateway.checks.Comparator`; token i is released only when both runs
produced it with the same logprobs and no step so far disagreed. Across recipes
(check fingerprints) "the same" is the calibrated tolerance
(:class:`~gateway.checks.Tolerance`), and where the runs sample different tokens
at a near tie it accepts, the check ends: one run goes on alone (``_part``).

On a disagreement the first divergent step is judged by a third run on yet
another route (``open_judge``); the run that disagrees with the judge is
dropped (CANCEL), its node reported (``on_verdict``: evidence to the tracker,
exclusion here), and the request goes on with the two runs that agree -- so
the client never receives a token after a mismatch was seen that two routes
did not both produce. When the judge agrees with neither, or no judge can be
found, the request fails cleanly (:class:`CheckFailed`). When the shadow
fails for an ordinary reason (a node died), the request goes on unchecked.

The judge runs on nodes of neither run when the swarm has them, else on any
nodes but the two in dispute at the divergent stage.

Bounds: at most three runs; the judge is given ``judge_timeout_s`` to reach the
divergent step; reports are kept per run up to the comparator's bound.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field

import trio

from common.logs import event
from gateway.checks import (
    Comparator,
    Divergence,
    Tolerance,
    Verdict,
    divergence_stage,
    trusted_verdict,
    verdict,
)
from gateway.errors import GatewayError, UpstreamFailed
from gateway.route_session import RouteSession
from gateway.session_machine import StepReport
from proto.codec import Sampled

log = logging.getLogger("swarm.gateway.checks")

SETTLE_TIMEOUT_S = 5.0  # waiting for the reports before a divergence before judging it


class CheckFailed(UpstreamFailed):
    """Two routes disagree and no judge could tell which one lied: no answer is better than a wrong one."""

    default_code = "check_failed"


# (nodes to avoid) -> an async context manager yielding a Route Session on a third route.
JudgeOpener = Callable[[frozenset[str]], AbstractAsyncContextManager[RouteSession]]


@dataclass
class CheckStats:
    compared_steps: int = 0
    divergences: int = 0
    verdicts: list[Verdict] = field(default_factory=list)
    unchecked_since: int | None = None  # token index from which the request ran unchecked
    # Across recipes: the token index where the runs sampled different tokens the tolerance accepts
    # (a near tie); the request went on with the primary alone, unchecked from there.
    parted_at: int | None = None


class CheckedSession:
    def __init__(
        self,
        primary: RouteSession,
        shadow: RouteSession,
        *,
        stack: AsyncExitStack,
        open_judge: JudgeOpener,
        on_verdict: Callable[[Verdict, Divergence, StepReport], None],
        judge_timeout_s: float = 120.0,
        trusted: frozenset[str] = frozenset(),
        numerics: dict[str, str] | None = None,
        tolerance: Tolerance | None = None,
        greedy: bool = False,
    ) -> None:
        # Across recipes the runs are compared with ``tolerance``; ``greedy``: plain greedy sampling
        # (the tolerance's near-tie rule applies, gateway.checks.plain_greedy).
        self._tolerance = tolerance or Tolerance()
        self._greedy = greedy
        # Node id -> what it must share with another to be compared bit for bit (the recipe's check
        # fingerprint: CPU features included); nodes missing here count by their stage's recipe.
        self._numerics = numerics if numerics is not None else {}
        self.runs: dict[str, RouteSession] = {"primary": primary, "shadow": shadow}
        # Nodes in both runs (the rest of a route shared with a shadow that replaces the suspects):
        # they saw the same inputs twice, so agreement proves nothing about them.
        self.shared = frozenset(primary.node_ids) & frozenset(shadow.node_ids)
        self._trusted = trusted  # nodes whose word decides when no third node can judge
        self.comparator = self._comparator(("primary", "shadow"), self._one_recipe())
        self.stats = CheckStats()
        self._stack = stack
        self._open_judge = open_judge
        self._on_verdict = on_verdict
        self._judge_timeout_s = judge_timeout_s
        self._tokens: dict[str, list[Sampled]] = {"primary": [], "shadow": []}
        self._delivered = 0
        self._diverged = False
        self._reported = trio.Event()
        self._prompt: list[int] = []
        self._retired: list[RouteSession] = []
        for name, session in self.runs.items():
            self._listen(name, session)

    # -- the RouteSession interface ---------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.runs.values())

    @finished.setter
    def finished(self, value: bool) -> None:
        for s in self.runs.values():
            s.finished = value

    @property
    def recoveries(self) -> int:
        return sum(s.recoveries for s in self.runs.values())

    @property
    def relays(self) -> int:
        return sum(s.relays for s in [*self.runs.values(), *self._retired])

    @property
    def route_epoch(self) -> int:
        return self.runs["primary"].route_epoch

    @property
    def node_ids(self) -> list[str]:
        return [n for s in self.runs.values() for n in s.node_ids]

    @property
    def checked_node_ids(self) -> list[str]:
        """The nodes this check compared with other nodes (not those both runs shared)."""
        return [n for n in dict.fromkeys(self.node_ids) if n not in self.shared]

    @property
    def reused(self) -> int:
        return 0  # a checked run never starts from kept KV: the shadow route holds none

    def usage(self) -> list[tuple[str, int, int]]:
        return [u for s in [*self.runs.values(), *self._retired] for u in s.usage()]

    async def begin(self, prompt: Sequence[int]) -> None:
        self._prompt = list(prompt)
        for session in self.runs.values():
            await session.begin(self._prompt)

    async def begin_choice(self, prompt: Sequence[int], first: Sampled) -> None:
        raise RuntimeError("n > 1 requests are not spot-checked: the shadow route holds no forked KV")

    async def next_token(self) -> Sampled:
        """The next token both runs agree on (see the module docstring)."""
        while True:
            if self._diverged:
                await self._judge()
                continue
            i = self._delivered
            while missing := [n for n in self.runs if len(self._tokens[n]) <= i]:
                name = missing[0]
                try:
                    self._tokens[name].append(await self.runs[name].next_token())
                except GatewayError:
                    if len(self.runs) == 1:
                        raise
                    self._lose(name)  # renames the survivor "primary": look again
            if self._diverged:
                continue
            names = list(self.runs)
            first = self._tokens[names[0]][i]
            others = [self._tokens[n][i] for n in names[1:]]
            if any(not self._same(first, other) for other in others):
                if not self.comparator.exact and all(self._tolerated(first, o) for o in others):
                    # An honest near tie across recipes: go on with one run (see _part).
                    first = self._tokens[await self._part()][i]
                else:
                    self._diverged = True  # the last stage's step reports say where; judge it
                    continue
            self._delivered += 1
            return first

    # -- internals ----------------------------------------------------------------------------------------

    def _same(self, a: Sampled, b: Sampled) -> bool:
        if self.comparator.exact:
            return _same_token(a, b)
        return a.token_id == b.token_id and self._tolerated(a, b)

    def _tolerated(self, a: Sampled, b: Sampled) -> bool:
        return self._tolerance.consistent(a, b, greedy=self._greedy)

    def _comparator(self, runs: tuple[str, ...], exact: bool) -> Comparator:
        return Comparator(runs, exact=exact, tolerance=self._tolerance, greedy=self._greedy)

    async def _part(self) -> str:
        """The runs sampled different tokens the tolerance accepts (two recipes at a near tie): from
        here on they are fed different inputs and cannot be compared. One run goes on alone, the
        others are released: the primary, unless it has nodes on probation and another run has
        none -- then that run's token is delivered and its run goes on, so what the client gets
        unchecked from here comes from trusted nodes. Returns the survivor's name (its tokens)."""
        keep = "primary"
        if not self._all_trusted(self.runs["primary"]):
            keep = next((n for n, s in self.runs.items() if self._all_trusted(s)), "primary")
        for name in [n for n in self.runs if n != keep]:
            session = self.runs.pop(name)
            self._retired.append(session)
            await session.close(release=True)
            session.abort()
        self.comparator = _renamed(self.comparator, keep, "primary")
        if keep != "primary":
            self.runs = {"primary": self.runs.pop(keep)}
            self._tokens["primary"] = self._tokens[keep]
            self._listen("primary", self.runs["primary"])
        self.stats.parted_at = self._delivered
        self.stats.unchecked_since = self._delivered
        event(log, "check_parted", tokens=self._delivered, kept=keep)
        return "primary"

    def _all_trusted(self, session: RouteSession) -> bool:
        return all(n in self._trusted for n in session.node_ids)

    def _one_recipe(self, *extra: RouteSession) -> bool:
        """Every stage of every run shares one runtime recipe: compare bit for bit (else tolerantly)."""
        sessions = [*self.runs.values(), *extra]
        kinds = {
            self._numerics.get(st.node_id, st.recipe_fingerprint) for s in sessions for st in s.machine.stages
        }
        return len(kinds) <= 1

    def _listen(self, name: str, session: RouteSession) -> None:
        def on_step(report: StepReport) -> None:
            stages = session.machine.stages
            # Keyed by the layer the stage's output ends at: routes cut differently meet there.
            boundary = stages[report.stage].end if 0 <= report.stage < len(stages) else -1 - report.stage
            if (
                name in self.comparator.runs
                and self.comparator.add(name, report, boundary)
                and name != "judge"
            ):
                self._diverged = True
                self.stats.divergences += 1
            self.stats.compared_steps = self.comparator.compared
            self._reported.set()
            self._reported = trio.Event()

        session.on_step = on_step

    def _lose(self, name: str) -> None:
        """A run failed on its own (a node died and could not be replaced): go on without it."""
        session = self.runs.pop(name)
        self.comparator.drop_run(name)
        self._retired.append(session)
        if name == "primary":
            self.runs = {"primary": self.runs.pop("shadow")}
            self._tokens["primary"] = self._tokens.pop("shadow")
            self.comparator = _renamed(self.comparator, "shadow", "primary")
        self.stats.unchecked_since = self._delivered
        event(log, "check_abandoned", level=logging.WARNING, run=name, tokens=self._delivered)

    async def _wait_report(self, timeout_s: float, ready: Callable[[], bool]) -> bool:
        with trio.move_on_after(timeout_s):
            while not ready():
                await self._reported.wait()
            return True
        return False

    async def _judge(self) -> None:
        pair = ("primary", "shadow")
        div = self.comparator.first_divergence()
        if div is None:  # tokens differ but no step report yet says where: wait for them
            await self._wait_report(SETTLE_TIMEOUT_S, lambda: self.comparator.first_divergence() is not None)
            div = self.comparator.first_divergence()
            if div is None:
                raise CheckFailed("two routes produced different tokens and no stage report says where")
        first = div.key
        await self._wait_report(SETTLE_TIMEOUT_S, lambda: self.comparator.settled_before(first, pair))
        div = self.comparator.first_divergence() or div  # it only gets earlier
        try:
            judge = await self._open_judge_for(div)
        except CheckFailed:
            # Nobody else holds the span: a node on probation contradicting a trusted one loses.
            result = trusted_verdict(div, self._trusted, self.comparator.exact)
            if result is None:
                raise
            await self._convict(result, div, div.reports[result.honest[0]], judge=None)
            return
        self.comparator.exact = self.comparator.exact and self._one_recipe(judge)
        self.comparator.add_run("judge")
        self._tokens["judge"] = []
        self._listen("judge", judge)
        await judge.begin(self._prompt)

        def judged() -> bool:
            return self.comparator.report("judge", div.key) is not None

        async def pull_judge_tokens() -> None:
            # The judge must run up to the divergent step: read its tokens meanwhile.
            while not judged():
                self._tokens["judge"].append(await judge.next_token())

        with trio.move_on_after(self._judge_timeout_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull_judge_tokens)
                await self._wait_report(self._judge_timeout_s, judged)
                nursery.cancel_scope.cancel()
        if not judged():
            raise CheckFailed(
                f"the judge did not reach the divergent step within {self._judge_timeout_s:g} s"
            )
        judge_report = self.comparator.report("judge", div.key)
        assert judge_report is not None  # judged() said so
        result = verdict(div, judge_report, self.comparator.exact, self._tolerance, greedy=self._greedy)
        await self._convict(result, div, judge_report, judge=judge)

    async def _convict(
        self, result: Verdict, div: Divergence, judge_report: StepReport, *, judge: RouteSession | None
    ) -> None:
        """Act on a verdict: drop the liar's run and go on with the honest one (checked by the
        judge's run when there is one, alone when a trusted node's word decided)."""
        self.stats.verdicts.append(result)
        self._on_verdict(result, div, judge_report)
        if result.liar is None:
            raise CheckFailed(f"two routes disagree at layer {div.key[0]} and the judge sides with neither")
        liar = self.runs.pop(result.liar)
        await liar.close(release=False)
        liar.abort()
        self._retired.append(liar)
        honest = result.honest[0]
        old = self.comparator
        if judge is None:
            self.runs = {"primary": self.runs[honest]}
            self._tokens = {"primary": self._tokens[honest]}
            self.comparator = self._comparator(("primary",), old.exact)
            for k, report in old.keyed(honest):
                self.comparator.add("primary", report, k=k)
            self.stats.unchecked_since = self._delivered
        else:
            # Go on with the two runs that agree: the honest one leads, the judge checks it.
            self.runs = {"primary": self.runs[honest], "shadow": judge}
            self._tokens = {"primary": self._tokens[honest], "shadow": self._tokens["judge"]}
            self.comparator = self._comparator(("primary", "shadow"), self._one_recipe())
            for k, report in old.keyed(honest):
                self.comparator.add("primary", report, k=k)
            for k, report in old.keyed("judge"):
                self.comparator.add("shadow", report, k=k)
            self._listen("shadow", judge)
        self._listen("primary", self.runs["primary"])
        self._diverged = self.comparator.first_divergence() is not None
        event(
            log,
            "liar_excluded",
            level=logging.WARNING,
            node_id=result.node_id,
            stage=divergence_stage(div, result.liar),
            layer=div.key[0],
            positions=[div.key[1], div.key[2]],
            tokens_delivered=self._delivered,
        )

    async def _open_judge_for(self, div: Divergence) -> RouteSession:
        """A third run: on nodes of neither run if the swarm has them, else on none of the two nodes
        in dispute (the stages before them agreed, so sharing those proves nothing wrong)."""
        stage = div.key[0]
        everyone = frozenset(self.node_ids)
        disputants = frozenset(r.node_id for r in div.reports.values())
        error: GatewayError | None = None
        for avoid in (everyone, disputants):
            try:
                return await self._stack.enter_async_context(self._open_judge(avoid))
            except GatewayError as err:
                error = err
        assert error is not None
        raise CheckFailed(
            f"two routes disagree at layer {stage} and no third route can judge: {error.message}"
        ) from error


def _same_token(a: Sampled, b: Sampled) -> bool:
    return (
        a.token_id == b.token_id
        and a.logprob == b.logprob
        and a.top_logprobs == b.top_logprobs
        and a.end_of_generation == b.end_of_generation
    )


def _renamed(old: Comparator, src: str, dst: str) -> Comparator:
    new = Comparator((dst,), exact=old.exact, tolerance=old.tolerance, greedy=old.greedy)
    new.parted_at = old.parted_at
    for k, report in old.keyed(src):
        new.add(dst, report, k=k)
    return new
