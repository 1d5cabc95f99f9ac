"""The gateway's logic: one OpenAI request -> admission -> route -> Route Session -> events.

Each request runs as a *job*, a task in the service's own nursery, started
with ``nursery.start``: everything that can refuse the request (admission,
unknown model, no route, prompt past the context, OPEN refused on every
route) happens before the job reports ``started``, so it reaches the HTTP
handler as an exception and becomes a status code. After that the job sends
events (text deltas with their logprobs, then one final event) through a
bounded memory channel; the handler streams them out (SSE) or collects them.
If the client goes away the handler cancels the job, and leaving the Route
Session sends CANCEL to every stage (their KV is freed at once).

After every session the per-node token counts go to a bounded queue that a
background task reports to the tracker (signed usage reports).

n > 1: choice 0 prefills the prompt once; its last stage draws every choice's
first token from the same logits (choice ``i`` with seed ``seed + i``), and
choices 1..n-1 then open on the same route with a KV source naming choice 0's
session (each stage copies the prompt's KV) and continue from their first
token. Each choice equals a separate request with its seed. A choice whose
copy is refused (the route is full) prefills the prompt itself and draws the
same first token.

Warm conversations: a request that finished normally asks its stages to keep
its KV for ``kv_keep_s`` (RELEASE ``keep_ms``) and is recorded in the
:class:`gateway.prefix_cache.PrefixCache` under its client; the next request of
that client whose prompt starts with those tokens opens on the same route with
a KV source and prefills only the rest (docs/gateway.md, Warm conversations).
"""

from __future__ import annotations

import logging
import secrets
from contextlib import AsyncExitStack
from typing import NoReturn

import httpx
import nacl.signing
import trio

from common.logs import event
from gateway import structured, tools
from gateway.access import Access, anonymous_limits
from gateway.admission import AdmissionPolicy, KvWaitPolicy
from gateway.api_keys import AuthPolicy, Principal
from gateway.catalog import ModelCatalog
from gateway.checks import (
    CHECK_TOP_LOGPROBS,
)
from gateway.config import GatewayConfig
from gateway.conversations import ConversationLimits, ConversationStore
from gateway.errors import (
    GatewayError,
    InternalFailure,
    KvExhausted,
    Overloaded,
    Preempted,
    StageBusy,
    StageFailed,
)
from gateway.gate import Gate, KvGate, KvWaiter
from gateway.generation import Event, Failed, Finished
from gateway.grpc_bridge import NodeChannels
from gateway.jobs import Fork, Job, Progress, Reply, deliver
from gateway.metrics import Labels, Metrics
from gateway.prefix_cache import PrefixCache
from gateway.protocol import GenerationRequest
from gateway.route_choice import Prepared, RouteChoice
from gateway.route_opener import RouteOpener
from gateway.route_plan import Ended, Next, RoutePlan
from gateway.route_session import Run
from gateway.routes import (
    NodeInfoCache,
    RouteCache,
)
from gateway.spot_checks import SpotChecks
from gateway.textstream import TextStream
from gateway.tracker_key import TrackerKey
from gateway.trust_report import ObservedSpeed
from gateway.vocab_store import VocabStore
from proto.announce import UsageReport
from proto.codec import Sampled
from proto.signing import public_key_hex
from proto.swarm.v1 import status_pb2
from tracker.client import TrackerClient, TrackerClientError

log = logging.getLogger("swarm.gateway")
EVENT_BUFFER = 16
VOCAB_TIMEOUT_S = 30.0  # one vocabulary download (megabytes), not a first answer: its own bound


def _recoverable(err: StageFailed) -> bool:
    """A failure another route can fix: the stream broke or timed out, or the node's hint is not NONE."""
    remote = err.remote
    if remote is None:
        return True
    return getattr(remote, "retry", status_pb2.RETRY_NONE) != status_pb2.RETRY_NONE


