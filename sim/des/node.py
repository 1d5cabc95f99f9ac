"""One simulated volunteer node: a shard, a continuous-batching server, an uplink.

The node's scheduler mirrors the real one (node/scheduler.py and
node/batching.py, docs/engine.md): one batch per step built from the pending work of all sessions,
decode tokens first, then prefill chunks while the step's token budget
lasts. A step's duration comes from :class:`sim.des.hardware.StepCost`.

Outputs leave through the node's uplink, which sends one frame at a time
(frames queue behind each other); where they go from there (the gateway, or
the next stage with direct push) is the gateway's data plane
(see :mod:`sim.des.gateway`): ``on_output`` gets the time the frame has left.

States: ``loading`` (fetching its shard) -> ``serving`` -> ``draining``
(graceful leave: no new sessions, finishes the ones it has) -> ``gone``.
A crash goes straight to ``gone``; whatever was queued or in service is lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from sim.des.events import EventLoop
from sim.des.geography import Endpoint
from sim.des.hardware import HardwareProfile, StepCost
from sim.des.session import DONE, FAILED

if TYPE_CHECKING:
    from sim.des.session import Session

LOADING, SERVING, DRAINING, GONE = "loading", "serving", "draining", "gone"


class WorkItem:
    """A chunk of tokens of one session flowing through hops ``hop .. last_hop`` of its route."""

    __slots__ = ("session", "epoch", "hop", "last_hop", "n_tokens", "ctx_work", "decode", "kind")

    def __init__(
        self,
        session: Session,
        hop: int,
        last_hop: int,
        n_tokens: int,
        ctx_work: float,
        decode: bool,
        kind: str,
    ) -> None:
        self.session = session
        self.epoch = session.epoch
        self.hop = hop
        self.last_hop = last_hop
        self.n_tokens = n_tokens
        self.ctx_work = ctx_work  # attention work: context tokens summed over this item's tokens
        self.decode = decode
        self.kind = kind  # "prefill", "decode" or "replay"

    @property
    def stale(self) -> bool:
        s = self.session
        return s.epoch != self.epoch or s.finished


class SimNode:
    def __init__(
        self,
        node_id: str,
        model_index: int,
        model_fingerprint: str,
        n_layers_model: int,
        n_embd: int,
        profile: HardwareProfile,
        endpoint: Endpoint,
        start: int,
        end: int,
        cost: StepCost,
        gateway_latency_ms: list[float],
        step_token_budget: int,
        loop: EventLoop,
        on_output: Callable[[SimNode, WorkItem, float], None],
    ) -> None:
        self.node_id = node_id
        self.model_index = model_index
        self.model_fingerprint = model_fingerprint
        self.profile = profile
        self.endpoint = endpoint
        self.start = start
        self.end = end
        self.cost = cost
        # What it announces (fixed for the node's life): read at every heartbeat's view.
        self.single_token_ms = cost.single_token_ms
        self.prefill_tokens_per_s = cost.prefill_tokens_per_s
        self.gateway_latency_s = [ms / 1000.0 for ms in gateway_latency_ms]
        self.is_last = end == n_layers_model
        self._frame_bytes_per_token = 8 if self.is_last else n_embd * 2
        self._uplink_bps = profile.uplink_mbps * 1e6
        self._budget = step_token_budget
        self._loop = loop
        self._on_output = on_output
        self.state = LOADING
        self.decode_q: deque[WorkItem] = deque()
        self.prefill_q: deque[WorkItem] = deque()
        self.busy = False
        self.sessions: dict[int, Session] = {}
        self._uplink_free_at = 0.0
        # statistics
        self.serving_s = 0.0  # when it started serving
        self.left_s: float | None = None
        self.busy_s = 0.0
        self.tokens_processed = 0
        self.steps = 0

    # -- work in ----------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return self.state == SERVING and len(self.sessions) < self.profile.max_sessions

    @property
    def queue_depth(self) -> int:
        return len(self.decode_q) + len(self.prefill_q)

    def arrive(self, item: WorkItem) -> None:
        """Event: a frame of ``item`` reached this node."""
        state = self.state
        if state == GONE or state == LOADING:
            return
        s = item.session
        if s.epoch != item.epoch or s.phase == DONE or s.phase == FAILED:  # item.stale, inlined
            return
        (self.decode_q if item.decode else self.prefill_q).append(item)
        if not self.busy:
            self._start_step()

    def _start_step(self) -> None:
        batch: list[WorkItem] = []
        budget = self._budget
        decode_tokens = prefill_tokens = 0
        decode_ctx = prefill_ctx = 0.0
        dq, pq = self.decode_q, self.prefill_q
        while dq and decode_tokens < budget:
            it = dq.popleft()
            s = it.session
            if s.epoch != it.epoch or s.phase == DONE or s.phase == FAILED:  # stale
                continue
            batch.append(it)
            decode_tokens += 1
            decode_ctx += it.ctx_work
        while pq:
            it = pq[0]
            s = it.session
            if s.epoch != it.epoch or s.phase == DONE or s.phase == FAILED:  # stale
                pq.popleft()
                continue
            if batch and decode_tokens + prefill_tokens + it.n_tokens > budget:
                break
            pq.popleft()
            batch.append(it)
            prefill_tokens += it.n_tokens
            prefill_ctx += it.ctx_work
        if not batch:
            return
        c = self.cost  # c.step_ms(decode_tokens, prefill_tokens, decode_ctx, prefill_ctx), written out
        dt = (
            c.fixed_ms
            + c.per_decode_token_ms * decode_tokens
            + c.per_prefill_token_ms * prefill_tokens
            + c.per_ctx_token_ms * decode_ctx
            + c.per_prefill_ctx_token_ms * prefill_ctx
        ) / 1000.0
        self.busy = True
        self.busy_s += dt
        self.tokens_processed += decode_tokens + prefill_tokens
        self.steps += 1
        loop = self._loop
        loop.push(loop.now + max(dt, 0.0), self._step_done, batch)  # schedule_in(dt, ...)

    def _step_done(self, batch: list[WorkItem]) -> None:
        if self.state == GONE:
            return
        self.busy = False
        now = self._loop.now
        out = self._on_output
        bits_per_s = self._uplink_bps
        free_at = self._uplink_free_at
        for it in batch:
            s = it.session
            if s.epoch != it.epoch or s.phase == DONE or s.phase == FAILED:  # stale
                continue
            # A stage's output frame: hidden states for every token, or the sampled token (last stage).
            n_bytes = (1 if self.is_last else it.n_tokens) * self._frame_bytes_per_token
            start = now if now > free_at else free_at
            free_at = start + n_bytes * 8.0 / bits_per_s
            self._uplink_free_at = free_at
            out(self, it, free_at)
        if self.decode_q or self.prefill_q:
            self._start_step()

    # -- lifecycle --------------------------------------------------------
    def start_serving(self) -> None:
        if self.state == LOADING:
            self.state = SERVING
            self.serving_s = self._loop.now

    def crash(self) -> None:
        self.state = GONE
        self.left_s = self._loop.now
        self.decode_q.clear()
        self.prefill_q.clear()
        self.busy = False

    def utilization(self, end_s: float) -> float:
        """Busy share of the time this node was serving."""
        until = self.left_s if self.left_s is not None else end_s
        alive = until - self.serving_s
        if self.state == LOADING or alive <= 0:
            return 0.0
        return min(self.busy_s / alive, 1.0)
