"""Batch planning (pure) and the scheduler loop with a fake engine backend (trio, no llama.cpp)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from node.batching import PendingJob, plan_batch
from node.sampling import SamplingParams
from node.scheduler import Scheduler
from node.session_machine import Compute, Drop, FreeKv, OpenKv, StepJob, StepOutcome, TruncateKv
from proto.codec import ISOLATED_SLICE_TOKENS
from tests.node.fakes import N_EMBD, FakeBackend


def job(
    job_id: int, sid: str, start: int, n: int, *, decode: bool = False, isolated: bool = False
) -> StepJob:
    return StepJob(
        job_id, sid, start, np.arange(n, dtype=np.int32), None, False, None, decode, isolated=isolated
    )


# --------------------------------------------------------------------------- plan_batch


def test_decode_steps_go_first_and_prefill_is_chunked() -> None:
    pending = [
        PendingJob(job(1, "p", 0, 100)),
        PendingJob(job(2, "d1", 5, 1, decode=True)),
        PendingJob(job(3, "q", 0, 10)),
        PendingJob(job(4, "d2", 9, 1, decode=True)),
    ]
    plan = plan_batch(pending, max_tokens=40, prefill_chunk=32)
    assert [(s.pending.job.session_id, s.offset, s.count) for s in plan] == [
        ("d1", 0, 1),
        ("d2", 0, 1),
        ("p", 0, 32),
        ("q", 0, 6),
    ]


def test_plan_resumes_partial_prefill_and_skips_dropped() -> None:
    p = PendingJob(job(1, "p", 0, 100), done=64)
    d = PendingJob(job(2, "x", 0, 5), dropped=True)
    plan = plan_batch([p, d], max_tokens=512, prefill_chunk=256)
    assert [(s.offset, s.count, s.last) for s in plan] == [(64, 36, True)]
    assert plan_batch([], 10, 10) == []
    with pytest.raises(ValueError):
        plan_batch([p], 0, 1)


@pytest.mark.parametrize("max_tokens", [1, 7, 64])
def test_plan_never_exceeds_the_batch(max_tokens: int) -> None:
    rng = np.random.default_rng(max_tokens)
    pending = [
        PendingJob(job(i, f"s{i}", 0, int(rng.integers(1, 50)), decode=bool(rng.integers(0, 2))))
        for i in range(12)
    ]
    plan = plan_batch(pending, max_tokens, 16)
    assert sum(s.count for s in plan) <= max_tokens
    assert len({s.pending.job.session_id for s in plan}) == len(plan)  # one slice per session
    assert all(s.count <= 16 for s in plan if not s.pending.job.is_decode)


def _cuts(pending: list[PendingJob], max_tokens: int, prefill_chunk: int) -> list[list[tuple[str, int, int]]]:
    """Plan batches until every job is through, as the scheduler does (alternating after isolated)."""
    batches: list[list[tuple[str, int, int]]] = []
    after = False
    while plan := plan_batch(pending, max_tokens, prefill_chunk, after_isolated=after):
        batches.append([(s.pending.job.session_id, s.offset, s.count) for s in plan])
        after = any(s.pending.job.isolated for s in plan)
        for s in plan:
            s.pending.done += s.count
    return batches


def test_an_isolated_job_runs_alone_in_slices_cut_from_its_own_start() -> None:
    pending = [
        PendingJob(job(1, "iso", 0, 150, isolated=True)),
        PendingJob(job(2, "d", 9, 1, decode=True)),
        PendingJob(job(3, "p", 0, 40)),
    ]
    batches = _cuts(pending, max_tokens=512, prefill_chunk=256)
    # never mixed; the shared work alternates with the isolated slices, so neither starves
    assert batches == [
        [("iso", 0, ISOLATED_SLICE_TOKENS)],
        [("d", 0, 1), ("p", 0, 40)],
        [("iso", 64, ISOLATED_SLICE_TOKENS)],
        [("iso", 128, 22)],
    ]


@pytest.mark.parametrize(("max_tokens", "prefill_chunk"), [(64, 8), (64, 64), (512, 256), (2048, 2048)])
def test_isolated_cuts_do_not_depend_on_the_nodes_batch_settings(max_tokens: int, prefill_chunk: int) -> None:
    """Two honest nodes with different batch_tokens / prefill_chunk_tokens, and different company,
    run an isolated step in the same pieces: the rows of each llama.cpp ubatch are the same."""
    rng = np.random.default_rng(max_tokens)
    others = [
        PendingJob(job(10 + i, f"o{i}", 0, int(rng.integers(1, 300)), decode=bool(rng.integers(0, 2))))
        for i in range(int(rng.integers(0, 6)))
    ]
    alone = _cuts([PendingJob(job(1, "iso", 0, 200, isolated=True))], 512, 256)
    crowded = _cuts([*others, PendingJob(job(1, "iso", 0, 200, isolated=True))], max_tokens, prefill_chunk)
    assert [b for b in crowded if any(sid == "iso" for sid, _, _ in b)] == alone
    assert all(len(b) == 1 for b in alone)
    assert [c for ((_, _, c),) in alone] == [64, 64, 64, 8]


def test_isolated_jobs_take_turns_oldest_first() -> None:
    pending = [
        PendingJob(job(1, "a", 0, 70, isolated=True)),
        PendingJob(job(2, "b", 5, 1, decode=True, isolated=True)),
    ]
    assert _cuts(pending, 512, 256) == [[("a", 0, 64)], [("a", 64, 6)], [("b", 0, 1)]]


# --------------------------------------------------------------------------- the loop


class Collector:
    def __init__(self) -> None:
        self.outcomes: list[StepOutcome] = []
        self.event = trio.Event()
        self.want = 0

    def __call__(self, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)
        if len(self.outcomes) >= self.want:
            self.event.set()

    async def wait(self, n: int) -> None:
        self.want = n
        if len(self.outcomes) < n:
            self.event = trio.Event()
            with trio.fail_after(5):
                await self.event.wait()


async def test_scheduler_runs_controls_in_order_then_batches() -> None:
    backend = FakeBackend(max_sessions=4)
    got = Collector()
    sched = Scheduler(backend, got, max_batch_tokens=32, prefill_chunk_tokens=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        sched.submit(OpenKv("a", 64, SamplingParams()))
        sched.submit(OpenKv("b", 64, SamplingParams()))
        sched.submit(Compute(job(1, "a", 0, 20)))
        sched.submit(Compute(job(2, "b", 0, 1, decode=True)))
        await got.wait(2)
        by_id = {o.job_id: o for o in got.outcomes}
        assert (
            by_id[1].error_status is None and by_id[1].kv_len == 20 and by_id[1].hidden.shape == (20, N_EMBD)
        )
        assert np.array_equal(by_id[1].hidden[:, 0], np.arange(20) * 2.0)  # slices joined in order
        assert by_id[2].kv_len == 1
        # the 20-token prefill went in slices of at most 8, the decode rode in the first batch
        assert backend.batches[0][0] == ("b", 0, 1)
        assert all(c <= 8 for batch in backend.batches for sid, _, c in batch if sid == "a")
        stats = sched.statistics()
        assert stats.tokens_processed == 21 and stats.decode_tokens == 1 and stats.batches >= 3
        nursery.cancel_scope.cancel()


async def test_failed_slice_rolls_the_whole_step_back() -> None:
    backend = FakeBackend()
    got = Collector()
    sched = Scheduler(backend, got, max_batch_tokens=8, prefill_chunk_tokens=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await sched.run_control(OpenKv("a", 64, SamplingParams()))
        backend.fail_at_offset = ("a", 8)  # the second slice fails
        sched.submit(Compute(job(1, "a", 0, 20)))
        await got.wait(1)
        (out,) = got.outcomes
        assert out.error_status == "INTERNAL" and out.kv_len == 0
        assert backend.kv["a"] == 0  # the first slice was truncated away
        nursery.cancel_scope.cancel()


async def test_drop_forgets_a_queued_job_and_free_releases() -> None:
    backend = FakeBackend()
    got = Collector()
    sched = Scheduler(backend, got, max_batch_tokens=8, prefill_chunk_tokens=8)
    sched.submit(OpenKv("a", 64, SamplingParams()))
    sched.submit(Compute(job(1, "a", 0, 4)))
    sched.submit(Drop(1))
    sched.submit(FreeKv("a"))
    assert sched.queue_depth == 0
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        assert (
            await sched.run_control(TruncateKv("zzz", 0)) is not None
        )  # unknown session: reported, loop lives
        assert backend.log == [("open", "a"), ("free", "a")]
        assert got.outcomes == []
        nursery.cancel_scope.cancel()


class ThreadRecordingBackend(FakeBackend):
    """Records which thread ran each batch (inline rounds run on the trio thread)."""

    def __init__(self) -> None:
        super().__init__(max_sessions=4)
        self.threads: list[tuple[bool, int]] = []  # (decode-only batch, thread id)

    def run(self, slices):  # type: ignore[no-untyped-def]
        import threading

        self.threads.append((all(s.pending.job.is_decode for s in slices), threading.get_ident()))
        return super().run(slices)


async def test_short_decode_rounds_run_inline_and_prefill_on_the_engine_thread() -> None:
    import threading

    backend = ThreadRecordingBackend()
    got = Collector()
    sched = Scheduler(backend, got, max_batch_tokens=32, prefill_chunk_tokens=8)
    trio_thread = threading.get_ident()
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await sched.run_control(OpenKv("a", 64, SamplingParams()))
        sched.submit(Compute(job(1, "a", 0, 4)))  # prefill: engine thread
        await got.wait(1)
        for k in range(5):  # decode steps; the first one's cost is unknown, so it goes to the thread too
            sched.submit(Compute(job(2 + k, "a", 4 + k, 1, decode=True)))
            await got.wait(2 + k)
        assert [o.kv_len for o in got.outcomes] == [4, 5, 6, 7, 8, 9]
        assert [o.error_status for o in got.outcomes] == [None] * 6
        (prefill_decode, prefill_thread), (first_decode, first_thread), *rest = backend.threads
        assert not prefill_decode and prefill_thread != trio_thread
        assert first_decode and first_thread != trio_thread
        assert rest and all(decode and tid == trio_thread for decode, tid in rest)
        assert sched.statistics().inline_rounds == len(rest)
        nursery.cancel_scope.cancel()


async def test_inline_rounds_can_be_disabled_and_never_overlap_call_engine() -> None:
    import threading

    backend = ThreadRecordingBackend()
    got = Collector()
    sched = Scheduler(backend, got, max_batch_tokens=32, prefill_chunk_tokens=8, inline_max_ms=0)
    trio_thread = threading.get_ident()
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await sched.run_control(OpenKv("a", 64, SamplingParams()))
        for k in range(4):
            sched.submit(Compute(job(1 + k, "a", k, 1, decode=True)))
            await got.wait(1 + k)
        assert all(tid != trio_thread for _, tid in backend.threads)
        assert sched.statistics().inline_rounds == 0

        # With inline rounds on, a decode step queued while call_engine() holds the engine waits for it.
        sched.inline_max_ms = 1000.0
        release = threading.Event()
        started = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def hold() -> object:
            token.run_sync_soon(started.set)
            release.wait(5)
            return len(backend.threads)

        async def engine_user() -> None:
            assert await sched.call_engine(hold) == 4  # no batch ran while it held the engine

        nursery.start_soon(engine_user)
        await started.wait()
        sched.submit(Compute(job(9, "a", 4, 1, decode=True)))
        await trio.sleep(0.05)
        assert len(got.outcomes) == 4
        release.set()
        await got.wait(5)
        assert got.outcomes[-1].kv_len == 5
        nursery.cancel_scope.cancel()


async def test_each_finished_step_reports_its_queue_wait_and_the_node_metrics_observe_it() -> None:
    """A step queued behind a busy engine waits at least one batch; every finished step (failed ones
    too) lands once in swarm_node_queue_wait_seconds, successful ones also in swarm_node_step_seconds."""
    from node.metrics import Metrics, timed_outcomes

    metrics = Metrics()
    backend = FakeBackend()
    got = Collector()
    sched = Scheduler(
        backend, timed_outcomes(got, metrics), max_batch_tokens=4, prefill_chunk_tokens=4, inline_max_ms=0
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await sched.run_control(OpenKv("a", 64, SamplingParams()))
        await sched.run_control(OpenKv("b", 64, SamplingParams()))
        # One round: a's 12 positions take three batches of 4; b's job is planned only after a's
        # (prefill in arrival order), so it waits while a runs.
        sched.submit(Compute(job(1, "a", 0, 12)))
        sched.submit(Compute(job(2, "b", 0, 4)))
        await got.wait(2)
        by_id = {o.job_id: o for o in got.outcomes}
        assert by_id[1].queue_us is not None and by_id[2].queue_us is not None
        assert by_id[2].queue_us > by_id[1].queue_us
        backend.fail_next = "a"
        sched.submit(Compute(job(3, "a", 12, 4)))
        await got.wait(3)
        assert got.outcomes[-1].error_status == "INTERNAL" and got.outcomes[-1].queue_us is not None
        nursery.cancel_scope.cancel()
    assert metrics.histogram_count("swarm_node_queue_wait_seconds") == 3
    assert metrics.histogram_count("swarm_node_step_seconds") == 2
