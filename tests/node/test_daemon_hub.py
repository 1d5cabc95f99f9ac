"""The trio hub between transports and the session machine (fake engine, no gRPC, no llama.cpp)."""

from __future__ import annotations

import pytest
import trio

from node.hub import OUTBOUND_FRAMES, Hub, LogBudget, TooManyConnections, held_back
from node.scheduler import Scheduler
from node.session_machine import FrameServer, ServingSpec, StepOutcome
from proto import codec
from proto.errors import TicketInvalidError
from proto.swarm.v1 import frame_pb2, status_pb2
from tests.node.fakes import MODEL_FP, N_EMBD, RECIPE_FP, FakeBackend


def _spec() -> ServingSpec:
    return ServingSpec(
        node_id="n" * 64,
        model_fingerprint=MODEL_FP,
        recipe_fingerprint=RECIPE_FP,
        shard_start=0,
        shard_end=4,
        n_embd=N_EMBD,
        n_vocab=1000,
        is_first=True,
        is_last=False,
        max_sessions=4,
        session_kv_tokens=256,
        n_ctx_train=2048,
    )


def _open(sid: str) -> bytes:
    header = codec.SessionHeader(sid, 1, MODEL_FP, RECIPE_FP, 0, 4)
    return codec.serialize_frame(codec.open_frame(header, step_id=1, route_ticket=b"t", kv_budget_tokens=64))


def _step(sid: str, step_id: int, start: int, tokens: list[int]) -> bytes:
    header = codec.SessionHeader(sid, 1, MODEL_FP, RECIPE_FP, 0, 4)
    (frame,) = codec.step_frames(
        header, frame_pb2.PHASE_PREFILL, step_id=step_id, start=start, token_ids=tokens
    )
    return codec.serialize_frame(frame)


def _make() -> tuple[Hub, FakeBackend, Scheduler]:
    hub = Hub(FrameServer(_spec(), lambda *_: None))
    backend = FakeBackend()
    scheduler = Scheduler(backend, hub.on_outcome, max_batch_tokens=64, prefill_chunk_tokens=32)
    hub.attach(scheduler)
    return hub, backend, scheduler


async def test_ack_only_after_the_kv_is_reserved_and_half_close_delivers_pending_replies() -> None:
    hub, backend, scheduler = _make()
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        conn = hub.open_connection()
        await hub.feed(conn, _open("s"))
        assert backend.log == [("open", "s")]  # feed returned after the engine reserved the sequence
        ack = codec.parse_frame(conn.outbound.receive_nowait())
        assert codec.body_kind(ack) == "open_ack"
        await hub.feed(conn, _step("s", 2, 0, [1, 2, 3]))
        hub.input_ended(conn)  # the peer half-closes right after its last step
        replies = [codec.parse_frame(data) async for data in conn.outbound]  # ends after the reply
        assert [codec.body_kind(r) for r in replies] == ["result"] and replies[0].kv_len == 3
        assert hub.connections == 0
        nursery.cancel_scope.cancel()


async def test_a_peer_that_does_not_read_loses_its_connection_not_the_engine() -> None:
    hub, backend, scheduler = _make()
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        lazy = hub.open_connection()
        busy = hub.open_connection()
        await hub.feed(busy, _open("b"))
        for _ in range(OUTBOUND_FRAMES + 5):
            await hub.feed(lazy, b"\x00garbage")  # each gets a BAD_FRAME reply nobody reads
        assert lazy.closed and hub.dropped_slow_connections == 1
        # the other connection is unaffected
        await hub.feed(busy, _step("b", 2, 0, [4]))
        received = [codec.parse_frame(await busy.outbound.receive()) for _ in range(2)]
        assert [codec.body_kind(r) for r in received] == ["open_ack", "result"]
        nursery.cancel_scope.cancel()


