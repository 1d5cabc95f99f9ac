"""A request's job and what its choices carry between routes (the service's run loop and the
route opener share them; ``gateway/openai_http.py`` and ``client_apis.py`` read a job's events).

* :class:`Job`: one request in flight -- its events' channel, its cancel scope, what the access
  log and usage read afterwards.
* :class:`Progress`: one choice so far (its text, :class:`gateway.generation.Choice`) and how its
  routes fared (the route plan's counters, recovery and preemption clocks).
* :class:`Fork`: n > 1, what choices 1..n-1 continue from (choice 0's session and first tokens).
* :func:`deliver`: an event to the HTTP side, bounded by the client's reading.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from gateway.api_keys import Principal
from gateway.errors import StageFailed
from gateway.generation import Choice, ChoiceEnd, Delta, Event, Failed, Finished
from gateway.protocol import GenerationRequest, ToolCall
from gateway.route_choice import Prepared
from gateway.route_plan import RoutePlan
from gateway.routes import Route
from proto.codec import Sampled


@dataclass
class Reply:
    """Choice 0's answer as it went to the client (a conversation keeps it as its next message)."""

    parts: list[str] = field(default_factory=list)
    tool_calls: tuple[ToolCall, ...] = ()
    finished: bool = False  # Finished went out (not Failed, not cut)

    def take(self, item: Event) -> None:
        if isinstance(item, Delta) and item.index == 0:
            self.parts.append(item.text)
        elif isinstance(item, ChoiceEnd) and item.index == 0:
            self.tool_calls = item.tool_calls
        elif isinstance(item, Finished):
            self.finished = True

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class Job:
    request: GenerationRequest
    client: str
    request_id: str
    events: trio.MemoryReceiveChannel[Event]
    cancel_scope: trio.CancelScope
    system_fingerprint: str = ""
    route_label: str = "none"
    created: int = field(default_factory=lambda: int(time.time()))
    final_delivered: bool = False  # Finished or Failed went to the HTTP side
    arrived_s: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None  # until choice 0's first token
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0  # prompt positions reused from a kept prefix
    model_key: str = ""  # what the tracker knows the model by (alias and id resolved)
    seed: int = 0  # choice i draws with seed + i
    grammar: str = ""  # the constraint of every choice (gateway/structured.py)
    principal: Principal | None = None  # who it is for quotas (None: not counted, e.g. in-process tests)
    stall_s: float = 30.0  # a stream whose reader takes nothing for this long loses its session
    stalled: bool = False  # that happened
    kv_key: str = ""  # whose kept KV the request may reuse and leaves behind ("": the client's)
    reply: Reply | None = None  # given: choice 0's answer is recorded as it goes out

    def cancel(self) -> None:
        """The client is gone: stop the job (a no-op once its final event went out: the Route
        Session then finishes closing by itself)."""
        if not self.final_delivered:
            self.cancel_scope.cancel()


@dataclass
class Fork:
    """n > 1: what choices 1..n-1 continue from (choice 0's session, once its first tokens exist)."""

    route: Route | None = None
    prepared: Prepared | None = None
    session_id: str = ""
    firsts: tuple[Sampled, ...] = ()
    ready: trio.Event = field(default_factory=trio.Event)
    opened: set[int] = field(default_factory=set)  # choices that opened (or gave up opening)
    all_opened: trio.Event = field(default_factory=trio.Event)

    def chosen(self) -> tuple[Route, Prepared] | None:
        """Choice 0's route and prepared prompt, once it opened."""
        return None if self.route is None or self.prepared is None else (self.route, self.prepared)

    def mark_opened(self, progress: Progress, others: int) -> None:
        self.opened.add(progress.index)
        if len(self.opened) >= others:
            self.all_opened.set()


@dataclass
class Progress(Choice):
    """What one choice of a request has produced so far (its text: :class:`Choice`) and how its
    routes fared; survives a move to another route."""

    prompt_tokens: int = 0
    # What follows a failed Route Session (re-run, KV wait, give up): counters and avoided nodes.
    plan: RoutePlan = field(default_factory=RoutePlan)
    last_failure: StageFailed | None = None  # the failure that started the last re-run
    started: bool = False
    recovering_since: float | None = None  # whole-route recovery in progress since (trio time)
    preempted_since: float | None = None  # waiting to resume after a preemption since (trio time)
    finish_reason: str = "stop"


async def deliver(job: Job, send: trio.MemorySendChannel[Event], item: Event) -> None:
    """Hand an event to the HTTP side; a client that went away, or took nothing for ``job.stall_s``
    while the buffer was full (it stopped reading: its socket and our event buffer are full), ends
    the job like a disconnect, so every stage frees the session's KV.

    No checkpoint when there is room: the next step goes out to the route before the HTTP writer
    formats this event (it runs while the step is computed). When the client is gone the job's
    own scope is cancelled, so the way out is a plain cancellation (CANCEL to every stage, the
    disconnect counted) and never a BrokenResourceError inside the Route Session's nurseries.
    """
    if isinstance(item, Finished | Failed):  # the access log reads them when the response is built
        job.prompt_tokens, job.completion_tokens = item.prompt_tokens, item.completion_tokens
    if job.reply is not None:
        job.reply.take(item)
    try:
        try:
            send.send_nowait(item)
        except trio.WouldBlock:
            with trio.move_on_after(job.stall_s) as waited:
                await send.send(item)
            if waited.cancelled_caught:
                job.stalled = True
                job.cancel_scope.cancel()
                await trio.lowlevel.checkpoint()  # raises Cancelled, caught by the job's scope
        if isinstance(item, Finished | Failed):
            job.final_delivered = True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        job.cancel_scope.cancel()
        await trio.lowlevel.checkpoint()  # raises Cancelled, caught by the job's scope
