"""Opening a request's Route Session: the route tried (:mod:`gateway.open_plan`), the sessions
opened on every stage (and a spot check's shadow), and what a run leaves behind when it ends.

:meth:`RouteOpener.open` picks a route (:class:`gateway.route_choice.RouteChoice`), OPENs it, and
enters the run on the caller's exit stack; the stack's exit, in order, does the run's bookkeeping
(:meth:`RouteOpener._after_run`: usage to the tracker's queue, measured node speeds, speculation
and check counters, the prefix a warm request keeps), closes the check's sessions and the
primary's (RELEASE, or CANCEL on an error), wakes the KV wait, and frees the route's load count.
A failure to open is invisible to the client: another route is tried.

Every Route Session of the gateway (primary, shadow, judge) is made by :meth:`RouteOpener.session`
with the data plane's settings (:func:`data_plane`), the gateway's OPEN proof, and a span
recovery that finds replacement stages (``gateway/span_finder.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack

import nacl.signing
import trio

from common.logs import event
from gateway.checked import CheckedSession
from gateway.checks import CheckPolicy
from gateway.config import GatewayConfig
from gateway.encodings import FIXED as FIXED_ENCODINGS
from gateway.errors import NoRoute, StageFailed, Unconfirmable
from gateway.gate import KvGate
from gateway.grpc_bridge import NodeChannels
from gateway.jobs import Fork, Job, Progress
from gateway.metrics import Metrics
from gateway.open_plan import AfterOpenFailure, OpenPlan
from gateway.prefix_cache import Hit, PrefixCache, with_tails
from gateway.prompt_plan import sampling_settings
from gateway.protocol import GenerationRequest
from gateway.recovery import RecoveryPolicy, RecoveryReport
from gateway.route_choice import Prepared, RouteChoice
from gateway.route_session import DataPlane, RouteSession, Run, open_route_session
from gateway.routes import NodeInfoCache, Route, RouteCache, StageInfo, frame_limit, step_limit
from gateway.session_machine import HopTimed, StepTimed
from gateway.span_finder import span_finder
from gateway.spot_checks import CheckedJob, SpotChecks
from gateway.trust_report import ObservedSpeed
from proto import codec
from proto.announce import UsageEntry, UsageReport
from proto.signing import public_key_hex, sign_open_proof
from proto.swarm.v1 import frame_pb2

log = logging.getLogger("swarm.gateway")


def data_plane(config: GatewayConfig) -> DataPlane:
    """The data-plane settings of every Route Session this gateway runs."""
    return DataPlane(
        push=config.data_plane == "push",
        encoding=FIXED_ENCODINGS.get(config.activation_encoding, frame_pb2.ENCODING_F32),
        encoding_mode=config.activation_encoding,
        auto_f32_min_mbit_s=config.auto_f32_min_mbit_s,
        auto_int8_below_mbit_s=config.auto_int8_below_mbit_s,
        prefill_pipeline_steps=config.prefill_pipeline_steps,
        recovery_history_bytes=config.recovery_history_bytes,
        open_timeout_s=config.open_timeout_s,
        prefill_step_timeout_s=config.prefill_step_timeout_s,
        decode_step_timeout_s=config.decode_step_timeout_s,
        close_timeout_s=config.close_timeout_s,
    )


class RouteOpener:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: Metrics,
        key: nacl.signing.SigningKey,
        channels: NodeChannels,
        routes: RouteCache,
        node_infos: NodeInfoCache,
        prefix: PrefixCache,
        spot: SpotChecks,
        choice: RouteChoice,
        kv_gate: KvGate,
        usage: trio.MemorySendChannel[UsageReport],
        observed: ObservedSpeed,
        *,
        check_top_logprobs: int,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._key = key
        self.gateway_id = public_key_hex(key)
        self.channels = channels
        self.routes = routes
        self.node_infos = node_infos
        self.prefix = prefix
        self.spot = spot
        self.choice = choice
        self.kv_gate = kv_gate
        self._usage = usage  # bounded: a full queue drops the report (counted)
        self.observed = observed
        self.plane = data_plane(config)
        self.checks = CheckPolicy(config.check_fraction)
        # With checks on, every session asks for the candidates the cross-recipe tolerance compares
        # (checked or not: a node cannot tell); clients get theirs.
        self.check_top_logprobs = check_top_logprobs
        self._rng = random.Random()

    async def open(
        self,
        stack: AsyncExitStack,
        job: Job,
        request: GenerationRequest,
        avoid: frozenset[str] = frozenset(),
        *,
        progress: Progress | None = None,
        fork: Fork | None = None,
    ) -> tuple[Run, Prepared]:
        """Pick a route (see :meth:`_pick`), prepare, OPEN on every stage; the run is entered on
        ``stack`` (it closes the sessions, then does the run's bookkeeping and frees the route).

        Which routes are tried, and what a failure to open one means: :mod:`gateway.open_plan`.
        Nothing was streamed yet, so this is invisible to the client.
        """
        model = job.model_key or request.model
        model_routes = await self.routes.routes(model)
        plan = OpenPlan(
            avoid,
            set(self.spot.avoided()),
            serve_unconfirmed=self.config.unconfirmed_routes == "serve",
            silent=self.spot.avoided_silent(),
        )
        index = progress.index if progress is not None else 0
        while plan.more():
            candidates = [r for r in model_routes.routes if plan.admits(h.node_id for h in r.hops)]
            if not candidates:
                try:
                    model_routes = await self.routes.fetch_excluding(model, frozenset(plan.excluded))
                except NoRoute:
                    if plan.no_route():
                        continue
                    if plan.last_error is None:
                        raise
                    break
                candidates = list(model_routes.routes)
            use_fork = fork if plan.start() else None
            try:
                route, prepared, hit = await self.choice.pick(
                    request,
                    candidates,
                    model=model,
                    client=job.kv_key or job.client,
                    fork=use_fork.chosen() if use_fork is not None else None,
                )
                if progress is not None and progress.generated and self.config.exact_resume:
                    prepared = dataclasses.replace(prepared, replay_from=len(prepared.prompt))
            except StageFailed as err:  # a node of the route picked did not answer Info: another route
                self.routes.invalidate(model)
                self.prefix.forget_node(err.node_id)
                self.spot.note_unreachable(job.request_id, err)
                plan.unreachable(err)
                continue
            attempt = AsyncExitStack()
            attempt.callback(self.routes.release, route)
            try:
                async with attempt:
                    run = await self._enter(
                        attempt, job, request, route, prepared, hit, index, use_fork, plan, fork
                    )
                    stack.push_async_exit(attempt.pop_all())
                    return run, prepared
            except Unconfirmable as err:
                if plan.allow_unconfirmed:
                    raise
                plan.cannot_check(err)  # nothing was generated yet: another route, without them
            except StageFailed as err:
                self.metrics.inc(
                    "swarm_gateway_route_sessions_total",
                    route=self.metrics.route_label(route.route_id),
                    outcome="open_failed",
                )
                event(
                    log,
                    "route_open_failed",
                    request_id=job.request_id,
                    route=route.route_id,
                    node_id=err.node_id,
                    error=err.message,
                )
                if plan.open_failed(err, fork=use_fork is not None) is AfterOpenFailure.FORGET:
                    self.routes.invalidate(model)
                    for hop in route.hops:
                        self.node_infos.forget(hop)
                        self.prefix.forget_node(hop.node_id)
                    self.spot.note_unreachable(job.request_id, err)
        raise plan.give_up()

    async def _enter(
        self,
        stack: AsyncExitStack,
        job: Job,
        request: GenerationRequest,
        route: Route,
        prepared: Prepared,
        hit: Hit | None,
        index: int,
        use_fork: Fork | None,
        plan: OpenPlan,
        fork: Fork | None,
    ) -> Run:
        """OPEN ``route``'s stages (and a spot check's shadow) on ``stack``, whose exit closes them and
        then does the run's bookkeeping (:meth:`_after_run`)."""
        kv_source: tuple[str, int] | None = None
        if hit is not None:
            kv_source = (hit.entry.session_id, hit.positions)
            if hit.shared:
                # Named by whole blocks: ask for the shared positions inside the next block too.
                kv_source = with_tails(kv_source, prepared.prompt, prepared.stages[0].recipe_fingerprint)
        elif (
            use_fork is not None
            and use_fork.route is not None
            and route.hops == use_fork.route.hops
            and len(use_fork.firsts) > index
        ):
            kv_source = (use_fork.session_id, len(prepared.prompt))
        sampling = sampling_settings(
            request,
            seed=job.seed,
            index=index,
            grammar=job.grammar,
            prompt_tokens=len(prepared.prompt),
            check_top_logprobs=self.check_top_logprobs,
        )
        session_id = secrets.token_hex(16)
        warm = self.choice.warm(request)
        step_tokens = step_limit(prepared.stages, self.config.prefill_step_tokens)
        # n > 1 and warm-KV continuations are not checked yet: a shadow route holds neither the
        # forked nor the kept KV (see docs/security.md).
        checkable = request.n == 1 and kv_source is None
        suspects = frozenset(h.node_id for h in route.hops if self.spot.on_probation(h))
        if suspects and not checkable and self.config.unconfirmed_routes == "refuse":
            # Nothing unconfirmed is served: another route without them, or 503 unconfirmable.
            raise Unconfirmable(
                "the route's nodes on probation cannot be checked on this request (n > 1 or kept KV)",
                node_id=min(suspects),
                failed_nodes=suspects,
            )
        checked = checkable and self.checks.wants(self._rng, bool(suspects))
        entered = False

        def freed() -> None:
            if entered:
                self.kv_gate.notify_freed()  # the stages freed (or kept) the session's KV

        stack.callback(freed)
        session = await stack.enter_async_context(
            self.session(
                job,
                request,
                route,
                prepared,
                sampling,
                step_tokens,
                report_steps=checked,
                isolated=self.config.isolates(checked, prepared.vocab.architecture),
                session_id=session_id,
                kv_source=kv_source,
                kv_copy=hit is not None and hit.shared,
                keep_ms=int(self.config.kv_keep_s * 1000) if warm else 0,
            )
        )
        entered = True
        if fork is not None and index == 0:
            fork.route, fork.prepared, fork.session_id = route, prepared, session_id
        if index == 0:
            job.route_label = self.metrics.route_label(route.route_id)
            job.system_fingerprint = "swarm-" + prepared.stages[0].recipe_fingerprint[:16]
        run: Run = session
        if checked:

            def open_check(
                other: Route, stages: Sequence[StageInfo], encodings: Sequence[frame_pb2.Encoding] | None
            ) -> AbstractAsyncContextManager[RouteSession]:
                return self.session(
                    job,
                    request,
                    other,
                    prepared,
                    sampling,
                    step_tokens,
                    report_steps=True,
                    isolated=self.config.isolates(True, prepared.vocab.architecture),
                    stages=stages,
                    encodings=encodings,
                )

            checks = await stack.enter_async_context(AsyncExitStack())
            run = await self.spot.checked(
                checks,
                CheckedJob(job.request_id, job.model_key or request.model),
                route,
                session,
                prepared.stages,
                sampling,
                open_check,
                allow_unconfirmed=plan.allow_unconfirmed,
            )
        stack.callback(self._after_run, job, run, session, route, session_id if warm else None)
        return run

    def _after_run(
        self, job: Job, run: Run, session: RouteSession, route: Route, keep_session_id: str | None
    ) -> None:
        """A run ended (before its sessions close): usage, speculation and check counters, and the
        prefix it keeps (``keep_session_id``: a warm request's session, kept when it finished on its
        first route)."""
        self._report(job, run, route)
        spec = session.machine.statistics()
        if spec.windows:
            self.metrics.inc("swarm_gateway_spec_windows_total", spec.windows)
            self.metrics.inc("swarm_gateway_spec_window_tokens_total", spec.window_tokens)
            self.metrics.inc("swarm_gateway_spec_drafted_tokens_total", spec.drafted)
        if run.relays:
            self.metrics.inc("swarm_gateway_hidden_relays_total", run.relays)
        if isinstance(run, CheckedSession):
            self.spot.done(run)
        if keep_session_id is not None and session.finished and session.recoveries == 0:
            m = session.machine
            self.prefix.put(
                job.kv_key or job.client,
                route.model_fingerprint,
                [h.node_id for h in route.hops],
                keep_session_id,
                m.tokens[: m.committed],
                trio.current_time(),
                exact=m.aligned_prefix,
                step=m.config.step_tokens,
            )

    def session(
        self,
        job: Job,
        request: GenerationRequest,
        route: Route,
        prepared: Prepared,
        sampling: codec.SamplingSettings,
        step_tokens: int,
        *,
        report_steps: bool,
        isolated: bool = False,
        stages: Sequence[StageInfo] | None = None,
        session_id: str | None = None,
        kv_source: tuple[str, int] | None = None,
        kv_copy: bool = False,
        keep_ms: int = 0,
        encodings: Sequence[frame_pb2.Encoding] | None = None,
    ) -> AbstractAsyncContextManager[RouteSession]:
        """One Route Session of this request on ``route`` (the primary, a shadow or a judge).

        ``encodings``: what each stage sends on; by default the data plane's choice for ``route``. A
        check's shadow and judge take the primary's, so honest nodes report the same digests.
        """
        stage_infos = list(stages if stages is not None else prepared.stages)
        return open_route_session(
            self.channels,
            route,
            stage_infos,
            busy_sessions=max(1, int(max(self.routes.sessions_now(route), default=1))),
            session_id=session_id or secrets.token_hex(16),
            request_id=job.request_id,
            sampling=sampling,
            kv_budget_tokens=prepared.kv_budget,
            step_tokens=step_tokens,
            max_frame_bytes=frame_limit(stage_infos, self.config.max_frame_bytes),
            plane=self.plane,
            recovery=RecoveryPolicy(
                span_finder(
                    self.routes, self.node_infos, job.model_key or request.model, route.model_fingerprint
                ),
                on_report=lambda report: self._on_span_recovery(job, report),
            ),
            report_steps=report_steps,
            isolated=isolated,
            kv_source=kv_source,
            kv_copy=kv_copy,
            keep_ms=keep_ms,
            prove_open=self._prove_open,
            on_timing=self._on_timing,
            encodings=encodings,
            single_from=prepared.replay_from,
            max_drafts=self.config.speculation_drafts(
                sampling.temperature,
                request.speculation,
                grammar=bool(sampling.grammar),
                checked=report_steps,
            ),
        )

    def _prove_open(self, node_id: str, frame: frame_pb2.Frame) -> bytes:
        """This gateway's signature over one OPEN to ``node_id`` (tickets name the gateway they were
        issued to; the node opens the session only with this proof; docs/protocol.md)."""
        return sign_open_proof(
            self._key,
            session_id=frame.session_id,
            node_id=node_id,
            route_epoch=int(frame.route_epoch),
            step_id=int(frame.step_id),
            ticket=bytes(frame.open.route_ticket),
            now_s=time.time(),
        )

    def _on_timing(self, timing: StepTimed | HopTimed) -> None:
        """A decode step's round and each stage's share of it, as the Route Session machine saw them
        (every session: spot-check shadows and judges too; their steps are steps of this gateway)."""
        if isinstance(timing, StepTimed):
            self.metrics.observe("swarm_gateway_step_seconds", timing.seconds)
        else:
            self.metrics.observe("swarm_gateway_hop_latency_seconds", timing.seconds)

    def _on_span_recovery(self, job: Job, report: RecoveryReport) -> None:
        outcome = "ok" if report.ok else "failed"
        self.metrics.inc("swarm_gateway_recoveries_total", kind="span", outcome=outcome)
        self.metrics.observe("swarm_gateway_recovery_seconds", report.seconds)
        event(
            log,
            "stage_replaced" if report.ok else "stage_replacement_failed",
            level=logging.INFO if report.ok else logging.WARNING,
            request_id=job.request_id,
            failed_node=report.failed_node,
            replacement_node=report.replacement_node,
            span=list(report.span),
            replayed_positions=report.replayed_positions,
            route_epoch=report.epoch,
            seconds=round(report.seconds, 4),
            error=report.error or None,
        )

    def _report(self, job: Job, session: Run, route: Route) -> None:
        self.observed.record(session, route.model_fingerprint)  # measured node speeds (trust_report)
        if not self.config.report_usage:
            return
        entries = tuple(
            UsageEntry(node_id, tokens, steps) for node_id, tokens, steps in session.usage() if tokens > 0
        )
        if not entries:
            return
        report = UsageReport(self.gateway_id, job.request_id, route.model_fingerprint, entries)
        try:
            self._usage.send_nowait(report)
        except trio.WouldBlock:
            self.metrics.inc("swarm_gateway_usage_reports_total", outcome="dropped")