async def test_drain_notifies_open_sessions_and_frees_their_kv() -> None:
    hub, backend, scheduler = _make()
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        conn = hub.open_connection()
        await hub.feed(conn, _open("d"))
        await hub.drain()
        assert "d" not in backend.kv
        frames = [codec.parse_frame(data) async for data in conn.outbound]
        assert [codec.body_kind(f) for f in frames] == ["open_ack", "error"]
        assert frames[1].error.status == status_pb2.STATUS_UNAVAILABLE
        nursery.cancel_scope.cancel()


async def test_connections_are_bounded_and_unproven_ones_make_room() -> None:
    hub = Hub(FrameServer(_spec(), lambda *_: None), max_connections=2)
    a = hub.open_connection(trusted=True)
    b = hub.open_connection("10.0.0.1")
    c = hub.open_connection("10.0.0.2")  # at the limit: the oldest unproven connection goes
    assert b.closed and not a.closed and not c.closed and hub.idle_streams_closed == 1
    c.trusted = True
    with pytest.raises(TooManyConnections):  # every connection held is proven
        hub.open_connection("10.0.0.3")
    hub.close_connection(a)
    hub.open_connection()


async def test_unproven_streams_are_bounded_per_address_and_time_out() -> None:
    now = [0.0]
    hub = Hub(
        FrameServer(_spec(), lambda *_: None),
        lambda: now[0],
        max_connections=100,
        stream_idle_timeout_s=10.0,
        max_idle_streams_per_address=3,
    )
    idle = [hub.open_connection("10.0.0.9") for _ in range(5)]
    assert [c.closed for c in idle] == [True, True, False, False, False]  # the oldest made room
    other = hub.open_connection("10.0.0.8")  # another address is not affected
    now[0] = 9.9
    hub.close_idle_streams(now[0])
    assert not other.closed and hub.connections == 4
    now[0] = 10.0
    hub.close_idle_streams(now[0])
    assert other.closed and hub.connections == 0


async def test_a_connection_that_opened_a_session_is_proven_and_never_timed_out() -> None:
    now = [0.0]
    hub = Hub(FrameServer(_spec(), lambda *_: None), lambda: now[0], stream_idle_timeout_s=1.0)
    backend = FakeBackend()
    scheduler = Scheduler(backend, hub.on_outcome, max_batch_tokens=64, prefill_chunk_tokens=32)
    hub.attach(scheduler)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        gateway = hub.open_connection("10.0.0.1")
        idle = hub.open_connection("10.0.0.1")
        await hub.feed(gateway, _open("s"))
        await hub.feed(idle, b"\x00garbage")  # a refused frame proves nothing
        now[0] = 5.0
        hub.close_idle_streams(now[0])
        assert not gateway.closed and idle.closed
        assert hub.statistics().unproven_connections == 0
        nursery.cancel_scope.cancel()


async def test_a_proven_stream_owning_no_session_is_closed_once_silent_for_the_lease() -> None:
    now = [0.0]
    spec = _spec()  # idle_lease_s 300
    hub = Hub(FrameServer(spec, lambda *_: None), lambda: now[0], stream_idle_timeout_s=1.0)
    backend = FakeBackend()
    scheduler = Scheduler(backend, hub.on_outcome, max_batch_tokens=64, prefill_chunk_tokens=32)
    hub.attach(scheduler)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        owner = hub.open_connection("10.0.0.1")
        done = hub.open_connection("10.0.0.1")
        relay = hub.open_connection(trusted=True)  # the node's own socket to a gateway
        await hub.feed(owner, _open("kept"))
        await hub.feed(done, _open("gone"))
        await hub.feed(
            done,
            codec.serialize_frame(
                codec.cancel_frame(codec.SessionHeader("gone", 1, MODEL_FP, RECIPE_FP, 0, 4), step_id=9)
            ),
        )
        now[0] = spec.idle_lease_s - 1
        hub.close_idle_streams(now[0])
        assert not done.closed
        now[0] = spec.idle_lease_s
        hub.close_idle_streams(now[0])
        assert done.closed and not owner.closed and not relay.closed  # the owner's session is held
        nursery.cancel_scope.cancel()


