"""Spot checks, the gateway's side: which nodes it avoids or still checks, the shadow and judge
routes of a checked run, and what a verdict or a passed check does (a shell around the pure
:mod:`gateway.checks` and :class:`gateway.checked.CheckedSession`, its state in
:class:`gateway.node_standing.NodeStanding`).

* **Who is checked.** A node is on probation while the tracker flags it or this gateway saw it
  pass fewer than ``probation_checks`` checks; a route with such a node is always checked, others
  at ``check_fraction`` (:class:`gateway.checks.CheckPolicy`, decided by the caller).
* **Shadow and judge.** :meth:`SpotChecks.other_route` picks the route to compare with (see its
  docstring); :meth:`SpotChecks.checked` opens the shadow beside the primary and hands both to a
  :class:`CheckedSession`, which opens a judge on a disagreement. Without a shadow, a route whose
  nodes are all trusted runs unchecked; one with nodes on probation raises
  :class:`gateway.errors.Unconfirmable` (the caller tries another route, and runs it unconfirmed
  only when none is left).
* **Afterwards.** A verdict that names a liar avoids it for ``exclude_liars_s`` (at most 600 s
  across recipes) and queues the evidence for the tracker; a passed check credits the nodes it
  checked; a node silent when dialled is avoided for ``avoid_unreachable_s`` and named to the
  tracker (:meth:`SpotChecks.note_unreachable`).

The service opens Route Sessions; this module only asks for them (``open_session``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from common.logs import event
from gateway.checked import CheckedSession
from gateway.checks import Divergence, Tolerance, Verdict, divergence_stage, evidence, plain_greedy
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, NoRoute, StageBusy, StageFailed, Unconfirmable
from gateway.metrics import Metrics
from gateway.node_standing import NodeStanding
from gateway.route_session import RouteSession, Run
from gateway.routes import Hop, NodeInfoCache, Route, RouteCache, StageInfo
from gateway.session_machine import StepReport
from proto import codec
from proto.swarm.v1 import frame_pb2

log = logging.getLogger("swarm.gateway")

# Opens this request's Route Session on a route to compare with: (route, its stages' infos, the
# encodings each stage sends on -- None: the data plane's choice).
OpenSession = Callable[
    [Route, Sequence[StageInfo], Sequence[frame_pb2.Encoding] | None],
    AbstractAsyncContextManager[RouteSession],
]


@dataclass(frozen=True)
class CheckedJob:
    """What a check needs of its request."""

    request_id: str
    model: str  # the name the routes are cached under


class SpotChecks:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: Metrics,
        routes: RouteCache,
        node_infos: NodeInfoCache,
        gateway_id: str,
        *,
        standing: NodeStanding | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.routes = routes
        self.node_infos = node_infos
        self.gateway_id = gateway_id
        # Liars and silent nodes avoided, checks passed here, what waits to go to the tracker (bounded).
        self.standing = standing if standing is not None else NodeStanding()
        self._clock = clock

    async def other_route(
        self,
        model: str,
        like: Route,
        avoid: frozenset[str],
        suspects: frozenset[str] | None = None,
    ) -> tuple[Route, list[StageInfo]]:
        """A route to check ``like`` against (a shadow or a judge), best first.

        Without ``suspects`` (a judge): none of ``avoid``'s nodes. With them (a shadow): it must
        replace at least one suspect (every node of ``like`` when there are none), and the more
        suspects it replaces the better; nodes it shares with ``like`` saw the same inputs twice
        and are not checked by it. Then one runtime recipe with ``like`` (bit-for-bit comparison;
        across recipes the tolerance of :func:`gateway.checks.agree`). Among equals: the same layer
        boundaries first (every stage compares), then no node of ``avoid`` at all; a route cut
        otherwise -- nodes that together cover a span nobody else holds -- compares where the
        boundaries meet (at least the sampled token)."""
        spans = [(h.start, h.end) for h in like.hops]
        liars = self.avoided()
        nodes = [h.node_id for h in like.hops]
        strict = suspects is None
        everyone = frozenset(nodes)
        # What the route must replace: a judge none of avoid; a shadow the suspects, else (when no
        # route replaces one: they hold spans nobody else does) any node it can.
        wants = [avoid] if suspects is None else [w for w in (suspects, everyone) if w]

        async def recipes(route: Route) -> list[StageInfo] | None:
            try:
                return [await self.node_infos.get(h, like.model_fingerprint) for h in route.hops]
            except StageFailed:  # a node that does not answer cannot check anything
                return None

        mine = await recipes(like)
        own = {st.check_fingerprint or st.recipe_fingerprint for st in mine or ()}

        async def best_of(
            pool: list[Route], wanted: frozenset[str]
        ) -> tuple[tuple[int, ...], Route, list[StageInfo]] | None:
            best: tuple[tuple[int, ...], Route, list[StageInfo]] | None = None
            for candidate in pool:
                ids = {h.node_id for h in candidate.hops}
                if [h.node_id for h in candidate.hops] == nodes or ids & liars or (strict and ids & avoid):
                    continue
                replaced = len(wanted - ids)
                if replaced == 0:
                    continue
                same = [(h.start, h.end) for h in candidate.hops] == spans
                stages = await recipes(candidate)
                if stages is None:
                    continue
                # One recipe on both runs: compared bit for bit; else with the tolerance of
                # gateway.checks.agree (weaker), so a shadow of the primary's recipe comes first.
                theirs = {st.check_fingerprint or st.recipe_fingerprint for st in stages}
                one_recipe = int(len(own | theirs) == 1)
                score = (int(replaced == len(wanted)), one_recipe, replaced, int(same), int(not ids & avoid))
                if best is None or score > best[0]:
                    best = (score, candidate, stages)
            return best

        pool = list((await self.routes.routes(model)).routes)
        found = await best_of(pool, wants[0])
        if found is None or found[0] != (1, 1, len(wants[0]), 1, 1):
            try:  # a fresh look-up may know better routes than the cached ones
                pool += (
                    await self.routes.fetch_excluding(model, (avoid if strict else frozenset()) | liars)
                ).routes
            except NoRoute:
                pass
        for wanted in wants:
            found = await best_of(pool, wanted)
            if found is not None:
                return found[1], found[2]
        raise NoRoute(f"no other route covering the layers {spans} that could check this one")

    async def checked(
        self,
        stack: AsyncExitStack,
        job: CheckedJob,
        route: Route,
        primary: RouteSession,
        primary_stages: Sequence[StageInfo],
        sampling: codec.SamplingSettings,
        open_session: OpenSession,
        *,
        allow_unconfirmed: bool = True,
    ) -> Run:
        """The request also runs on a shadow route (spot check). Without one: unchecked when every
        node of the route is trusted or ``allow_unconfirmed``; else :class:`Unconfirmable`, naming
        the route's nodes on probation (the caller takes another route). ``open_session`` opens
        this request's Route Session on another route (a shadow or a judge; entered on ``stack``)."""
        primary_nodes = frozenset(h.node_id for h in route.hops)
        suspects = frozenset(h.node_id for h in route.hops if self.on_probation(h))
        same_encodings = primary.machine.config.encodings

        def encodings_for(other: Route) -> Sequence[frame_pb2.Encoding] | None:
            # Honest nodes report the same digests only when fed alike: the primary's encodings
            # where the routes are cut alike; a route cut otherwise sends at the data plane's choice.
            same = [(h.start, h.end) for h in other.hops] == [(h.start, h.end) for h in route.hops]
            return same_encodings if same else None

        try:
            shadow_route, stages = await self.other_route(job.model, route, primary_nodes, suspects)
            shadow = await stack.enter_async_context(
                open_session(shadow_route, stages, encodings_for(shadow_route))
            )
        except GatewayError as err:
            if suspects and not allow_unconfirmed:
                self.metrics.inc("swarm_gateway_checks_total", outcome="unconfirmable")
                event(
                    log,
                    "route_unconfirmable",
                    request_id=job.request_id,
                    suspects=sorted(suspects),
                    reason=err.message,
                )
                raise Unconfirmable(
                    f"no route can check the node(s) on probation of this route: {err.message}",
                    node_id=sorted(suspects)[0],
                    failed_nodes=suspects,
                ) from err
            self.metrics.inc("swarm_gateway_checks_total", outcome="no_shadow")
            event(log, "check_skipped", request_id=job.request_id, reason=err.message)
            return primary
        hops = {h.node_id: h for h in (*route.hops, *shadow_route.hops)}
        trusted = frozenset(n for n, h in hops.items() if not self.on_probation(h))
        # Node id -> Recipe.check_fingerprint: the runs compare bit for bit only where all share one.
        numerics = {
            st.node_id: st.check_fingerprint or st.recipe_fingerprint for st in (*primary_stages, *stages)
        }

        @asynccontextmanager
        async def open_judge(avoid: frozenset[str]) -> AsyncIterator[RouteSession]:
            judge_route, judge_stages = await self.other_route(job.model, route, avoid)
            numerics.update(
                {st.node_id: st.check_fingerprint or st.recipe_fingerprint for st in judge_stages}
            )
            async with open_session(judge_route, judge_stages, encodings_for(judge_route)) as judge:
                yield judge

        self.metrics.inc("swarm_gateway_checks_total", outcome="started")
        if len(set(numerics.values())) > 1:
            self.metrics.inc("swarm_gateway_cross_recipe_checks_total")
        return CheckedSession(
            primary,
            shadow,
            stack=stack,
            open_judge=open_judge,
            on_verdict=lambda v, d, r: self._on_verdict(job, v, d, r),
            judge_timeout_s=self.config.check_judge_timeout_s,
            trusted=trusted,
            numerics=numerics,
            tolerance=Tolerance(self.config.cross_recipe_margin_nats),
            greedy=plain_greedy(
                sampling.temperature,
                repetition_penalty=sampling.repetition_penalty,
                frequency_penalty=sampling.frequency_penalty,
                presence_penalty=sampling.presence_penalty,
                logit_bias=bool(sampling.logit_bias),
                grammar=bool(sampling.grammar),
            ),
        )

    def on_probation(self, hop: Hop) -> bool:
        """Always checked: the tracker says so, or this gateway has not seen it pass enough checks
        (``probation_checks`` 0: nothing is, a swarm whose operator trusts every node). A node the
        tracker's operator lists in ``trusted_nodes`` (``operator_trusted``) is not."""
        if hop.operator_trusted and not hop.probation:
            return False
        return self.standing.on_probation(hop.node_id, hop.probation, self.config.probation_checks)

    def avoided(self) -> frozenset[str]:
        """The nodes this gateway routes around: caught lying, or silent when last dialled."""
        return self.standing.avoided(self._clock())

    def avoided_silent(self) -> frozenset[str]:
        """The nodes this gateway routes around only for being silent when last dialled (not liars)."""
        return self.standing.avoided_silent(self._clock())

    def note_unreachable(self, request_id: str, err: StageFailed) -> None:
        """A node failed before its session opened without answering an error of its own (dead,
        silent, not the node announced): route around it for a while and tell the tracker. An
        address that answered at once with another certificate than announced (``answered``) only
        loses this request's route: it cost no time, and the node may announce its real one again."""
        if err.remote is not None or err.answered or isinstance(err, StageBusy) or not err.node_id:
            return
        avoid_s = self.config.avoid_unreachable_s
        self.standing.avoid_silent(err.node_id, self._clock() + avoid_s if avoid_s > 0 else None)
        self.metrics.inc("swarm_gateway_unreachable_nodes_total")
        event(
            log,
            "node_unreachable",
            level=logging.WARNING,
            request_id=request_id,
            node_id=err.node_id,
            avoid_s=self.config.avoid_unreachable_s,
            error=err.message[:300],
        )

    def _on_verdict(
        self, job: CheckedJob, result: Verdict, divergence: Divergence, judge: StepReport
    ) -> None:
        if result.liar is None:
            self.metrics.inc("swarm_gateway_checks_total", outcome="inconclusive")
        else:
            self.metrics.inc("swarm_gateway_checks_total", outcome="liar_caught")
            # Across recipes a verdict may be an honest near-tie: avoided a while, not for a day.
            avoid_s = self.config.exclude_liars_s if result.exact else min(self.config.exclude_liars_s, 600.0)
            self.standing.avoid_liar(result.node_id, self._clock() + avoid_s)
            self.routes.invalidate(job.model)
        event(
            log,
            "spot_check_verdict",
            level=logging.WARNING,
            request_id=job.request_id,
            liar=result.node_id or None,
            stage=divergence_stage(divergence, result.liar),
            layer=divergence.key[0],
            positions=[divergence.key[1], divergence.key[2]],
            detail=result.detail,
        )
        self.standing.add_evidence(evidence(self.gateway_id, job.request_id, result, divergence, judge))

    def done(self, run: CheckedSession) -> None:
        """A checked run ended: credit the nodes it checked, or count why not."""
        stats = run.stats
        passed = stats.divergences == 0 and stats.unchecked_since is None and stats.compared_steps > 0
        if passed:
            self.metrics.inc("swarm_gateway_checks_total", outcome="passed")
            self.standing.passed(run.checked_node_ids)  # not nodes both runs shared: nothing checked them
        elif stats.parted_at is not None:
            # Two recipes parted at a near tie the tolerance accepts: nobody accused, nobody credited.
            self.metrics.inc("swarm_gateway_checks_total", outcome="parted")
        elif stats.unchecked_since is not None:
            self.metrics.inc("swarm_gateway_checks_total", outcome="abandoned")
