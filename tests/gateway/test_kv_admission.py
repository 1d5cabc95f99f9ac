"""The order of the KV wait and the gateway's ledger of committed KV (pure: gateway.admission).

Properties (hypothesis) of :class:`KvWaitPolicy` driven the way the gate drives it -- waiters enter
with their needs, the one :meth:`next_up` names is admitted out of the room and leaves served,
sessions end and give room back, time passes:

* the waiter named always fits the room given (nothing is admitted beyond the free KV believed);
* no waiter of ``fit`` or ``shortest`` is bypassed more than ``max_bypass`` times, and none that
  waited ``max_wait_s`` sees a later arrival go before it;
* among waiters of equal need, arrival order; under ``fifo`` nobody is ever bypassed;
* ``shortest`` names the fewest-positions waiter that fits (when nobody is overdue).

And :class:`KvLedger`: a burst committed on one stale figure is taken off it; released sessions give
back what the figure showed them holding, and nothing they never showed; entries are bounded.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import KV_ADMISSION_ORDERS, KvLedger, KvWaitPolicy
from gateway.gate import KvGate

POOL = 1000


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, int, float, list[tuple[str, int]]]:
    order = draw(st.sampled_from(KV_ADMISSION_ORDERS))
    max_bypass = draw(st.integers(0, 4))
    max_wait_s = draw(st.sampled_from([0.0, 3.0, 10.0]))
    ops = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("enter"), st.integers(1, POOL)),
                st.tuples(st.just("admit"), st.just(0)),
                st.tuples(st.just("end"), st.integers(0, 50)),
                st.tuples(st.just("tick"), st.integers(1, 4)),
            ),
            max_size=60,
        )
    )
    return order, max_bypass, max_wait_s, ops


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_kv_wait_admits_within_the_room_and_bounds_bypasses(
    scenario: tuple[str, int, float, list[tuple[str, int]]],
) -> None:
    order, max_bypass, max_wait_s, ops = scenario
    policy = KvWaitPolicy(64, order=order, max_bypass=max_bypass, max_wait_s=max_wait_s)
    free = POOL
    now = 0.0
    ticket = 0
    needs: dict[int, int] = {}
    entered: dict[int, float] = {}
    running: list[int] = []  # needs of admitted sessions
    admitted: list[int] = []
    for op, arg in ops:
        if op == "enter":
            ticket += 1
            assert policy.enter(ticket, now, arg).action == "queue"
            needs[ticket], entered[ticket] = arg, now
        elif op == "tick":
            now += arg
        elif op == "end" and running:
            free += running.pop(arg % len(running))
        elif op == "admit":
            waiting = [t for t in needs if policy.is_waiting(t)]
            overdue_before = [
                t
                for t in waiting
                if order != "fifo"
                and (
                    (max_bypass and policy.bypassed(t) >= max_bypass)
                    or (max_wait_s and now - entered[t] >= max_wait_s)
                )
            ]
            chosen = policy.next_up(now, lambda key, room=free: room)
            if chosen is None:
                continue
            assert needs[chosen] <= free  # never beyond the KV believed free
            if order == "fifo":
                assert chosen == waiting[0]  # nobody passes the first in line
            if overdue_before:
                assert chosen == overdue_before[0]  # the first overdue goes first
            elif order == "shortest":
                fitting = [t for t in waiting if needs[t] <= free]
                assert needs[chosen] == min(needs[t] for t in fitting)
            # equal needs keep arrival order
            assert not any(t < chosen and needs[t] == needs[chosen] for t in waiting)
            for t in waiting:
                if t < chosen and max_wait_s and now - entered[t] >= max_wait_s:
                    raise AssertionError(f"{t} waited {now - entered[t]} s and {chosen} went before it")
            free -= needs[chosen]
            running.append(needs[chosen])
            policy.leave(chosen, now, served=True)
            admitted.append(chosen)
        for t in needs:
            if policy.is_waiting(t):
                if order == "fifo":
                    assert policy.bypassed(t) == 0
                elif max_bypass:
                    assert policy.bypassed(t) <= max_bypass


def test_shortest_passes_a_long_waiter_at_most_n_times_then_it_blocks_the_rest() -> None:
    policy = KvWaitPolicy(8, order="shortest", max_bypass=2, max_wait_s=0)
    policy.enter(1, 0.0, 900)  # long: does not fit 500
    for t in (2, 3, 4):
        policy.enter(t, 0.0, 100)
    assert policy.next_up(1.0, lambda key: 500) == 2
    policy.leave(2, 1.0, served=True)
    assert policy.next_up(1.0, lambda key: 500) == 3
    policy.leave(3, 1.0, served=True)
    assert policy.bypassed(1) == 2
    assert policy.next_up(1.0, lambda key: 500) is None  # overdue and not fitting: 4 waits behind it
    assert policy.next_up(1.0, lambda key: 1000) == 1
    assert policy.stats().overdue_total == 1
    fifo = KvWaitPolicy(8, order="fifo")
    fifo.enter(1, 0.0, 900)
    fifo.enter(2, 0.0, 100)
    assert fifo.next_up(0.0, lambda key: 500) is None  # head of line
    assert fifo.next_up(0.0, lambda key: None) == 1  # room not known: the first tries


def test_waiters_of_another_model_are_not_held_back_and_the_time_bound_holds() -> None:
    policy = KvWaitPolicy(8, order="fit", max_bypass=0, max_wait_s=10.0)
    policy.enter(1, 0.0, 900, key="a")
    policy.enter(2, 1.0, 100, key="a")
    policy.enter(3, 1.0, 100, key="b")
    assert policy.next_up(5.0, lambda key: 500) == 2  # not overdue yet: the first that fits
    assert policy.next_up(10.0, lambda key: 500) == 3  # 1 is overdue: "a" waits, "b" does not
    assert policy.next_up(10.0, lambda key: 500, skip={3}) is None
    assert policy.waiting_for("a") and policy.waiting_for("b") and not policy.waiting_for("c")


def test_bad_policy_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="order"):
        KvWaitPolicy(4, order="random")
    with pytest.raises(ValueError):
        KvWaitPolicy(4, max_bypass=-1)
    with pytest.raises(ValueError):
        KvWaitPolicy(4).enter(1, 0.0, -5)


def test_the_ledger_takes_a_burst_off_a_stale_figure_and_gives_back_what_it_showed() -> None:
    ledger = KvLedger(lag_s=10.0, keep_s=60.0)
    # Announced 1,000 free at a heartbeat before t=100 (fetched at 100); three commits at 101..103.
    for key, at in ((1, 101.0), (2, 102.0), (3, 103.0)):
        ledger.commit(key, ["n1", "n2"], 300, at)
    assert ledger.free("n1", 1000, fetched_at=100.0) == 100
    assert ledger.free("n3", 1000, fetched_at=100.0) == 1000  # other node
    assert ledger.free("n1", None, fetched_at=100.0) is None
    # Settled at 104: a figure fetched after 114 shows it held; one fetched at 110 may not.
    ledger.settle(1, 104.0)
    assert ledger.adjustment("n1", 110.0) == -900
    assert ledger.adjustment("n1", 115.0) == -600
    # Released at 120 after holding 250: a figure fetched at 115 still shows it used -> give back 250;
    # one fetched after the release shows it freed (nothing to add).
    ledger.release(1, 120.0, used=250)
    assert ledger.adjustment("n1", 115.0) == -600 + 250
    assert ledger.adjustment("n1", 125.0) == -600
    # Never settled: released, it gives back nothing (its KV may never have shown).
    ledger.release(2, 121.0, used=300)
    assert ledger.adjustment("n1", 115.0) == -300 + 250
    assert not ledger.live(1) and ledger.live(3)
    assert ledger.free("n1", 100, fetched_at=100.0) == 0  # never below 0
    # Bounded: released entries go after keep_s, and the count is capped.
    ledger.commit(4, ["n1"], 1, 200.0)
    assert not any(ledger.live(k) for k in (1, 2)) and len(ledger) == 2
    forgot = KvLedger(lag_s=1.0, live_s=100.0)
    forgot.commit(1, ["n"], 5, 0.0)
    forgot.commit(2, ["n"], 5, 150.0)  # 1 was never released: gone after live_s
    assert not forgot.live(1) and forgot.live(2) and len(forgot) == 1
    small = KvLedger(lag_s=1.0, max_entries=3)
    for k in range(10):
        small.commit(k, ["n"], 1, float(k))
    assert len(small) == 3 and small.live(9)


async def test_the_gate_lets_the_shorter_waiter_through_while_the_long_one_waits() -> None:
    room = {"m": 500}
    gate = KvGate(
        KvWaitPolicy(8, order="shortest", max_bypass=1, max_wait_s=0),
        wait_s=30.0,
        retry_s=5.0,
        room=lambda key: room[key],
    )
    order: list[str] = []

    async def queue_up(name: str, need: int) -> None:
        async with gate.waiting("m", need) as waiter:
            await waiter.turn(after_try=name == "long")  # the long one tried; the others queued
            order.append(name)
            waiter.served = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue_up, "long", 900)
        await trio.sleep(0.01)
        nursery.start_soon(queue_up, "short1", 100)
        await trio.sleep(0.01)
        assert order == ["short1"]  # fits the room while the long one waits
        nursery.start_soon(queue_up, "short2", 100)
        await trio.sleep(0.01)
        assert order == ["short1"]  # the long one was bypassed once (the bound): short2 waits
        room["m"] = 1000
        gate.notify_freed()
        await trio.sleep(0.01)
    assert order == ["short1", "long", "short2"]