def _refuse_ticket(ticket: bytes, sid: str, claim: object) -> None:
    raise TicketInvalidError("forged")


async def test_a_refused_open_does_not_prove_a_connection() -> None:
    hub = Hub(FrameServer(_spec(), _refuse_ticket), stream_idle_timeout_s=1.0)
    conn = hub.open_connection("10.0.0.1")
    await hub.feed(conn, _open("s"))
    assert codec.parse_frame(conn.outbound.receive_nowait()).error.status == status_pb2.STATUS_TICKET_INVALID
    assert hub.statistics().unproven_connections == 1


async def test_a_re_sent_step_is_answered_from_the_cache_once_per_read() -> None:
    hub = Hub(FrameServer(_spec(), lambda *_: None))
    computed = trio.Event()

    def on_outcome(outcome: StepOutcome) -> None:
        hub.on_outcome(outcome)
        computed.set()

    scheduler = Scheduler(FakeBackend(), on_outcome, max_batch_tokens=64, prefill_chunk_tokens=64)
    hub.attach(scheduler)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        conn = hub.open_connection()
        await hub.feed(conn, _open("r"))
        conn.outbound.receive_nowait()  # the ack
        step = _step("r", 2, 0, list(range(40)))
        await hub.feed(conn, step)
        with trio.fail_after(5):
            await computed.wait()  # the step's result is queued (not read)
        assert conn.sink.put_count == 2
        for _ in range(50):  # the same step again and again, nothing read
            await hub.feed(conn, step)
        assert conn.sink.put_count == 3 and hub.replays_suppressed == 49  # the result + one replay
        first = codec.parse_frame(conn.outbound.receive_nowait())
        cached = codec.parse_frame(conn.outbound.receive_nowait())
        assert first.step_id == cached.step_id == 2 and first.kv_len == cached.kv_len == 40
        await hub.feed(conn, step)  # read: the next re-send is answered again
        assert conn.sink.put_count == 4
        nursery.cancel_scope.cancel()


async def test_replies_are_bounded_in_bytes() -> None:
    hub = Hub(FrameServer(_spec(), lambda *_: None), reply_buffer_bytes=64 * 1024)
    lazy = hub.open_connection()
    sent = 0
    while not lazy.closed:
        await hub.feed(lazy, b"\x00" + b"x" * 100)  # each gets a BAD_FRAME reply nobody reads
        sent += 1
        assert lazy.sink.queued_bytes <= 64 * 1024
    assert hub.dropped_slow_connections == 1 and sent < OUTBOUND_FRAMES


async def test_steps_and_refusals_complete_at_once_and_only_an_open_waits_for_the_engine() -> None:
    hub, backend, scheduler = _make()
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        conn = hub.open_connection()
        await hub.feed(conn, _open("s"))  # its ack waits for the KV reservation
        assert backend.log == [("open", "s")]
        await hub.feed(conn, _step("s", 2, 0, [1, 2]))  # queued for the engine, not awaited
        await hub.feed(conn, b"\x01junk")  # refused at once
        with trio.fail_after(5):
            kinds = [codec.body_kind(codec.parse_frame(await conn.outbound.receive())) for _ in range(3)]
        assert kinds == ["open_ack", "error", "result"]  # the refusal did not wait behind the step
        hub.input_ended(conn)
        assert hub.connections == 0
        nursery.cancel_scope.cancel()


def test_stream_closes_and_refusals_log_within_a_budget() -> None:
    now = [0.0]
    budget = LogBudget(lambda: now[0], lines=3, window_s=10.0)
    assert [budget.take() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 10.0  # a new window: the next line says how many were held back
    assert [budget.take() for _ in range(2)] == [2, 0]
    assert held_back(2) == " (2 similar lines held back)" and held_back(0) == ""
