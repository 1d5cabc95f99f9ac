"""The node's metric declarations (``common.metrics``) and the engine-side timers.

Most node figures live in the session machine's and the scheduler's statistics
objects: they are declared ``scraped`` and read at every scrape
(:meth:`node.daemon.NodeDaemon.scrape`). Histograms are pushed:

==============================================  =====================================================
``swarm_node_batch_seconds``                    wall time of one engine batch (all sessions in it)
``swarm_node_batch_tokens``                     positions per engine batch
``swarm_node_step_seconds``                     one step's share of engine time (a job's compute)
``swarm_node_queue_wait_seconds``               a step's wait in the engine queue: from the moment
                                                it could run (submitted to the scheduler, i.e. its
                                                session's previous step was done) until its first
                                                batch started (measured by the scheduler,
                                                ``StepOutcome.queue_us``; observed here)
==============================================  =====================================================

:class:`TimedBackend` wraps the engine backend (it runs on the engine thread;
prometheus_client's instruments lock internally) and :func:`timed_outcomes`
wraps the scheduler's completion callback (engine time and queue wait of each
finished step), so the scheduler itself needs no metrics code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from common import metrics as m
from node.batching import Slice
from node.session_machine import StepOutcome

SPECS: dict[str, m.Spec] = {
    "swarm_node_sessions": m.gauge("Route Sessions held"),
    "swarm_node_sessions_max": m.gauge("session slots"),
    "swarm_node_busy_sessions": m.gauge("sessions with a step in flight"),
    "swarm_node_queue_depth": m.gauge("steps waiting for or in the engine"),
    "swarm_node_connections": m.gauge("open Session streams"),
    "swarm_node_kv_tokens_used": m.gauge("KV positions held by sessions"),
    "swarm_node_kv_tokens_granted": m.gauge("KV positions granted to sessions"),
    "swarm_node_kept_sessions": m.gauge("released sessions kept warm for a next turn (Release.keep_ms)"),
    "swarm_node_kept_kv_tokens": m.gauge("KV positions held by kept sessions"),
    "swarm_node_prefix_cached_blocks": m.gauge(
        "distinct 16-token blocks the kept sessions hold, indexed by chained hash (node.prefix_blocks)"
    ),
    "swarm_node_prefix_lookups_total": m.counter(
        "OPENs naming a prefix by its chain hash: found here (hit) or not (miss: started empty)",
        "outcome",
        scraped=True,
    ),
    "swarm_node_prefix_reused_tokens_total": m.counter(
        "positions sessions started with from another session's KV instead of computing them", scraped=True
    ),
    "swarm_node_prefix_hit_ratio": m.gauge(
        "prefix hit rate since start: positions reused / (reused + prefilled), i.e. blocks reused / needed"
    ),
    "swarm_node_kv_tokens_capacity": m.gauge("KV positions of all slots (or of the KV pool)"),
    "swarm_node_kv_pool_blocks": m.gauge("16-position blocks of the KV pool (0: per-sequence layout)"),
    "swarm_node_kv_pool_used_blocks": m.gauge(
        "blocks of the KV pool holding sessions' KV (the engine's count)"
    ),
    "swarm_node_kv_pool_free_blocks": m.gauge("free blocks of the KV pool"),
    "swarm_node_kv_pool_bound_tokens": m.gauge(
        "KV pool positions each memory holding part of the pool left room for at start (RAM, each "
        "device); bound=1 for the one that sized an automatic pool",
        "memory",
        "bound",
        max_series=16,
    ),
    "swarm_node_kv_pool_reserved_blocks": m.gauge(
        "blocks sessions hold or have steps accepted for, kept sessions included (admission's count)"
    ),
    "swarm_node_kv_pool_refusals_total": m.counter(
        "steps refused because the KV pool had no room and no session could be preempted", scraped=True
    ),
    "swarm_node_kv_preemptions_total": m.counter(
        "sessions preempted (KV freed, gateway told PREEMPTED) to make room for older ones", scraped=True
    ),
    "swarm_node_kv_layout": m.gauge(
        "1 for the KV layout in use: per-sequence (no pool), sparse, resident or unified", "layout"
    ),
    "swarm_node_kv_pool_compactions_total": m.counter(
        "times the KV pool's cells were re-packed after releases", scraped=True
    ),
    "swarm_node_tokens_per_second": m.gauge("positions per second of engine time (busy throughput)"),
    "swarm_node_decode_ms_per_token": m.gauge("smoothed time of decode-only batches per step"),
    "swarm_node_draining": m.gauge("1 while the node is shutting down (refusing new sessions)"),
    "swarm_node_tokens_processed_total": m.counter("positions through the engine", "phase", scraped=True),
    "swarm_node_engine_seconds_total": m.counter("time spent in engine batches", scraped=True),
    "swarm_node_batches_total": m.counter("engine batches", scraped=True),
    "swarm_node_multi_session_batches_total": m.counter(
        "batches carrying several sessions' work", scraped=True
    ),
    "swarm_node_isolated_batches_total": m.counter(
        "batches of one isolated session alone (OpenSession.isolated: batch isolation)", scraped=True
    ),
    "swarm_node_inline_rounds_total": m.counter(
        "short decode-only rounds run on the event-loop thread", scraped=True
    ),
    "swarm_node_frames_total": m.counter("Session frames", "direction", scraped=True),
    "swarm_node_replays_total": m.counter("replies re-sent from the idempotency cache", scraped=True),
    "swarm_node_draft_lookahead_total": m.counter(
        "draft model look-aheads taken (hit) or dropped (miss) by the next proposal", "outcome", scraped=True
    ),
    "swarm_node_spec_sessions_total": m.counter(
        "speculating sessions (last stage) by proposer: ngram, draft, draft_unavailable (none here)",
        "proposer",
        scraped=True,
    ),
    "swarm_node_evictions_total": m.counter("sessions evicted by lease or re-attach window", scraped=True),
    "swarm_node_refusals_total": m.counter("error replies by status", "status", scraped=True),
    "swarm_node_tickets_total": m.counter("route tickets checked", "outcome", scraped=True),
    "swarm_node_bound_tickets_total": m.counter(
        "accepted tickets that named a gateway (opened with its proof)", scraped=True
    ),
    "swarm_node_streams_total": m.counter(
        "Session streams opened, and refused at the limit", "outcome", scraped=True
    ),
    "swarm_node_unproven_connections": m.gauge("Session streams that opened no session and pushed no step"),
    "swarm_node_idle_streams_closed_total": m.counter(
        "unproven streams closed (timed out, or to make room)", scraped=True
    ),
    "swarm_node_slow_readers_dropped_total": m.counter(
        "streams dropped for leaving too many reply bytes unread", scraped=True
    ),
    "swarm_node_replays_suppressed_total": m.counter(
        "re-sent steps not answered again while the previous cached answer was unread", scraped=True
    ),
    "swarm_node_reply_bytes_queued": m.gauge("reply bytes waiting for their streams' peers to read them"),
    "swarm_node_tracker_calls_total": m.counter(
        "calls to the tracker, by kind and outcome", "kind", "outcome"
    ),
    "swarm_node_tracker_failures_total": m.counter("failed tracker calls", scraped=True),
    "swarm_node_batch_seconds": m.histogram("wall time of one engine batch"),
    "swarm_node_batch_tokens": m.histogram("positions per engine batch", buckets=m.TOKEN_BUCKETS),
    "swarm_node_step_seconds": m.histogram("one step's share of engine time"),
    "swarm_node_queue_wait_seconds": m.histogram(
        "a step's wait in the engine queue: submitted to the scheduler until its first batch"
    ),
}


class Metrics(m.Metrics):
    def __init__(self) -> None:
        super().__init__("node", SPECS)


class TimedBackend:
    """A :class:`node.backend.Backend` that times every engine batch; everything else passes through."""

    def __init__(self, inner: Any, metrics: Metrics) -> None:
        self._inner = inner
        self._metrics = metrics
        self.n_batch = inner.n_batch

    def __getattr__(self, name: str) -> Any:  # open, truncate, free, kv_len, has_session, engine ...
        return getattr(self._inner, name)

    def run(self, slices: list[Slice]) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return list(self._inner.run(slices))
        finally:
            self._metrics.observe("swarm_node_batch_seconds", time.perf_counter() - t0)
            self._metrics.observe("swarm_node_batch_tokens", float(sum(s.count for s in slices)))


def timed_outcomes(
    on_outcome: Callable[[StepOutcome], None], metrics: Metrics
) -> Callable[[StepOutcome], None]:
    """The scheduler's completion callback, observing each finished step's engine time first."""

    def record(outcome: StepOutcome) -> None:
        if outcome.error_status is None and outcome.compute_us > 0:
            metrics.observe("swarm_node_step_seconds", outcome.compute_us / 1e6)
        if outcome.queue_us is not None:  # failed steps waited too
            metrics.observe("swarm_node_queue_wait_seconds", outcome.queue_us / 1e6)
        on_outcome(outcome)

    return record
