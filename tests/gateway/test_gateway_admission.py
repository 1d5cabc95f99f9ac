"""Admission policy (pure) and its trio gate."""

from __future__ import annotations

import pytest
import trio

from gateway.admission import AdmissionPolicy, least_loaded
from gateway.errors import Overloaded, RateLimited
from gateway.gate import Gate


def test_admit_queue_reject_fifo() -> None:
    p = AdmissionPolicy(max_sessions=2, max_queue=1)
    assert p.decide(1, "a").action == "admit"
    assert p.decide(2, "b").action == "admit"
    assert p.decide(3, "c").action == "queue"
    d = p.decide(4, "d")
    assert (d.action, d.status) == ("reject", 503) and d.retry_after_s >= 1 and "queued" in d.reason
    p.release(1, 2.0)
    assert p.promote() == [3] and p.is_active(3)
    assert p.stats().active == 2 and p.stats().queued == 0


def test_per_client_limit_and_abandon() -> None:
    p = AdmissionPolicy(max_sessions=1, max_queue=5, max_per_client=2)
    assert p.decide(1, "a").action == "admit"
    assert p.decide(2, "a").action == "queue"
    d = p.decide(3, "a")
    assert (d.action, d.status) == ("reject", 429)
    assert p.decide(4, "b").action == "queue"
    p.abandon(2)
    assert p.decide(5, "a").action == "queue"
    p.release(1)
    assert p.promote() == [4]  # FIFO: b was queued before a's second request


def test_invariants_under_random_operations() -> None:
    import random

    rng = random.Random(7)
    p = AdmissionPolicy(max_sessions=3, max_queue=4, max_per_client=3)
    active: set[int] = set()
    queued: list[int] = []
    for t in range(1, 500):
        op = rng.random()
        if op < 0.5:
            d = p.decide(t, f"c{rng.randrange(3)}")
            if d.action == "admit":
                active.add(t)
            elif d.action == "queue":
                queued.append(t)
        elif op < 0.8 and active:
            victim = rng.choice(sorted(active))
            active.discard(victim)
            p.release(victim, rng.random())
            for moved in p.promote():
                assert moved == queued.pop(0)
                active.add(moved)
        elif queued:
            victim = queued.pop(rng.randrange(len(queued)))
            p.abandon(victim)
        s = p.stats()
        assert s.active == len(active) <= 3 and s.queued == len(queued) <= 4
        if s.queued:
            assert s.active == 3  # nobody waits while a slot is free


def test_least_loaded() -> None:
    routes = ["r1", "r2", "r3"]
    cost = {"r1": 2.0, "r2": 1.0, "r3": 1.0}
    assert least_loaded(routes, lambda r: 0, cost.__getitem__) == "r2"
    assert least_loaded(routes, {"r1": 0, "r2": 1, "r3": 0}.__getitem__, cost.__getitem__) == "r3"
    assert least_loaded(routes, {"r1": 0, "r2": 1, "r3": 1}.__getitem__, cost.__getitem__) == "r1"
    with pytest.raises(ValueError):
        least_loaded([], lambda r: 0, cost.__getitem__)


async def test_gate_queues_times_out_and_wakes() -> None:
    gate = Gate(AdmissionPolicy(max_sessions=1, max_queue=1, max_per_client=0), queue_timeout_s=0.2)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        release = trio.Event()

        async def holder() -> None:
            async with gate.slot("a"):
                order.append("a-in")
                await release.wait()
            order.append("a-out")

        async def waiter() -> None:
            async with gate.slot("b"):
                order.append("b-in")

        nursery.start_soon(holder)
        await trio.sleep(0.01)
        nursery.start_soon(waiter)
        await trio.sleep(0.01)
        with pytest.raises(Overloaded) as info:  # queue (1) is full
            async with gate.slot("c"):
                pass
        assert info.value.retry_after_s and info.value.status == 503
        release.set()
    assert order == ["a-in", "a-out", "b-in"]
    # A waiter that times out leaves the queue.
    async with gate.slot("x"):
        with pytest.raises(Overloaded):
            async with gate.slot("y"):
                pass
        assert gate.statistics().queued == 0
    assert gate.statistics().active == 0


async def test_gate_cancelled_waiter_leaves_queue() -> None:
    gate = Gate(AdmissionPolicy(max_sessions=1, max_queue=2, max_per_client=1), queue_timeout_s=10)
    async with gate.slot("a"):
        with trio.move_on_after(0.05):
            async with gate.slot("b"):
                pass
        assert gate.statistics().queued == 0
        with pytest.raises(RateLimited):
            async with gate.slot("a"):
                pass
    assert gate.statistics().active == 0
