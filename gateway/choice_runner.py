"""Running one choice of a request to its end, across routes: open, generate, and on a failure
re-run, wait for KV, or give up (the route plan, :mod:`gateway.route_plan`, decides which).

* **Generate** (:meth:`ChoiceRunner._generate`): the prompt (or, on a new route, the prompt and
  every token streamed so far; or, for choices 1..n-1, choice 0's first token) goes in, then one
  token a step until the choice ends (:class:`gateway.generation.Choice`); events go to the client
  as they come.
* **Re-run** a choice whose stage failed mid-generation on a route without the failed nodes, by
  replaying its history: the client's stream only pauses. At most ``MAX_ROUTE_RECOVERIES`` times,
  and only for failures a new route can fix (a broken stream, a node error whose hint is not NONE).
* **KV.** A request that fits a route's context but no route's free KV now (``KvExhausted``
  before the session opened) waits in the KV wait (:class:`gateway.gate.KvGate`, at most
  ``kv_wait_s``) and tries again when first in line. A session a node preempts (``Preempted``:
  its KV freed for an older session) keeps its tokens, waits the same way and is resumed by the
  same replay, on whichever route has room; at most ``max_preemptions`` times, and the node is
  not avoided.
"""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from typing import NoReturn

import trio

from common.logs import event
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, KvExhausted, Preempted, StageBusy, StageFailed
from gateway.gate import KvGate, KvShort, KvWaiter
from gateway.generation import Event, Finished
from gateway.jobs import Fork, Job, Progress, deliver
from gateway.metrics import Metrics
from gateway.prefix_cache import PrefixCache
from gateway.route_choice import Prepared, RouteChoice
from gateway.route_opener import RouteOpener
from gateway.route_plan import Ended, Next
from gateway.route_session import Run
from gateway.routes import RouteCache
from proto.codec import Sampled
from proto.swarm.v1 import status_pb2

log = logging.getLogger("swarm.gateway")


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


class ChoiceRunner:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: Metrics,
        routes: RouteCache,
        prefix: PrefixCache,
        choice: RouteChoice,
        opener: RouteOpener,
        kv_gate: KvGate,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.routes = routes
        self.prefix = prefix
        self.choice = choice
        self.opener = opener
        self.kv_gate = kv_gate

    async def run(
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
        need = error.need_tokens if isinstance(error, KvShort) else None
        if waiter is None or not self.kv_gate.policy.is_waiting(waiter.ticket):
            try:
                waiter = self.kv_gate.enter(job.model_key or job.request.model, need, id(job.request))
            except KvExhausted:
                self.metrics.inc("swarm_gateway_kv_waits_total", outcome="rejected")
                if progress.preempted_since is not None:
                    self.metrics.inc("swarm_gateway_preemptions_total", outcome="failed")
                raise
            event(
                log, "kv_wait", request_id=job.request_id, choice=progress.index, reason=error.message[:300]
            )
        elif need is not None:
            waiter.set_need(need)
        try:
            # A preemption's retry_after hint is not slept: the wait itself is the pause (until another
            # session ends, at most kv_retry_s), and the node answers again if it still has no room.
            stale = await waiter.turn(after_try=not (isinstance(error, KvShort) and error.queued))
        except KvExhausted:
            self.metrics.inc("swarm_gateway_kv_waits_total", outcome="timed_out")
            self.metrics.observe("swarm_gateway_kv_wait_seconds", self.config.kv_wait_s)
            if progress.preempted_since is not None:
                self.metrics.inc("swarm_gateway_preemptions_total", outcome="failed")
            raise
        if stale:
            # Let through on no figure (nothing changed for kv_retry_s): look at fresh ones.
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
        """The body of :meth:`run` until it succeeds, fails for good or has to wait for KV
        (``_WaitForKv``); route-level recoveries loop here."""
        request = job.request
        index = progress.index
        while True:
            in_body = False
            failed_before = progress.last_failure
            held = 0  # positions the session held on its stages when it ended (for the KV ledger)
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
                    try:
                        reason = await self._generate(job, session, prepared, send, arrived, progress, fork)
                    finally:
                        if not self.choice.warm(request):  # kept warm: its KV stays on the route
                            held = len(prepared.prompt) + len(progress.generated)
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
                # The session is closed on every stage (or never opened): what it held goes back.
                if fork is None or index == 0:  # choices 1.. share choice 0's key (and route)
                    self.kv_gate.ledger.release(id(request), time.time(), held)
                self.kv_gate.not_holding(id(progress))
                self.kv_gate.changed_now()

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
        # Every stage holds the whole prompt (and, on a resume, the tokens replayed) from here on.
        self.kv_gate.ledger.settle(id(request), time.time())
        self.kv_gate.holding(id(progress), tuple(h.node_id for h in prepared.route.hops))
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
