"""Round-trip sampling (common/rtt.py): the pure book, hint parsing, and the sampler pinging real
gRPC Health services on loopback through the grpcio adapter."""

from __future__ import annotations

import trio

from common.grpc_adapter import CallInfo, Service, open_grpc
from common.rtt import RttBook, RttSampler, RttSettings, parse_hints
from proto import codec
from proto.announce import MAX_RTT_SAMPLES

A, B = "a" * 64, "b" * 64


def test_book_reports_the_minimum_once_per_new_sample() -> None:
    book = RttBook(window=3, max_peers=4)
    for v in (30.0, 12.0, 50.0):
        book.record(A, v)
    book.record(B, 7.0)
    assert {(x.peer_id, x.rtt_ms) for x in book.take_report()} == {(A, 12.0), (B, 7.0)}
    book.record(A, 40.0)  # window: 12, 50, 40 -> the minimum is 12
    (sample,) = book.take_report()
    assert (sample.peer_id, sample.rtt_ms) == (A, 12.0)
    assert book.take_report() == ()  # nothing new since
    book.record(A, 45.0)
    book.record(A, 44.0)  # 12 left the window
    assert book.take_report()[0].rtt_ms == 40.0


def test_book_is_bounded_and_ignores_nonsense() -> None:
    book = RttBook(window=2, max_peers=50)
    for i in range(80):
        book.record(f"{i:064x}", 10.0 + i)
    assert len(book) == 50
    report = book.take_report()
    assert len(report) == MAX_RTT_SAMPLES
    assert report[0].peer_id == f"{79:064x}"  # freshest first
    assert len(book.take_report()) == 50 - MAX_RTT_SAMPLES  # the rest next time
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e9):
        book.record(A, bad)
    assert book.best(A) is None


def test_hints_are_validated_and_bounded() -> None:
    good = {"node_id": A, "address": "10.0.0.1:7470"}
    raw = [good, {"node_id": "nothex", "address": "x:1"}, {"node_id": B, "address": "no port"}, "junk", None]
    assert parse_hints(raw) == [(A, "10.0.0.1:7470")]
    assert parse_hints({"not": "a list"}) == []
    many = [{"node_id": f"{i:064x}", "address": f"10.0.0.{i}:7470"} for i in range(40)]
    assert len(parse_hints(many, limit=5)) == 5


async def test_sampler_pings_real_health_services() -> None:
    """Two Health services on loopback, one answering 30 ms late; a dead address; the sampler
    measures the live ones (the first contact twice), skips the dead one, and reports."""
    pings = {"fast": 0, "slow": 0}

    def health(name: str, delay_s: float):  # type: ignore[no-untyped-def]
        async def handler(request: bytes, info: CallInfo) -> bytes:
            pings[name] += 1
            await trio.sleep(delay_s)
            return b""

        return Service("swarm.v1.ShardService", {}, {"Health": handler}, {})

    async with open_grpc() as rt, trio.open_nursery() as nursery:
        fast = await nursery.start(rt.serve, "127.0.0.1", 0, [health("fast", 0.0)])
        slow = await nursery.start(rt.serve, "127.0.0.1", 0, [health("slow", 0.03)])

        async def ping(address: str) -> bytes:
            return await rt.unary(address, codec.HEALTH_METHOD, b"")

        me = "c" * 64
        sampler = RttSampler(
            ping,
            lambda: [(A, f"127.0.0.1:{fast}"), (me, "127.0.0.1:9")],  # itself: never pinged
            RttSettings(interval_s=0.05, timeout_s=1.0),
            own_id=me,
        )
        sampler.hint([(B, f"127.0.0.1:{slow}"), ("d" * 64, "127.0.0.1:1")])
        with trio.fail_after(30):
            await sampler.measure_once()
            await sampler.measure_once()
        assert pings == {"fast": 3, "slow": 3}  # 2 on first contact, then 1 per round
        report = {s.peer_id: s.rtt_ms for s in sampler.take_samples()}
        assert set(report) == {A, B}
        assert 30.0 <= report[B] < 1000.0
        assert 0.0 < report[A] < report[B]
        stats = sampler.statistics()
        assert stats.failures == 2 and stats.peers == 2  # the dead address, once per round
        # The loop runs on its own until cancelled.
        await nursery.start(sampler.run)
        await trio.sleep(0.2)
        assert sampler.statistics().rounds >= 4
        nursery.cancel_scope.cancel()