def _ended(err: GatewayError, opened: bool) -> Ended:
    """A failed Route Session as the route plan sees it."""
    if isinstance(err, KvExhausted):
        return Ended("kv_exhausted", opened)
    if isinstance(err, Preempted) or (isinstance(err, StageBusy) and err.kv_short):
        return Ended("preempted", opened)
    if isinstance(err, StageFailed):
        return Ended("stage", opened, _recoverable(err), frozenset(err.failed_nodes))
    return Ended("other", opened)


class _WaitForKv(Exception):
    """Internal: the request has to wait for KV room before it tries the routes again."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class GatewayService:
    def __init__(
        self,
        config: GatewayConfig,
        tracker: TrackerClient,
        key: nacl.signing.SigningKey,
        channels: NodeChannels,
        metrics: Metrics | None = None,
        *,
        tracker_key: TrackerKey,
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.gateway_id = public_key_hex(key)
        self._key = key
        self.channels = channels
        self.metrics = metrics or Metrics()
        self.gate = Gate(
            AdmissionPolicy(config.max_sessions, config.max_queue, config.max_sessions_per_client),
            queue_timeout_s=config.queue_timeout_s,
        )
        self.kv_gate = KvGate(
            KvWaitPolicy(config.max_kv_waiters), wait_s=config.kv_wait_s, retry_s=config.kv_retry_s
        )
        self.routes = RouteCache(
            tracker,
            k=config.routes_k,
            ttl_s=config.route_ttl_s,
            tracker_timeout_s=config.tracker_timeout_s,
            metrics=self.metrics,
            tracker_key=tracker_key,
        )
        self.node_infos = NodeInfoCache(
            channels, ttl_s=config.node_info_ttl_s, timeout_s=config.dial_timeout_s
        )
        self.vocabs = VocabStore(config.resolved_data_dir() / "vocab", channels, timeout_s=VOCAB_TIMEOUT_S)
        self.access = Access(
            config.resolved_api_keys_file(),
            AuthPolicy(
                config.allow_anonymous,
                anonymous_limits(config.anonymous_max_tokens, config.anonymous_tokens_per_minute),
            ),
            self.metrics,
        )
        self._usage_send, self._usage_receive = trio.open_memory_channel[UsageReport](config.usage_queue_max)
        self.observed = ObservedSpeed()
        self._nursery: trio.Nursery | None = None
        self._active = 0
        self.prefix = PrefixCache(
            ttl_s=max(0.0, config.kv_keep_s - 1.0),
            min_tokens=config.prefix_min_tokens,
            exact=config.prefix_exact,
            share_min_tokens=config.prefix_share_min_tokens,
        )
        self.conversations = ConversationStore(
            ConversationLimits(
                max_per_owner=config.conversations_per_key,
                max_total=config.conversations_max,
                idle_ttl_s=config.conversation_ttl_s,
                max_chars=config.conversation_max_chars,
            )
        )
        self.catalog = ModelCatalog(config, self.tracker, self.vocabs)
        self.spot = SpotChecks(config, self.metrics, self.routes, self.node_infos, self.gateway_id)
        self.standing = self.spot.standing  # read by the trust and statistics reporters
        self.choice = RouteChoice(
            config,
            self.metrics,
            self.routes,
            self.node_infos,
            self.vocabs,
            self.prefix,
            self.spot,
            lambda: self.kv_gate.policy.retry_after_s(),
        )
        checks_on = config.check_fraction > 0 or config.probation_checks > 0
        self.opener = RouteOpener(
            config,
            self.metrics,
            key,
            channels,
            self.routes,
            self.node_infos,
            self.prefix,
            self.spot,
            self.choice,
            self.kv_gate,
            self._usage_send,
            self.observed,
            check_top_logprobs=CHECK_TOP_LOGPROBS if checks_on else 0,
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the jobs and the usage reporter until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.config.report_usage:
                    nursery.start_soon(self._report_usage_loop)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.vocabs.close()

    async def _report_usage_loop(self) -> None:
        async for report in self._usage_receive:
            try:
                with trio.fail_after(self.config.tracker_timeout_s):
                    await self.tracker.report_usage(report)
                self.metrics.inc("swarm_gateway_usage_reports_total", outcome="ok")
            except (TrackerClientError, httpx.HTTPError, trio.TooSlowError) as err:
                self.metrics.inc("swarm_gateway_usage_reports_total", outcome="failed")
                event(
                    log,
                    "usage_report_failed",
                    level=logging.WARNING,
                    request_id=report.request_id,
                    error=repr(err),
                )

    def gauges(self) -> dict[str, dict[Labels, float]]:
        stats = self.gate.statistics()
        inflight: dict[Labels, float] = {
            (("route", self.metrics.route_label(r)),): float(n) for r, n in self.routes.inflight().items()
        }
        cached: dict[Labels, float] = {
            (("model", m),): float(n) for m, n in self.routes.cached_counts().items()
        }
        return {
            "swarm_gateway_sessions_active": {(): float(stats.active)},
            "swarm_gateway_requests_queued": {(): float(stats.queued)},
            "swarm_gateway_kv_waiting": {(): float(self.kv_gate.statistics().waiting)},
            "swarm_gateway_route_inflight_sessions": inflight,
            "swarm_gateway_routes_cached": cached,
            "swarm_gateway_conversations_live": {(): float(len(self.conversations))},
        }

    # ------------------------------------------------------------------ jobs

    async def start_job(
        self,
        request: GenerationRequest,
        client: str,
        principal: Principal | None = None,
        *,
        kv_key: str = "",
        reply: Reply | None = None,
    ) -> Job:
        """Admit and open the request's Route Session; raises GatewayError if it cannot start.

        ``principal`` (from :class:`gateway.access.Access`) is held to its quotas: 429 at its
        limit of sessions or tokens per minute; the tokens the request used count when it ends.
        ``kv_key``: whose kept KV the request reuses (a conversation's), else the client's;
        ``reply``: records choice 0's answer as it goes out."""
        if self._nursery is None:
            raise Overloaded("the gateway is shutting down", retry_after_s=5)
        prefix = "chatcmpl-" if request.kind == "chat" else "cmpl-"
        if request.tools_active:
            structured.check_tool_schemas(request.tools)
        grammar = structured.grammar_for(request)  # a schema it cannot enforce is a 400 here
        model_key = await self.catalog.resolve(request.model)
        send, receive = trio.open_memory_channel[Event](EVENT_BUFFER * request.n)
        job = Job(
            request=request,
            client=client,
            request_id=prefix + secrets.token_hex(12),
            events=receive,
            cancel_scope=trio.CancelScope(),
            model_key=model_key,
            seed=request.seed if request.seed is not None else secrets.randbits(63),
            grammar=grammar,
            principal=principal,
            stall_s=self.config.client_stall_s,
            kv_key=kv_key,
            reply=reply,
        )
        try:
            await self._nursery.start(self._run_job, job, send)
        except BaseException:
            receive.close()
            raise
        return job

    async def prompt_fits(self, request: GenerationRequest) -> bool:
        """Whether the request's prompt plus max_tokens fits a route of its model now (a
        conversation's compaction asks this before a turn; see :meth:`RouteChoice.fits`)."""
        return await self.choice.fits(request, await self.catalog.resolve(request.model))

    async def _run_job(
        self,
        job: Job,
        send: trio.MemorySendChannel[Event],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The job under its principal's quotas (a refusal is a 429 before anything else)."""
        if job.principal is None:
            await self._run_job_admitted(job, send, task_status=task_status)
            return
        try:
            self.access.begin(job.principal)
        except GatewayError as err:
            self.metrics.inc("swarm_gateway_rejections_total", reason=err.code or err.type)
            raise
        try:
            await self._run_job_admitted(job, send, task_status=task_status)
        finally:
            self.access.end(job.principal, job.prompt_tokens + job.completion_tokens)

    async def _run_job_admitted(
        self,
        job: Job,
        send: trio.MemorySendChannel[Event],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        request = job.request
        arrived = trio.current_time()
        progresses = [self._progress(request, i) for i in range(request.n)]
        failure: GatewayError | None = None
        async with send:
            with job.cancel_scope:
                try:
                    async with self.gate.slot(job.client):
                        # Admitted: the wait in the gate (0 when a slot was free at once).
                        waited = trio.current_time() - arrived
                        self.metrics.observe("swarm_gateway_queue_wait_seconds", waited)
                        if request.n == 1:
                            # Finished goes out from inside the session (before RELEASE).
                            await self._run_sessions(job, send, progresses[0], arrived, task_status)
                        else:
                            await self._run_choices(job, send, progresses, arrived, task_status)
                            await deliver(
                                job,
                                send,
                                Finished(
                                    progresses[0].finish_reason,
                                    progresses[0].prompt_tokens,
                                    sum(len(p.generated) for p in progresses),
                                ),
                            )
                    return
                except GatewayError as err:
                    if not progresses[0].started:
                        self.metrics.inc("swarm_gateway_rejections_total", reason=err.code or err.type)
                        raise
                    failure = err
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the client stopped reading
                except Exception as err:
                    event(log, "job_failed", level=logging.ERROR, request_id=job.request_id, error=repr(err))
                    log.exception("job %s failed", job.request_id)
                    if not progresses[0].started:
                        raise InternalFailure("internal error while starting the request") from err
                    failure = InternalFailure("internal error while generating")
                finally:
                    job.prompt_tokens = progresses[0].prompt_tokens
                    job.completion_tokens = sum(len(p.generated) for p in progresses)
            if job.cancel_scope.cancelled_caught and not job.final_delivered:
                if job.stalled:
                    self.metrics.inc("swarm_gateway_client_stalls_total")
                    event(
                        log,
                        "client_stalled",
                        level=logging.WARNING,
                        request_id=job.request_id,
                        stall_s=job.stall_s,
                        completion_tokens=job.completion_tokens,
                    )
                else:
                    self.metrics.inc("swarm_gateway_client_disconnects_total")
                    event(log, "client_disconnected", request_id=job.request_id)
                return
            if failure is not None:
                self.metrics.inc(
                    "swarm_gateway_route_sessions_total", route=job.route_label, outcome="failed"
                )
                with trio.move_on_after(1):
                    try:
                        await send.send(Failed(failure, progresses[0].prompt_tokens, job.completion_tokens))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    def _progress(self, request: GenerationRequest, index: int) -> Progress:
        stream = tools.ToolStream(request.tools) if request.tools_active else None
        plan = RoutePlan(max_preemptions=self.config.max_preemptions, wait_for_kv=self.config.kv_wait_s > 0)
        return Progress(TextStream(request.stop), index=index, tool_stream=stream, plan=plan)

    async def _run_choices(
        self,
        job: Job,
        send: trio.MemorySendChannel[Event],
        progresses: list[Progress],
        arrived: float,
        task_status: trio.TaskStatus[None],
    ) -> None:
        """n > 1: choice 0 first; once its first tokens exist the other choices fork its KV."""
        fork = Fork()
        others = len(progresses) - 1

        async def choice(i: int) -> None:
            try:
                await self._run_sessions(job, send, progresses[i], arrived, trio.TASK_STATUS_IGNORED, fork)
            finally:
                fork.mark_opened(progresses[i], others)

        async def first(*, task_status: trio.TaskStatus[None]) -> None:
            await self._run_sessions(job, send, progresses[0], arrived, task_status, fork)

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(first)
                task_status.started()
                await fork.ready.wait()
                for i in range(1, len(progresses)):
                    nursery.start_soon(choice, i)
        except BaseExceptionGroup as group:
            # One choice's failure is the request's: the first gateway error, else the first error.
            leaves = list(group.exceptions)
            while any(isinstance(e, BaseExceptionGroup) for e in leaves):
                leaves = [
                    x for e in leaves for x in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])
                ]
            chosen = next((e for e in leaves if isinstance(e, GatewayError)), leaves[0])
            raise chosen from None

    async def _run_sessions(
        self,
        job: Job,
        send: trio.MemorySendChannel[Event],
        progress: Progress,
        arrived: float,
        task_status: trio.TaskStatus[None],
        fork: Fork | None = None,
    ) -> None:
        """Run one choice on a route; if a stage fails mid-generation, continue on another route.

        Recovery replays the token history (prompt and every token streamed so
        far) as prefill on a route without the failed node, then decoding
        continues where it stopped: the client's stream just pauses. At most
        ``MAX_ROUTE_RECOVERIES`` times per choice, and only for failures a new
        route can fix (a broken stream, a node error whose hint is not NONE).

        KV. A request that fits a route's context but no route's free KV now
        (``KvExhausted`` before the session opened) waits in the KV wait
        (:class:`gateway.gate.KvGate`, at most ``kv_wait_s``) and tries again
        when first in line. A session a node preempts (``Preempted``: its KV
        freed for an older session) keeps its tokens, waits the same way and
        is resumed by the same replay as a recovery, on whichever route has
        room; at most ``max_preemptions`` times, and the node is not avoided.
        """
        waiter: KvWaiter | None = None
        try:
            while True:
                try:
                    await self._run_once(job, send, progress, arrived, task_status, fork, waiter)
                    return
                except _WaitForKv as wait:
                    waiter = await self._kv_turn(job, progress, waiter, wait.error)
        finally:
            if waiter is not None:
                self._kv_left(waiter)

    async def _kv_turn(
        self, job: Job, progress: Progress, waiter: KvWaiter | None, error: GatewayError
    ) -> KvWaiter:
        """Enter the KV wait (or stay in it) and wait for this request's turn to try the routes again;
        KvExhausted when the wait is full or ``kv_wait_s`` passed."""
        if waiter is None or not self.kv_gate.policy.is_waiting(waiter.ticket):
            try:
                waiter = self.kv_gate.enter()
            except KvExhausted:
                self.metrics.inc("swarm_gateway_kv_waits_total", outcome="rejected")
                if progress.preempted_since is not None:
                    self.metrics.inc("swarm_gateway_preemptions_total", outcome="failed")
                raise
            event(
                log, "kv_wait", request_id=job.request_id, choice=progress.index, reason=error.message[:300]
            )
        try:
            # A preemption's retry_after hint is not slept: the wait itself is the pause (until another
            # session ends, at most kv_retry_s), and the node answers again if it still has no room.
            await waiter.turn()
        except KvExhausted:
            self.metrics.inc("swarm_gateway_kv_waits_total", outcome="timed_out")
            self.metrics.observe("swarm_gateway_kv_wait_seconds", self.config.kv_wait_s)
            if progress.preempted_since is not None:
                self.metrics.inc("swarm_gateway_preemptions_total", outcome="failed")
            raise
        # The announced free KV is as old as the route cache: look again (the first in line only).
        self.routes.invalidate(job.model_key or job.request.model)
        return waiter

    def _kv_left(self, waiter: KvWaiter) -> None:
        if self.kv_gate.policy.is_waiting(waiter.ticket):
            waited = trio.current_time() - waiter.entered
            self.metrics.inc("swarm_gateway_kv_waits_total", outcome="served" if waiter.served else "left")
            self.metrics.observe("swarm_gateway_kv_wait_seconds", waited)
        self.kv_gate.leave(waiter)

    async def _run_once(
        self,
        job: Job,
        send: trio.MemorySendChannel[Event],
        progress: Progress,
        arrived: float,
        task_status: trio.TaskStatus[None],
        fork: Fork | None,
        waiter: KvWaiter | None,
    ) -> None:
        """The body of :meth:`_run_sessions` until it succeeds, fails for good or has to wait for KV
        (``_WaitForKv``); route-level recoveries loop here."""
        request = job.request
        index = progress.index
        while True:
            in_body = False
            failed_before = progress.last_failure
            try:
                async with AsyncExitStack() as stack:
                    session, prepared = await self.opener.open(
                        stack, job, request, frozenset(progress.plan.avoid), progress=progress, fork=fork
                    )
                    in_body = True
                    if waiter is not None:
                        waiter.served = True
                        self._kv_left(waiter)
                        waiter = None
                    if index > 0 and fork is not None:
                        fork.mark_opened(progress, len(fork.firsts) - 1)
                    if index == 0 and not progress.started and self.choice.warm(request):
                        job.reused_tokens = session.reused
                        outcome = "hit" if session.reused else "miss"
                        self.metrics.inc("swarm_gateway_prefix_reuse_total", outcome=outcome)
                        if session.reused:
                            self.metrics.inc("swarm_gateway_prefix_reused_tokens_total", session.reused)
                    if not progress.started:
                        progress.started = True
                        progress.prompt_tokens = len(prepared.prompt)
                        if index == 0:
                            self.metrics.inc("swarm_gateway_prompt_tokens_total", progress.prompt_tokens)
                            task_status.started()
                    reason = await self._generate(job, session, prepared, send, arrived, progress, fork)
                    session.finished = True
                    progress.finish_reason = reason
                    if index == 0:
                        done = trio.current_time()
                        self.metrics.inc(
                            "swarm_gateway_route_sessions_total", route=job.route_label, outcome="ok"
                        )
                        self.metrics.observe("swarm_gateway_session_seconds", done - arrived)
                        tokens = len(progress.generated)
                        if job.ttft_s is not None and tokens >= 2:
                            # Per request (vLLM's TPOT): the time after the first token over the rest.
                            self.metrics.observe(
                                "swarm_gateway_time_per_output_token_seconds",
                                (done - arrived - job.ttft_s) / (tokens - 1),
                            )
                    if fork is None:
                        # The client gets its last chunk now; RELEASE to the stages follows on the way out.
                        await deliver(
                            job, send, Finished(reason, progress.prompt_tokens, len(progress.generated))
                        )
                    if fork is not None and index == 0 and len(fork.firsts) > 1:
                        # Choice 0's KV is the others' source: keep it until they have opened.
                        with trio.move_on_after(self.config.open_timeout_s):
                            await fork.all_opened.wait()
                return
            except GatewayError as err:
                step = progress.plan.after(_ended(err, in_body))
                if step is Next.WAIT_FOR_KV:
                    if in_body:
                        # Preempted, or a stage had no room for the next step: the session was released
                        # on every stage; wait for room and resume it by re-prefill (counted, bounded).
                        self._preempted(job, progress, err)
                    raise _WaitForKv(err) from err  # (else it fits a context, not the free KV now)
                if step is Next.TOO_MANY_PREEMPTIONS:
                    self._too_many_preemptions(progress, err)
                if step is Next.GIVE_UP_EARLIER and failed_before is not None:
                    # No route to continue on: the client hears about the failure that stopped it.
                    raise failed_before from err
                if step is not Next.RETRY or not isinstance(err, StageFailed):
                    raise
                # the plan now avoids the failed node and any replacement that failed too
                progress.last_failure = err
                progress.recovering_since = trio.current_time()
                self.metrics.inc("swarm_gateway_recoveries_total", kind="route", outcome="started")
                self.routes.invalidate(job.model_key or request.model)
                for node_id in err.failed_nodes:
                    self.prefix.forget_node(node_id)
                self.metrics.inc(
                    "swarm_gateway_route_sessions_total", route=job.route_label, outcome="recovered"
                )
                event(
                    log,
                    "session_recovering",
                    request_id=job.request_id,
                    node_id=err.node_id,
                    tokens_so_far=len(progress.generated),
                    error=err.message,
                )
            finally:
                if fork is not None and index == 0 and not fork.ready.is_set():
                    fork.ready.set()  # choice 0 failed before its first token: the others try alone

    def _too_many_preemptions(self, progress: Progress, err: GatewayError) -> NoReturn:
        self.metrics.inc("swarm_gateway_preemptions_total", outcome="failed")
        assert isinstance(err, StageFailed)  # the plan counts preemptions of opened sessions only
        raise Preempted(
            f"the session was preempted {progress.plan.preemptions} times (the limit is "
            f"{progress.plan.max_preemptions}): the swarm's KV is under pressure; last: {err.message}",
            node_id=err.node_id,
            remote=err.remote,
            retry_after_s=err.retry_after_s or self.kv_gate.policy.retry_after_s(),
        ) from err

    def _preempted(self, job: Job, progress: Progress, err: GatewayError) -> None:
        """A node preempted this choice's session mid-generation (counted by the plan): log it."""
        assert isinstance(err, StageFailed)
        progress.preempted_since = trio.current_time()
        self.routes.invalidate(job.model_key or job.request.model)  # its free KV is news
        event(
            log,
            "session_preempted",
            request_id=job.request_id,
            choice=progress.index,
            node_id=err.node_id,
            preemptions=progress.plan.preemptions,
            tokens_so_far=len(progress.generated),
        )

    async def _generate(
        self,
        job: Job,
        session: Run,
        prepared: Prepared,
        send: trio.MemorySendChannel[Event],
        arrived: float,
        progress: Progress,
        fork: Fork | None = None,
    ) -> str:
        request = job.request
        vocab = prepared.vocab
        index = progress.index
        if progress.generated:
            # Recovery on a new route: it has seen nothing; the history (including the last token
            # streamed, which was about to be decoded) goes in as prefill and yields the next token.
            await session.begin([*prepared.prompt, *progress.generated])
            sampled = await session.next_token()
        elif index > 0 and fork is not None and len(fork.firsts) > index:
            await session.begin_choice(prepared.prompt, fork.firsts[index])
            sampled = await session.next_token()
        else:
            await session.begin(prepared.prompt)
            sampled = await session.next_token()
            if index == 0:
                now = trio.current_time()
                job.ttft_s = now - arrived
                self.metrics.observe("swarm_gateway_time_to_first_token_seconds", now - arrived)
                if fork is not None:
                    first = Sampled(
                        sampled.token_id, sampled.logprob, sampled.top_logprobs, sampled.end_of_generation
                    )
                    fork.firsts = (first, *sampled.choices)
                    fork.ready.set()
        if progress.preempted_since is not None:
            self.metrics.inc("swarm_gateway_preemptions_total", outcome="resumed")
            event(
                log,
                "session_resumed",
                request_id=job.request_id,
                choice=index,
                waited_s=round(trio.current_time() - progress.preempted_since, 3),
                replayed_positions=len(prepared.prompt) + len(progress.generated),
            )
            progress.preempted_since = None
        if progress.recovering_since is not None:
            now = trio.current_time()
            self.metrics.observe("swarm_gateway_recovery_seconds", now - progress.recovering_since)
            self.metrics.inc("swarm_gateway_recoveries_total", kind="route", outcome="ok")
            progress.recovering_since = None
        n_top = request.n_top_logprobs if request.logprobs else None
        while True:
            events, reason = progress.take(sampled, vocab, max_new=prepared.max_new, n_top=n_top)
            self.metrics.inc("swarm_gateway_completion_tokens_total")
            for item in events:
                await deliver(job, send, item)
            if reason is not None:
                return reason
            sampled = await session.next_token()
