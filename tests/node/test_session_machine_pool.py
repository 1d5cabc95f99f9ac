"""The session machine on a KV pool: room for every step, preemption of the youngest, refusal (sans-IO)."""

from __future__ import annotations

from node.session_machine import Compute, FreeKv
from proto import codec
from proto.swarm.v1 import frame_pb2, status_pb2
from tests.node.test_session_machine import Harness, sends

S = status_pb2
# A pool of 4 blocks of 16 positions; sessions may hold up to 64 positions each.
POOL = dict(kv_pool_tokens=64, max_sessions=4, session_kv_tokens=64, n_ctx_train=128)


def _errors(actions: list) -> dict[str, frame_pb2.Frame]:
    return {f.session_id: f for f in sends(actions) if codec.body_kind(f) == "error"}


def _decode(h: Harness, sid: str, step_id: int, start: int) -> list:
    return h.step(sid, step_id, start, 1, phase=frame_pb2.PHASE_DECODE)


def test_a_full_pool_preempts_the_youngest_session_and_runs_the_older_ones_step() -> None:
    h = Harness(**POOL)
    h.open("old", budget=64)
    h.open("young", budget=64)
    h.run_step("old", 2, 0, 32)  # 2 blocks
    h.run_step("young", 2, 0, 32)  # 2 blocks: the pool is full
    assert h.m.statistics().kv_blocks_reserved == 4
    actions = _decode(h, "old", 34, 32)  # position 32 needs a 3rd block
    kinds = [type(a).__name__ for a in actions]
    # The victim's KV is freed before the older session's step reaches the engine.
    assert kinds.index("FreeKv") < kinds.index("Compute")
    assert [a.session_id for a in actions if isinstance(a, FreeKv)] == ["young"]
    notice = _errors(actions)["young"]
    assert notice.error.status == S.STATUS_PREEMPTED and notice.error.retry == S.RETRY_RESUME
    assert notice.error.session_closed and "older session" in notice.error.message
    stats = h.m.statistics()
    assert stats.preemptions == 1 and stats.sessions == 1 and stats.kv_blocks_reserved == 3
    # The preempted session is closed here: its frames are refused, it may be opened afresh. A late frame
    # (sent before the owner read the notice) is answered as the notice was, so the owner resumes the
    # session rather than taking this node for failed.
    late = _errors(_decode(h, "young", 34, 32))["young"]
    assert late.error.status == S.STATUS_PREEMPTED and late.error.retry == S.RETRY_RESUME
    assert late.error.session_closed
    (compute,) = [a for a in actions if isinstance(a, Compute)]
    assert compute.job.session_id == "old"


def test_the_youngest_requester_yields_itself() -> None:
    h = Harness(**POOL)
    h.open("old", budget=64)
    h.open("young", budget=64)
    h.run_step("old", 2, 0, 48)  # 3 blocks
    h.run_step("young", 2, 0, 16)  # 1 block: full
    actions = _decode(h, "young", 18, 16)  # young needs a block; it is younger than old
    assert not [a for a in actions if isinstance(a, Compute)]
    assert [a.session_id for a in actions if isinstance(a, FreeKv)] == ["young"]
    err = _errors(actions)["young"]
    assert err.error.status == S.STATUS_PREEMPTED and err.error.session_closed
    assert h.m.statistics().kv_blocks_reserved == 3 and h.m.kv_len("old") == 48


def test_with_nobody_to_preempt_the_step_is_refused_and_nothing_is_freed() -> None:
    h = Harness(**POOL, max_preemptions=0)  # nobody may be preempted
    h.open("a", budget=64)
    h.open("b", budget=64)
    h.run_step("a", 2, 0, 48)
    h.run_step("b", 2, 0, 16)
    actions = _decode(h, "a", 50, 48)
    assert not [a for a in actions if isinstance(a, (Compute, FreeKv))]
    err = _errors(actions)["a"]
    assert err.error.status == S.STATUS_RESOURCE_EXHAUSTED and err.error.retry == S.RETRY_SAME
    assert err.error.retry_after_ms == 500 and not err.error.session_closed
    stats = h.m.statistics()
    assert stats.kv_refusals == 1 and stats.preemptions == 0 and stats.kv_blocks_reserved == 4
    # Room returns (b leaves): the same step runs.
    h.feed(codec.release_frame(h.header("b"), step_id=18, expected_kv_len=16))
    assert [a for a in _decode(h, "a", 50, 48) if isinstance(a, Compute)]


def test_kept_sessions_are_given_up_before_anyone_is_preempted() -> None:
    h = Harness(**POOL)
    h.open("done", budget=64)
    h.run_step("done", 2, 0, 32)
    h.feed(codec.release_frame(h.header("done"), step_id=34, keep_ms=60_000, keep_positions=32))
    assert h.m.statistics().kept_sessions == 1
    h.open("live", budget=64)
    h.run_step("live", 2, 0, 32)
    actions = _decode(h, "live", 34, 32)
    assert [a.session_id for a in actions if isinstance(a, FreeKv)] == ["done"]
    assert [a for a in actions if isinstance(a, Compute)] and not _errors(actions)
    stats = h.m.statistics()
    assert stats.preemptions == 0 and stats.kept_sessions == 0


