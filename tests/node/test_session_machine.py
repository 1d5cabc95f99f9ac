"""The sans-IO session machine: frames in, actions out; every refusal and the lifecycle (no I/O at all)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from node.session_machine import (
    Compute,
    Drop,
    FrameServer,
    FreeKv,
    OpenKv,
    Send,
    ServingSpec,
    StepOutcome,
    TruncateKv,
)
from proto import codec
from proto.codec import Sampled
from proto.errors import TicketInvalidError
from proto.swarm.v1 import frame_pb2, status_pb2
from tests.node.fakes import MODEL_FP, N_EMBD, RECIPE_FP

S = status_pb2


def spec(**kw: object) -> ServingSpec:
    base = dict(
        node_id="n" * 64,
        model_fingerprint=MODEL_FP,
        recipe_fingerprint=RECIPE_FP,
        shard_start=4,
        shard_end=8,
        n_embd=N_EMBD,
        n_vocab=100,
        is_first=False,
        is_last=False,
        max_sessions=2,
        session_kv_tokens=64,
        n_ctx_train=128,
        max_queued_steps=8,
        idle_lease_s=100.0,
        reattach_window_s=10.0,
    )
    base.update(kw)
    return ServingSpec(**base)  # type: ignore[arg-type]


class Harness:
    """A machine, one connection, and helpers that send frames and complete jobs like an engine."""

    def __init__(self, **kw: object) -> None:
        self.tickets_ok = True

        def check(ticket: bytes, sid: str, claim: object) -> None:
            if not self.tickets_ok or ticket != b"good":
                raise TicketInvalidError("forged")

        self.spec = spec(**kw)
        self.m = FrameServer(self.spec, check)
        self.conn = self.m.connect()
        self.now = 0.0

    def header(self, sid: str = "s1", epoch: int = 1, **kw: object) -> codec.SessionHeader:
        fields = dict(
            session_id=sid,
            route_epoch=epoch,
            model_fingerprint=MODEL_FP,
            recipe_fingerprint=RECIPE_FP,
            shard_start=self.spec.shard_start,
            shard_end=self.spec.shard_end,
        )
        fields.update(kw)
        return codec.SessionHeader(**fields)  # type: ignore[arg-type]

    def feed(self, frame: frame_pb2.Frame | bytes, conn: int | None = None) -> list:
        data = frame if isinstance(frame, bytes) else frame.SerializeToString()
        return self.m.handle(self.conn if conn is None else conn, data, self.now)

    def open(
        self,
        sid: str = "s1",
        epoch: int = 1,
        step_id: int = 1,
        budget: int = 32,
        keep: int = 0,
        ticket: bytes = b"good",
        isolated: bool = False,
    ) -> list:
        return self.feed(
            codec.open_frame(
                self.header(sid, epoch),
                step_id=step_id,
                route_ticket=ticket,
                kv_budget_tokens=budget,
                keep_kv_len=keep,
                isolated=isolated,
            )
        )

    def step_frames(
        self,
        sid: str,
        step_id: int,
        start: int,
        n: int,
        *,
        epoch: int = 1,
        phase=frame_pb2.PHASE_PREFILL,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        width: int = N_EMBD,
        replay: bool = False,
    ) -> list[frame_pb2.Frame]:
        hidden = np.arange(n * width, dtype=np.float32).reshape(n, width)
        return codec.step_frames(
            self.header(sid, epoch),
            phase,
            step_id=step_id,
            start=start,
            hidden=hidden,
            max_frame_bytes=max_frame_bytes,
            replay=replay,
        )

    def step(self, sid: str, step_id: int, start: int, n: int, **kw: object) -> list:
        actions: list = []
        for f in self.step_frames(sid, step_id, start, n, **kw):  # type: ignore[arg-type]
            actions += self.feed(f)
        return actions

    def complete(self, job_id: int, kv_len: int, n: int) -> list:
        return self.m.complete(
            StepOutcome(job_id, kv_len=kv_len, hidden=np.ones((n, N_EMBD), np.float32)), self.now
        )

    def run_step(self, sid: str, step_id: int, start: int, n: int) -> frame_pb2.Frame:
        (compute,) = [a for a in self.step(sid, step_id, start, n) if isinstance(a, Compute)]
        (send,) = self.complete(compute.job.job_id, start + n, n)
        return send.frames[-1]


def sends(actions: list) -> list[frame_pb2.Frame]:
    return [f for a in actions if isinstance(a, Send) for f in a.frames]


def status_of(actions: list) -> int:
    (frame,) = sends(actions)
    assert codec.body_kind(frame) == "error", frame
    return frame.error.status


# --------------------------------------------------------------------------- lifecycle


def test_open_step_release_lifecycle() -> None:
    h = Harness()
    actions = h.open(budget=32)
    assert isinstance(actions[0], OpenKv) and actions[0].budget == 32
    (ack,) = sends(actions)
    assert ack.open_ack.kv_tokens_granted == 32 and ack.kv_len == 0 and ack.open_ack.node_id == "n" * 64
    compute = h.step("s1", 2, 0, 5)
    (c,) = compute
    assert (
        isinstance(c, Compute)
        and c.job.start == 0
        and c.job.hidden is not None
        and c.job.hidden.shape == (5, N_EMBD)
    )
    reply = sends(h.complete(c.job.job_id, 5, 5))
    assert [codec.body_kind(f) for f in reply] == ["result"] and reply[0].kv_len == 5
    assert codec.reassemble(reply).tensors[codec.HIDDEN].shape == (5, N_EMBD)
    release = h.feed(codec.release_frame(h.header(), step_id=3, expected_kv_len=5))
    assert isinstance(release[0], FreeKv)
    (closed,) = sends(release)
    assert closed.closed.freed_kv_tokens == 5
    assert h.m.statistics().sessions == 0


def test_an_isolated_open_marks_every_step_job_of_the_session_isolated() -> None:
    """OpenSession.isolated (batch isolation): the scheduler runs these jobs in batches of their own."""
    h = Harness()
    h.open("iso", isolated=True)
    h.open("plain")
    (iso,) = [a for a in h.step("iso", 2, 0, 4) if isinstance(a, Compute)]
    (plain,) = [a for a in h.step("plain", 2, 0, 4) if isinstance(a, Compute)]
    assert iso.job.isolated and not plain.job.isolated
    h.complete(iso.job.job_id, 4, 4)
    (nxt,) = [a for a in h.step("iso", 6, 4, 1, phase=frame_pb2.PHASE_DECODE) if isinstance(a, Compute)]
    assert nxt.job.isolated and nxt.job.is_decode


def test_resent_step_is_answered_from_the_cache_without_touching_kv() -> None:
    h = Harness()
    h.open()
    first = h.run_step("s1", 2, 0, 3)
    again = h.step("s1", 2, 0, 3)
    assert not any(isinstance(a, Compute) for a in again)
    (replayed,) = sends(again)
    assert replayed.SerializeToString() == first.SerializeToString()
    assert h.m.statistics().replays == 1
    # a re-sent OPEN is answered from the cache too, as long as it was the last step
    h2 = Harness()
    h2.open()
    assert not any(isinstance(a, OpenKv) for a in h2.open())


def test_answers_from_the_cache_are_marked_as_replays_for_the_transport() -> None:
    h = Harness()
    h.open()
    h.run_step("s1", 2, 0, 3)
    (send,) = [a for a in h.step("s1", 2, 0, 3) if isinstance(a, Send)]
    assert send.replay  # the hub sends it only once the previous cached answer was read
    (fresh,) = [a for a in h.complete(*_next_job(h, "s1", 3, 3, 2)) if isinstance(a, Send)]
    assert not fresh.replay


def _next_job(h: Harness, sid: str, step_id: int, start: int, n: int) -> tuple[int, int, int]:
    (c,) = [a for a in h.step(sid, step_id, start, n) if isinstance(a, Compute)]
    return c.job.job_id, start + n, n


def test_a_foreign_connection_may_not_cancel_release_replay_or_take_over_a_session() -> None:
    h = Harness()
    h.open()
    h.run_step("s1", 2, 0, 4)
    foreign = h.m.connect()
    cancel = codec.cancel_frame(h.header(), step_id=100, reason="hostile")
    assert status_of(h.feed(cancel, conn=foreign)) == S.STATUS_TICKET_INVALID
    release = codec.release_frame(h.header(), step_id=100, expected_kv_len=4)
    assert status_of(h.feed(release, conn=foreign)) == S.STATUS_TICKET_INVALID
    # a re-attach with the route's ticket but no valid proof (the verifier refuses it) takes nothing
    h.tickets_ok = False
    reopen = codec.open_frame(h.header(epoch=2), step_id=3, route_ticket=b"good", kv_budget_tokens=32)
    assert status_of(h.feed(reopen, conn=foreign)) == S.STATUS_TICKET_INVALID
    assert status_of(h.feed(cancel, conn=foreign)) == S.STATUS_TICKET_INVALID
    assert h.m.kv_len("s1") == 4 and not h.m.is_proven(foreign)
    # the owner goes on, and its CANCEL works
    h.tickets_ok = True
    h.run_step("s1", 6, 4, 2)
    assert h.m.is_proven(h.conn)
    (closed,) = sends(h.feed(cancel))
    assert codec.body_kind(closed) == "closed"


def test_a_stage_pushing_with_the_hop_token_is_proven() -> None:
    h = Harness()
    h.feed(
        codec.open_frame(
            h.header(), step_id=1, route_ticket=b"good", kv_budget_tokens=32, upstream_token=b"t" * 16
        )
    )
    pusher = h.m.connect()
    (frame,) = h.step_frames("s1", 2, 0, 2)
    frame.activation.hop_token = b"x" * 16
    assert status_of(h.feed(frame, conn=pusher)) == S.STATUS_TICKET_INVALID
    assert not h.m.is_proven(pusher)
    frame.activation.hop_token = b"t" * 16
    assert any(isinstance(a, Compute) for a in h.feed(frame, conn=pusher))
    assert h.m.is_proven(pusher)
    h.m.disconnect(pusher, 0.0)
    assert not h.m.is_proven(pusher)


def test_older_step_id_is_a_conflict() -> None:
    h = Harness()
    h.open(step_id=5)
    assert status_of(h.step("s1", 4, 0, 1)) == S.STATUS_STEP_CONFLICT


def test_last_stage_samples_and_keeps_history_for_penalties() -> None:
    h = Harness(is_last=True)
    sampling = codec.SamplingSettings(temperature=0.0, repetition_penalty=1.3, n_top_logprobs=2)
    h.feed(
        codec.open_frame(h.header(), step_id=1, route_ticket=b"good", kv_budget_tokens=32, sampling=sampling)
    )
    frames = codec.step_frames(
        h.header(),
        frame_pb2.PHASE_PREFILL,
        step_id=2,
        start=0,
        hidden=np.zeros((3, N_EMBD), np.float32),
        sample=True,
    )
    frames[0].activation.token_ids.extend([5, 6, 7])
    (c,) = h.feed(frames[0])
    assert c.job.sample and list(c.job.history) == [5, 6, 7]
    out = StepOutcome(c.job.job_id, kv_len=3, sampled=Sampled(9, -0.25, ((9, -0.25), (3, -2.0)), True))
    (reply,) = sends(h.m.complete(out, 0.0))
    (tok,) = reply.result.sampled
    assert tok.token_id == 9 and tok.end_of_generation and [t.token_id for t in tok.top_logprobs] == [9, 3]
    frames = codec.step_frames(
        h.header(),
        frame_pb2.PHASE_DECODE,
        step_id=3,
        start=3,
        hidden=np.zeros((1, N_EMBD), np.float32),
        sample=True,
    )
    frames[0].activation.token_ids.append(9)
    (c,) = h.feed(frames[0])
    assert list(c.job.history) == [5, 6, 7, 9]


def test_first_stage_takes_token_ids() -> None:
    h = Harness(is_first=True, shard_start=0, shard_end=4)
    h.open()
    frames = codec.step_frames(h.header(), frame_pb2.PHASE_PREFILL, step_id=2, start=0, token_ids=[1, 2, 3])
    (c,) = h.feed(frames[0])
    assert list(c.job.tokens) == [1, 2, 3] and c.job.hidden is None
    h.complete(c.job.job_id, 3, 3)
    hidden_step = h.step_frames("s1", 3, 3, 1)
    assert status_of(h.feed(hidden_step[0])) == S.STATUS_SHAPE
    too_big = codec.step_frames(h.header(), frame_pb2.PHASE_PREFILL, step_id=3, start=3, token_ids=[100])
    assert status_of(h.feed(too_big[0])) == S.STATUS_SHAPE


def test_sampling_refused_when_out_of_range() -> None:
    h = Harness(is_last=True)
    sampling = codec.SamplingSettings(temperature=150.0)
    actions = h.feed(
        codec.open_frame(h.header(), step_id=1, route_ticket=b"good", kv_budget_tokens=8, sampling=sampling)
    )
    assert status_of(actions) == S.STATUS_BAD_FRAME


def test_sampling_controls_reach_the_engine() -> None:
    h = Harness(is_last=True)
    sampling = codec.SamplingSettings(
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias=((5, -100.0),),
        grammar='start: "x"',
        completion_start=3,
        choices=2,
    )
    actions = h.feed(
        codec.open_frame(h.header(), step_id=1, route_ticket=b"good", kv_budget_tokens=8, sampling=sampling)
    )
    (opened,) = [a for a in actions if isinstance(a, OpenKv)]
    spec = opened.sampling
    assert (spec.frequency_penalty, spec.presence_penalty, spec.logit_bias) == (0.5, -0.25, ((5, -100.0),))
    assert (spec.grammar, spec.completion_start, spec.choices) == ('start: "x"', 3, 2)
    assert spec.needs_history


# --------------------------------------------------------------------------- refusals


def test_unreadable_and_wrong_version_frames() -> None:
    h = Harness()
    assert status_of(h.feed(b"\xff\x00 not a frame")) == S.STATUS_BAD_FRAME
    frame = codec.open_frame(h.header(), step_id=1, route_ticket=b"good", kv_budget_tokens=8)
    frame.schema_version = codec.SCHEMA_VERSION + 1
    assert status_of(h.feed(frame)) == S.STATUS_SCHEMA_VERSION
    assert status_of(h.feed(b"x" * (codec.DEFAULT_MAX_FRAME_BYTES + 1))) == S.STATUS_TOO_LARGE


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("model_fingerprint", "c" * 64, S.STATUS_FINGERPRINT_MISMATCH),
        ("recipe_fingerprint", "c" * 64, S.STATUS_FINGERPRINT_MISMATCH),
        ("shard_start", 0, S.STATUS_SHARD_MISMATCH),
    ],
)
def test_route_mismatch(field: str, value: object, status: int) -> None:
    h = Harness()
    frame = codec.open_frame(h.header(**{field: value}), step_id=1, route_ticket=b"good", kv_budget_tokens=8)
    actions = h.feed(frame)
    assert status_of(actions) == status
    assert not any(isinstance(a, OpenKv) for a in actions)


def test_ticket_refused_reserves_nothing() -> None:
    h = Harness()
    actions = h.open(ticket=b"forged")
    assert status_of(actions) == S.STATUS_TICKET_INVALID
    assert sends(actions)[0].error.session_closed
    assert not any(isinstance(a, OpenKv) for a in actions)
    assert h.m.statistics().sessions == 0


def test_admission_slots_budget_and_context() -> None:
    h = Harness()
    (err,) = sends(h.open(budget=100))
    assert err.error.status == S.STATUS_RESOURCE_EXHAUSTED and "at most 64" in err.error.message
    (err,) = sends(h.open(budget=500))
    assert err.error.status == S.STATUS_CONTEXT_EXCEEDED
    h.open("a")
    h.open("b")
    (err,) = sends(h.open("c"))
    assert err.error.status == S.STATUS_RESOURCE_EXHAUSTED and "slots" in err.error.message
    # releasing one frees a slot at once
    h.feed(codec.release_frame(h.header("a"), step_id=2))
    assert isinstance(h.open("c")[0], OpenKv)


def test_position_mismatch_reports_kv_len_and_changes_nothing() -> None:
    h = Harness()
    h.open()
    h.run_step("s1", 2, 0, 4)
    frames = h.step_frames("s1", 3, 2, 1)
    (err,) = sends(h.feed(frames[0]))
    assert err.error.status == S.STATUS_POSITION_MISMATCH and err.kv_len == 4
    assert err.error.retry == S.RETRY_RESYNC
    assert h.run_step("s1", 3, 4, 1).kv_len == 5  # the session is intact


def test_budget_exceeded_is_context_exceeded() -> None:
    h = Harness()
    h.open(budget=4)
    assert status_of(h.step("s1", 2, 0, 5)) == S.STATUS_CONTEXT_EXCEEDED


def test_payload_checks_checksum_shape_dtype() -> None:
    h = Harness()
    h.open()
    (frame,) = h.step_frames("s1", 2, 0, 2)
    frame.activation.tensors[0].checksum = b"\x00\x00\x00\x00"
    assert status_of(h.feed(frame)) == S.STATUS_CHECKSUM
    (frame,) = h.step_frames("s1", 2, 0, 2, width=N_EMBD + 1)
    assert status_of(h.feed(frame)) == S.STATUS_SHAPE
    (frame,) = h.step_frames("s1", 2, 0, 2)
    frame.activation.tensors[0].dtype = 7
    assert status_of(h.feed(frame)) == S.STATUS_DTYPE
    (frame,) = h.step_frames("s1", 2, 0, 2)
    frame.activation.tensors[0].shape[:] = [3, N_EMBD]
    assert status_of(h.feed(frame)) == S.STATUS_SHAPE
    # after all that, the session still works from KV 0
    assert h.run_step("s1", 2, 0, 2).kv_len == 2


def test_unknown_released_and_cancelled_sessions() -> None:
    h = Harness()
    (err,) = sends(h.step("ghost", 2, 0, 1))
    assert err.error.status == S.STATUS_UNKNOWN_SESSION and err.error.session_closed
    h.open("r")
    h.feed(codec.release_frame(h.header("r"), step_id=2))
    assert status_of(h.step("r", 3, 0, 1)) == S.STATUS_SESSION_CLOSED
    # a re-sent RELEASE gets the same closed reply
    (closed,) = sends(h.feed(codec.release_frame(h.header("r"), step_id=2)))
    assert codec.body_kind(closed) == "closed"
    h.open("c")
    h.run_step("c", 2, 0, 3)
    actions = h.feed(codec.cancel_frame(h.header("c"), step_id=99, reason="client left"))
    assert any(isinstance(a, FreeKv) for a in actions)
    assert sends(actions)[0].closed.freed_kv_tokens == 3
    assert status_of(h.step("c", 3, 3, 1)) == S.STATUS_SESSION_CLOSED
    # cancel is idempotent
    assert codec.body_kind(sends(h.feed(codec.cancel_frame(h.header("c"), step_id=100)))[0]) == "closed"
    # and a new OPEN under the same id starts a fresh session
    assert isinstance(h.open("c", step_id=101)[0], OpenKv)


def test_cancel_while_busy_drops_the_job_and_its_result() -> None:
    h = Harness()
    h.open()
    (c,) = h.step("s1", 2, 0, 3)
    actions = h.feed(codec.cancel_frame(h.header(), step_id=3))
    assert any(isinstance(a, Drop) and a.job_id == c.job.job_id for a in actions)
    assert any(isinstance(a, FreeKv) for a in actions)
    assert h.complete(c.job.job_id, 3, 3) == []
    assert h.m.statistics().queued_jobs == 0


def test_steps_wait_behind_the_running_one_within_bounds() -> None:
    h = Harness(max_sessions=4, max_queued_steps=2, max_pending_steps=2)
    for sid in ("a", "b", "c"):
        h.open(sid)
    (first,) = h.step("a", 2, 0, 1)
    assert h.step("a", 3, 1, 2) == []  # waits behind step 2 (a pipelined prefill's next chunk)
    assert h.step("a", 4, 3, 1) == []
    (err,) = sends(h.step("a", 5, 4, 1))
    assert err.error.status == S.STATUS_RESOURCE_EXHAUSTED and err.error.retry == S.RETRY_SAME
    assert status_of(h.step("a", 4, 3, 1)) == S.STATUS_RESOURCE_EXHAUSTED  # already queued: not twice
    assert status_of(h.step("a", 9, 1, 1)) == S.STATUS_POSITION_MISMATCH  # must follow the queued ones
    assert h.m.statistics().pending_steps == 2
    # each finished step hands the next waiting one to the engine, in order
    done = h.complete(first.job.job_id, 1, 1)
    (nxt,) = [a for a in done if isinstance(a, Compute)]
    assert nxt.job.start == 1 and nxt.job.n_tokens == 2
    assert [f.step_id for f in sends(done)] == [2]
    h.step("b", 2, 0, 1)
    (err,) = sends(h.step("c", 2, 0, 1))
    assert err.error.status == S.STATUS_RESOURCE_EXHAUSTED and "queue full" in err.error.message
    # a cancel drops the waiting steps with the session
    h.feed(codec.cancel_frame(h.header("a"), step_id=50))
    assert h.m.statistics().pending_steps == 0 and h.m.statistics().pending_bytes == 0


def test_a_replay_may_queue_more_steps_than_a_prefill_but_not_past_the_budget() -> None:
    # A replaced stage gets its whole history at once (REPLAY from upstream): the step-count bound
    # would refuse it; the positions (KV budget) and the bytes bound still hold.
    h = Harness(max_pending_steps=2)
    h.open(budget=12)
    (first,) = h.step("s1", 2, 0, 2, replay=True)
    for i in range(1, 5):
        assert h.step("s1", 2 + i, 2 * i, 2, replay=True) == []
    assert h.m.statistics().pending_steps == 4
    assert status_of(h.step("s1", 7, 10, 4, replay=True)) == S.STATUS_CONTEXT_EXCEEDED
    assert status_of(h.step("s1", 7, 9, 1, replay=True)) == S.STATUS_POSITION_MISMATCH
    assert status_of(h.step("s1", 7, 10, 1)) == S.STATUS_RESOURCE_EXHAUSTED  # an ordinary step: bounded


def test_engine_error_is_reported_with_the_kv_it_left() -> None:
    h = Harness()
    h.open()
    (c,) = h.step("s1", 2, 0, 3)
    (err,) = sends(
        h.m.complete(StepOutcome(c.job.job_id, kv_len=0, error_status="INTERNAL", error_message="x"), 0)
    )
    assert err.error.status == S.STATUS_INTERNAL and err.kv_len == 0 and not err.error.session_closed
    assert h.run_step("s1", 2, 0, 3).kv_len == 3  # the same step id may be retried: it was never applied


# --------------------------------------------------------------------------- epochs and re-attach


def test_epochs_and_reattach() -> None:
    h = Harness()
    h.open()
    h.run_step("s1", 2, 0, 6)
    # OPEN again with the same epoch and a new step id: refused
    assert status_of(h.open(step_id=3)) == S.STATUS_ROUTE_EPOCH
    # re-attach on another connection with epoch 2, keeping 4 positions
    conn2 = h.m.connect()
    data = codec.open_frame(
        h.header(epoch=2), step_id=3, route_ticket=b"good", kv_budget_tokens=32, keep_kv_len=4
    ).SerializeToString()
    actions = h.m.handle(conn2, data, 0.0)
    assert actions[0] == TruncateKv("s1", 4)
    (ack,) = sends(actions)
    assert ack.open_ack.reattached and ack.kv_len == 4
    # a re-attach with a bad ticket is refused and leaves the session alone
    data = codec.open_frame(
        h.header(epoch=3), step_id=4, route_ticket=b"forged", kv_budget_tokens=32
    ).SerializeToString()
    (err,) = sends(h.m.handle(conn2, data, 0.0))
    assert err.error.status == S.STATUS_TICKET_INVALID and not err.error.session_closed
    assert h.m.kv_len("s1") == 4
    # frames of the old epoch are stale now, on any connection
    assert status_of(h.step("s1", 4, 4, 1)) == S.STATUS_ROUTE_EPOCH
    (stale,) = h.step_frames("s1", 4, 4, 1, epoch=1)
    assert status_of(h.m.handle(conn2, stale.SerializeToString(), 0.0)) == S.STATUS_ROUTE_EPOCH
    # and the old connection no longer owns the session: a current-epoch step from it needs a hop token
    assert status_of(h.step("s1", 4, 4, 1, epoch=2)) == S.STATUS_TICKET_INVALID
    (frame,) = h.step_frames("s1", 4, 4, 1, epoch=2)
    (c,) = h.m.handle(conn2, frame.SerializeToString(), 0.0)
    assert isinstance(c, Compute) and c.job.start == 4


def test_disconnect_keeps_session_for_the_reattach_window_then_frees() -> None:
    h = Harness()
    h.open()
    h.run_step("s1", 2, 0, 2)
    h.m.disconnect(h.conn, now=0.0)
    assert h.m.tick(5.0) == []
    assert h.m.tick(10.0) == [FreeKv("s1")]
    assert status_of(h.step("s1", 3, 2, 1)) == S.STATUS_SESSION_CLOSED


def test_idle_lease_evicts() -> None:
    h = Harness(idle_lease_s=50.0)
    h.open("a")
    h.now = 40.0
    h.open("b")
    assert h.m.tick(60.0) == [FreeKv("a")]
    assert h.m.statistics().evictions == 1 and h.m.statistics().sessions == 1


def test_drain_frees_everything_and_refuses_new_sessions() -> None:
    h = Harness()
    h.open("a")
    (c,) = h.step("a", 2, 0, 1)
    h.open("b")
    actions = h.m.drain()
    assert Drop(c.job.job_id) in actions and FreeKv("a") in actions and FreeKv("b") in actions
    notices = sends(actions)
    assert [f.session_id for f in notices] == ["a", "b"]
    assert all(f.error.status == S.STATUS_UNAVAILABLE and f.error.session_closed for f in notices)
    assert all(codec.parse_frame(f.SerializeToString()) for f in notices)
    assert status_of(h.open("c")) == S.STATUS_UNAVAILABLE


# --------------------------------------------------------------------------- chunks


def test_chunked_step_assembles_into_one_job_and_chunked_reply() -> None:
    h = Harness()
    h.feed(
        codec.open_frame(
            h.header(), step_id=1, route_ticket=b"good", kv_budget_tokens=64, max_frame_bytes=1400
        )
    )
    frames = h.step_frames("s1", 2, 0, 40, max_frame_bytes=1400)
    assert len(frames) > 2
    actions: list = []
    for f in frames:
        actions += h.feed(f)
    (c,) = actions
    assert c.job.hidden.shape == (40, N_EMBD)
    assert np.array_equal(c.job.hidden, np.arange(40 * N_EMBD, dtype=np.float32).reshape(40, N_EMBD))
    reply = sends(h.complete(c.job.job_id, 40, 40))
    assert len(reply) > 1 and all(f.ByteSize() <= 1400 for f in reply)
    assert codec.reassemble(reply).tensors[codec.HIDDEN].shape == (40, N_EMBD)


def test_bad_chunk_is_answered_once_and_the_rest_ignored() -> None:
    h = Harness()
    h.open(budget=64)
    frames = h.step_frames("s1", 2, 0, 40, max_frame_bytes=1400)
    frames[1].activation.tensors[0].checksum = b"\x00\x00\x00\x00"
    actions: list = []
    for f in frames:
        actions += h.feed(f)
    (err,) = sends(actions)
    assert err.error.status == S.STATUS_CHECKSUM
    assert not any(isinstance(a, Compute) for a in actions)
    # the gateway's retry of the whole step (chunk 0 again) works
    good = h.step_frames("s1", 2, 0, 40, max_frame_bytes=1400)
    actions = []
    for f in good:
        actions += h.feed(f)
    assert [type(a) for a in actions] == [Compute]


def test_chunk_without_chunk_zero_and_abandoned_step() -> None:
    h = Harness()
    h.open(budget=64)
    frames = h.step_frames("s1", 2, 0, 40, max_frame_bytes=1400)
    assert status_of(h.feed(frames[1])) == S.STATUS_CHUNK_SEQUENCE
    assert h.feed(frames[2]) == []  # the rest of that attempt is ignored silently
    h.feed(frames[0])
    other = h.step_frames("s1", 3, 0, 1)
    actions = h.feed(other[0])  # step 2 abandoned mid-way: one CHUNK_SEQUENCE for it, then step 3 runs
    assert sends(actions)[0].error.status == S.STATUS_CHUNK_SEQUENCE and sends(actions)[0].step_id == 2
    assert any(isinstance(a, Compute) for a in actions)


def test_errors_on_one_session_leave_others_alone() -> None:
    h = Harness()
    h.open("good")
    h.open("bad")
    assert status_of(h.step("bad", 2, 3, 1)) == S.STATUS_POSITION_MISMATCH
    assert h.run_step("good", 2, 0, 2).kv_len == 2


# --------------------------------------------------------------------------- boundary


@pytest.mark.slow  # a fresh interpreter
def test_pure_modules_import_no_io_runtime() -> None:
    code = (
        "import sys; import node.session_machine, node.batching, node.tickets, node.config, common.logs; "
        "bad = [m for m in ('trio', 'grpc', 'llama_cpp') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_engine_that_lost_the_session_closes_it() -> None:
    h = Harness()
    h.open()
    (c,) = h.step("s1", 2, 0, 1)
    out = StepOutcome(c.job.job_id, kv_len=0, error_status="UNKNOWN_SESSION", error_message="gone")
    actions = h.m.complete(out, 0.0)
    assert FreeKv("s1") in actions
    (err,) = sends(actions)
    assert err.error.status == S.STATUS_UNKNOWN_SESSION and err.error.session_closed
    assert h.m.statistics().sessions == 0


def test_output_encoding_from_open_is_used_for_results() -> None:
    h = Harness()
    h.feed(
        codec.open_frame(
            h.header(),
            step_id=1,
            route_ticket=b"good",
            kv_budget_tokens=32,
            output_encoding=frame_pb2.ENCODING_INT8_BLOCK,
            output_block_size=4,
        )
    )
    (c,) = h.step("s1", 2, 0, 3)
    (reply,) = sends(h.complete(c.job.job_id, 3, 3))
    (tensor,) = reply.result.tensors
    assert tensor.encoding == frame_pb2.ENCODING_INT8_BLOCK and tensor.block_size == 4
    assert np.allclose(codec.reassemble([reply]).tensors[codec.HIDDEN], 1.0, atol=0.01)
