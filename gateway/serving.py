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

The service composes its collaborators and runs the job: admission (``gateway/gate.py``),
quotas (``gateway/access.py``), choices (n > 1: choice 0 prefills the prompt once and draws every
choice's first token; the others fork its KV and go on from theirs -- each equals a separate
request with its seed), then per choice :class:`gateway.choice_runner.ChoiceRunner` (generate,
re-run, KV wait), which opens routes through :class:`gateway.route_opener.RouteOpener` (route
choice, the open plan, spot checks, warm conversations' kept prefixes: docs/gateway.md).
"""

from __future__ import annotations

import logging
import secrets

import httpx
import nacl.signing
import trio

from common.logs import event
from common.tracker_client import TrackerClient, TrackerClientError
from gateway import structured, tools
from gateway.access import Access, anonymous_limits
from gateway.admission import AdmissionPolicy, KvLedger, KvWaitPolicy
from gateway.api_keys import AuthPolicy, Principal
from gateway.catalog import ModelCatalog
from gateway.checks import CHECK_TOP_LOGPROBS
from gateway.choice_runner import ChoiceRunner
from gateway.config import GatewayConfig
from gateway.conversations import ConversationLimits, ConversationStore
from gateway.errors import GatewayError, InternalFailure, Overloaded
from gateway.gate import Gate, KvGate
from gateway.generation import Event, Failed, Finished
from gateway.grpc_bridge import NodeChannels
from gateway.jobs import Fork, Job, Progress, Reply, deliver
from gateway.metrics import Labels, Metrics
from gateway.prefix_cache import PrefixCache
from gateway.protocol import GenerationRequest
from gateway.route_choice import RouteChoice
from gateway.route_opener import RouteOpener
from gateway.route_plan import RoutePlan
from gateway.routes import NodeInfoCache, RouteCache
from gateway.spot_checks import SpotChecks
from gateway.textstream import TextStream
from gateway.tracker_key import TrackerKey
from gateway.trust_report import ObservedSpeed
from gateway.vocab_store import VocabStore
from proto.announce import UsageReport
from proto.signing import public_key_hex

log = logging.getLogger("swarm.gateway")
EVENT_BUFFER = 16
VOCAB_TIMEOUT_S = 30.0  # one vocabulary download (megabytes), not a first answer: its own bound


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
            KvWaitPolicy(
                config.max_kv_waiters,
                order=config.kv_admission,
                max_bypass=config.kv_admission_max_bypass,
                max_wait_s=config.kv_admission_max_wait_s,
            ),
            wait_s=config.kv_wait_s,
            retry_s=config.kv_retry_s,
            ledger=KvLedger(config.kv_heartbeat_lag_s),
            room=lambda model: self.choice.kv_room_now(model),
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
            self.kv_gate,
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
        self.runner = ChoiceRunner(
            config, self.metrics, self.routes, self.prefix, self.choice, self.opener, self.kv_gate
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
            "swarm_gateway_kv_overdue_total": {(): float(self.kv_gate.statistics().overdue_total)},
            "swarm_gateway_kv_holding_sessions": {
                (("node", n),): float(v) for n, v in self.kv_gate.holding_now().items()
            },
            "swarm_gateway_kv_holding_sessions_peak": {
                (("node", n),): float(v) for n, v in self.kv_gate.holding_peak().items()
            },
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
                            await self.runner.run(job, send, progresses[0], arrived, task_status)
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
                await self.runner.run(job, send, progresses[i], arrived, trio.TASK_STATUS_IGNORED, fork)
            finally:
                fork.mark_opened(progresses[i], others)

        async def first(*, task_status: trio.TaskStatus[None]) -> None:
            await self.runner.run(job, send, progresses[0], arrived, task_status, fork)

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