def test_a_step_pushed_by_the_previous_stage_is_answered_to_the_owner() -> None:
    """A refusal on a push stream would read as the pushing stage's failure (DOWNSTREAM_FAILED)."""
    h = Harness(**POOL, max_preemptions=0)
    h.feed(
        codec.open_frame(
            h.header("a"), step_id=1, route_ticket=b"good", kv_budget_tokens=64, upstream_token=b"hop"
        )
    )
    h.open("b", budget=64)
    h.run_step("a", 2, 0, 48)
    h.run_step("b", 2, 0, 16)
    pusher = h.m.connect()  # the previous stage's push stream
    (frame,) = h.step_frames("a", 50, 48, 1, phase=frame_pb2.PHASE_DECODE)
    frame.activation.hop_token = b"hop"
    actions = h.feed(frame, conn=pusher)
    (send,) = [a for a in actions if hasattr(a, "conn")]
    assert send.conn == h.conn and send.frames[0].error.status == S.STATUS_RESOURCE_EXHAUSTED


def _preempt_young(h: Harness) -> None:
    """old (opened first) and young fill the pool; old grows: young is preempted; old's step completes."""
    h.open("old", budget=64)
    h.open("young", budget=64)
    h.run_step("old", 2, 0, 32)
    h.run_step("young", 2, 0, 32)
    actions = _decode(h, "old", 34, 32)
    assert _errors(actions)["young"].error.status == S.STATUS_PREEMPTED
    (c,) = [a for a in actions if isinstance(a, Compute)]
    h.complete(c.job.job_id, 33, 1)


def test_a_resumed_session_keeps_its_age() -> None:
    h = Harness(**POOL, max_preemptions=2)
    _preempt_young(h)
    h.open("newest", budget=64)
    h.open("young", budget=64, step_id=100)  # resumed after newest opened: still older than newest
    h.run_step("newest", 2, 0, 16)  # old 3 blocks + newest 1: full
    actions = h.step("young", 101, 0, 16)
    # Had young's age restarted it would yield (the youngest); it keeps its age: newest goes.
    assert _errors(actions)["newest"].error.status == S.STATUS_PREEMPTED
    assert [a for a in actions if isinstance(a, Compute)][0].job.session_id == "young"


def test_a_session_at_its_preemption_bound_is_not_preempted_again() -> None:
    h = Harness(**POOL, max_preemptions=1)
    _preempt_young(h)  # young: 1 preemption, at the bound
    h.open("young", budget=64, step_id=100)
    actions = h.step("young", 101, 0, 16)  # old holds 3 blocks, 1 free: fits
    h.complete([a for a in actions if isinstance(a, Compute)][0].job.job_id, 16, 16)
    actions = _decode(h, "young", 117, 16)  # needs a 5th block; young is the youngest but at its bound
    assert _errors(actions)["old"].error.status == S.STATUS_PREEMPTED
    assert [a for a in actions if isinstance(a, Compute)][0].job.session_id == "young"
    assert h.m.statistics().preemptions == 2


def test_the_heartbeat_announces_the_pool_and_what_admission_reserved() -> None:
    from node.session_machine import kv_announcement

    h = Harness(**POOL)
    h.open("a", budget=64)
    h.run_step("a", 2, 0, 20)  # 2 blocks
    h.step("a", 22, 20, 13)  # accepted, still computing: up to 33 positions = 3 blocks
    kv = kv_announcement(h.m.statistics(), h.spec)
    assert (kv.free_tokens, kv.pool_tokens, kv.session_max_tokens) == (16, 64, 64)
    slots = Harness(max_sessions=2, session_kv_tokens=64)
    slots.open("a", budget=40)
    kv = kv_announcement(slots.m.statistics(), slots.spec)
    assert (kv.free_tokens, kv.pool_tokens, kv.session_max_tokens) == (128 - 40, 128, 64)


def test_a_copy_that_does_not_fit_starts_empty_instead_of_preempting() -> None:
    from node.session_machine import OpenKv

    h = Harness(**POOL)
    h.open("src", budget=64)
    h.run_step("src", 2, 0, 48)  # 3 of 4 blocks
    frame = codec.open_frame(
        h.header("copy"), step_id=1, route_ticket=b"good", kv_budget_tokens=64, kv_source=("src", 32)
    )
    actions = h.feed(frame)
    (opened,) = [a for a in actions if isinstance(a, OpenKv)]
    assert opened.source == "" and opened.source_positions == 0
    (ack,) = sends(actions)
    assert ack.kv_len == 0 and h.m.statistics().preemptions == 0


def test_kept_sessions_are_bounded_by_the_pool_not_the_per_sequence_bound() -> None:
    # The per-sequence layout's bound (max_kept_kv_tokens) would cut a kept 48-position session to 8;
    # with a pool the kept KV is the pool's evictable cache, so the whole of it stays.
    h = Harness(**POOL, max_kept_kv_tokens=8)
    h.open("turn1", budget=64)
    h.run_step("turn1", 2, 0, 48)
    actions = h.feed(codec.release_frame(h.header("turn1"), step_id=99, keep_ms=60_000, keep_positions=48))
    assert not [a for a in actions if isinstance(a, FreeKv)]
    assert h.m.statistics().kept_kv_tokens == 48 and h.m.statistics().kv_blocks_reserved == 3
    # ... and it is still what goes first when a live session needs the room.
    h.open("live", budget=64)
    h.run_step("live", 2, 0, 16)  # the 4th block
    actions = _decode(h, "live", 18, 16)  # needs a 5th: the kept session is evicted, nobody preempted
    assert FreeKv("turn1") in actions and not _errors(actions)
    assert h.m.statistics().preemptions == 0 and h.m.statistics().kept_sessions == 0


def test_without_a_pool_kept_sessions_keep_the_configured_bound() -> None:
    h = Harness(max_sessions=2, max_kept_kv_tokens=8)
    h.open("turn1")
    h.run_step("turn1", 2, 0, 20)
    h.feed(codec.release_frame(h.header("turn1"), step_id=99, keep_ms=60_000, keep_positions=20))
    assert h.m.statistics().kept_kv_tokens == 8
