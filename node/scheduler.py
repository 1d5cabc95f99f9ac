"""The node's batch scheduler: one engine thread, one FIFO of effects, batches from all sessions.

The session machine emits engine effects (open, truncate, free, compute,
drop); :meth:`Scheduler.submit` takes them synchronously and in order, so the
engine sees them in emission order. :meth:`run` is the only task that touches
the engine: each round it moves to the engine thread once
(``trio.to_thread.run_sync`` with a ``CapacityLimiter(1)``), applies the queued
control effects in order, then runs one batch planned by
:func:`node.batching.plan_batch` (decode first, prefill in bounded slices).
Finished jobs are handed to ``on_outcome`` on the trio side, each with its
wait in the queue (``StepOutcome.queue_us``: from :meth:`submit` until the
first batch holding a slice of it started; the node's metrics observe it).

Short rounds run inline: a round of decode steps only, whose measured cost
(the smoothed per-token time of earlier decode-only batches times its tokens)
is under ``inline_max_ms``, runs on the trio thread itself. That saves the two
thread hand-offs of ``to_thread`` (measured ~0.4 ms each on the 2-core test
VM, about a tenth of a one-token step of the test model's half) and blocks the
trio loop for at most ``inline_max_ms``: frames arriving meanwhile are queued by
their transport and join the next round exactly as they would have anyway
(the engine is busy either way); timers and heartbeats are late by that much.
Prefill and anything whose cost is not yet known go to the engine thread.

Bounds: the number of jobs is bounded by the session machine
(``max_queued_steps``) and by sessions (one job each); control effects are at
most a few per session state change. A failed slice rolls its session back to
the start of its step (the engine already rolls the failed decode back; the
earlier slices of the same step are truncated here), so a step is applied
whole or not at all.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import trio

from node.backend import Backend, SliceResult
from node.batching import PendingJob, Slice, plan_batch
from node.session_machine import Compute, Drop, EngineEffect, FreeKv, OpenKv, StepOutcome, TruncateKv

log = logging.getLogger("swarm.node.scheduler")

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class ControlDone:
    """Completion of one control effect; ``error`` is set when the engine refused it."""

    effect: EngineEffect
    event: trio.Event
    error: str | None = None


@dataclass(frozen=True)
class SchedulerStats:
    queued_jobs: int
    queued_controls: int
    rounds: int
    batches: int
    tokens_processed: int
    decode_tokens: int
    prefill_tokens: int
    compute_s: float
    last_batch_tokens: int
    batch_size_counts: tuple[tuple[int, int], ...]  # (bucket upper bound, count), cumulative-free
    decode_ms_per_token: float  # smoothed time of a batch that held only decode steps, per step
    multi_session_batches: int  # batches that carried work of more than one session
    inline_rounds: int  # rounds run on the trio thread (short decode-only batches)
    isolated_batches: int = 0  # batches of one isolated session (OpenSession.isolated) alone


class Scheduler:
    def __init__(
        self,
        backend: Backend,
        on_outcome: Callable[[StepOutcome], None],
        *,
        max_batch_tokens: int,
        prefill_chunk_tokens: int,
        inline_max_ms: float = 30.0,
    ) -> None:
        self.backend = backend
        self.inline_max_ms = inline_max_ms
        self.on_outcome = on_outcome
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._limiter = trio.CapacityLimiter(1)
        self._controls: list[ControlDone] = []
        self._jobs: list[PendingJob] = []
        self._by_id: dict[int, PendingJob] = {}
        self._kick_send, self._kick_recv = trio.open_memory_channel[None](1)
        self._rounds = 0
        self._batches = 0
        self._tokens = 0
        self._decode_tokens = 0
        self._prefill_tokens = 0
        self._compute_s = 0.0
        self._last_batch = 0
        self._buckets = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
        self._decode_ms = math.nan
        self._multi = 0
        self._inline_rounds = 0
        self._stopped = False
        self._last_isolated = False  # the last batch was an isolated one (node.batching)
        self._isolated_batches = 0

    # -- trio side: submissions ----------------------------------------------------------------

    def submit(self, effect: EngineEffect) -> ControlDone | None:
        """Queue one effect (synchronously, preserving order); controls return their completion."""
        done: ControlDone | None = None
        if isinstance(effect, Compute):
            pending = PendingJob(effect.job, submitted_s=time.perf_counter())
            self._jobs.append(pending)
            self._by_id[effect.job.job_id] = pending
        elif isinstance(effect, Drop):
            pending_job = self._by_id.pop(effect.job_id, None)
            if pending_job is not None:
                pending_job.dropped = True
                if pending_job in self._jobs:
                    self._jobs.remove(pending_job)
        else:
            done = ControlDone(effect, trio.Event())
            self._controls.append(done)
        self._kick()
        return done

    def _kick(self) -> None:
        try:
            self._kick_send.send_nowait(None)
        except trio.WouldBlock:
            pass  # a wake-up is already pending

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._controls and not self._jobs:
                await self._kick_recv.receive()
                continue
            controls, self._controls = self._controls, []
            plan = plan_batch(
                self._jobs,
                self.max_batch_tokens,
                self.prefill_chunk_tokens,
                after_isolated=self._last_isolated,
            )
            self._last_isolated = any(s.pending.job.isolated for s in plan)
            t0 = time.perf_counter()
            for s in plan:
                if s.pending.queue_s is None:  # the job's first batch: its wait in the queue ends
                    s.pending.queue_s = max(0.0, t0 - s.pending.submitted_s)
            if self._runs_inline(plan):
                # The limiter is free (checked): hold it so call_engine() cannot overlap this round.
                self._limiter.acquire_nowait()
                try:
                    results = self._engine_round(controls, plan)
                finally:
                    self._limiter.release()
                self._inline_rounds += 1
            else:
                results = await trio.to_thread.run_sync(
                    self._engine_round, controls, plan, limiter=self._limiter
                )
            elapsed = time.perf_counter() - t0
            self._rounds += 1
            for c in controls:
                c.event.set()
            if results:
                self._account([s for s, _ in results], elapsed)
                self._finish(results, elapsed)

    def _runs_inline(self, plan: list[Slice]) -> bool:
        if not plan or self.inline_max_ms <= 0 or math.isnan(self._decode_ms):
            return False
        if self._limiter.borrowed_tokens:  # call_engine() is using the engine
            return False
        if not all(s.pending.job.is_decode for s in plan):
            return False
        return self._decode_ms * sum(s.count for s in plan) <= self.inline_max_ms

    async def run_control(self, effect: EngineEffect) -> str | None:
        """Apply one control effect now and wait for it (used at shutdown)."""
        done = self.submit(effect)
        if done is None:
            return None
        await done.event.wait()
        return done.error

    async def call_engine(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread between rounds (benchmarks, shutdown)."""
        return await trio.to_thread.run_sync(fn, limiter=self._limiter)

    # -- engine thread ------------------------------------------------------------------------------

    def _engine_round(
        self, controls: list[ControlDone], plan: list[Slice]
    ) -> list[tuple[Slice, SliceResult]]:
        for c in controls:
            e = c.effect
            try:
                if isinstance(e, OpenKv):
                    if self.backend.has_session(e.session_id):  # a stale sequence of an evicted id
                        self.backend.free(e.session_id)
                    if e.source:
                        self.backend.open(
                            e.session_id, e.budget, e.sampling, e.source, e.source_positions, e.move
                        )
                    else:
                        self.backend.open(e.session_id, e.budget, e.sampling)
                elif isinstance(e, TruncateKv):
                    self.backend.truncate(e.session_id, e.position)
                elif isinstance(e, FreeKv):
                    self.backend.free(e.session_id)
            except Exception as err:  # reported to the machine; the loop keeps serving
                c.error = f"{type(err).__name__}: {err}"
                log.error("engine effect failed effect=%s error=%s", type(e).__name__, c.error)
        if not plan:
            return []
        plan = [s for s in plan if not s.pending.dropped]
        if not plan:
            return []
        results = self.backend.run(plan)
        for s, r in zip(plan, results, strict=True):
            if (
                r.error_status is not None
                and s.offset > 0
                and self.backend.has_session(s.pending.job.session_id)
            ):
                # Earlier slices of this step are in the KV: take them out, the step failed as a whole.
                self.backend.truncate(s.pending.job.session_id, s.pending.job.start)
        return list(zip(plan, results, strict=True))

    # -- trio side: results ------------------------------------------------------------------------------

    def _account(self, plan: list[Slice], elapsed: float) -> None:
        n = sum(s.count for s in plan)
        self._batches += 1
        self._tokens += n
        self._last_batch = n
        if len(plan) > 1:
            self._multi += 1
        if any(s.pending.job.isolated for s in plan):
            self._isolated_batches += 1
        self._compute_s += elapsed
        decode = sum(s.count for s in plan if s.pending.job.is_decode)
        self._decode_tokens += decode
        self._prefill_tokens += n - decode
        idx = next((i for i, b in enumerate(BATCH_SIZE_BUCKETS) if n <= b), len(BATCH_SIZE_BUCKETS))
        self._buckets[idx] += 1
        if decode == n:
            per = elapsed * 1000 / n
            self._decode_ms = per if math.isnan(self._decode_ms) else 0.8 * self._decode_ms + 0.2 * per

    def _finish(self, ran: list[tuple[Slice, SliceResult]], elapsed: float) -> None:
        per_token = elapsed / max(1, sum(s.count for s, _ in ran))
        for s, r in ran:
            p = s.pending
            if p.dropped:
                continue  # cancelled while it ran: the session is being freed
            p.compute_s += per_token * s.count
            job = p.job
            if r.error_status is not None:
                self._retire(p)
                self.on_outcome(
                    StepOutcome(
                        job.job_id,
                        kv_len=job.start if s.offset > 0 else r.kv_len,
                        error_status=r.error_status,
                        error_message=r.error_message,
                        queue_us=_us(p.queue_s),
                    )
                )
                continue
            if r.hidden is not None:
                p.hidden_parts.append(r.hidden)
            p.window_parts.extend(r.window)
            p.done += s.count
            if p.remaining > 0:
                continue
            self._retire(p)
            hidden = None
            if p.hidden_parts:
                hidden = p.hidden_parts[0] if len(p.hidden_parts) == 1 else np.concatenate(p.hidden_parts)
            self.on_outcome(
                StepOutcome(
                    job.job_id,
                    kv_len=r.kv_len,
                    hidden=hidden,
                    sampled=r.sampled,
                    compute_us=int(p.compute_s * 1e6),
                    queue_us=_us(p.queue_s),
                    window=tuple(p.window_parts),
                )
            )

    def _retire(self, p: PendingJob) -> None:
        self._by_id.pop(p.job.job_id, None)
        if p in self._jobs:
            self._jobs.remove(p)

    def statistics(self) -> SchedulerStats:
        bounds = (*BATCH_SIZE_BUCKETS, -1)
        return SchedulerStats(
            queued_jobs=len(self._jobs),
            queued_controls=len(self._controls),
            rounds=self._rounds,
            batches=self._batches,
            tokens_processed=self._tokens,
            decode_tokens=self._decode_tokens,
            prefill_tokens=self._prefill_tokens,
            compute_s=self._compute_s,
            last_batch_tokens=self._last_batch,
            batch_size_counts=tuple(zip(bounds, self._buckets, strict=True)),
            decode_ms_per_token=self._decode_ms,
            multi_session_batches=self._multi,
            inline_rounds=self._inline_rounds,
            isolated_batches=self._isolated_batches,
        )


def _us(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e6)
