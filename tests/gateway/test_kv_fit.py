"""Routes by free KV at the gateway: each hop's announced free KV, which routes can hold a request, the
swarm's largest contexts from the tracker, and the bounded wait for KV room (policy and trio shell)."""

from __future__ import annotations

import pytest
import trio

from gateway.admission import KvWaitPolicy, fits_kv, kv_need, kv_room, kv_verdict, route_context
from gateway.errors import KvExhausted
from gateway.gate import KvGate
from gateway.routes import parse_routes


def _answer(*free: object) -> dict:
    hops = [
        {"node_id": f"n{i}", "start": 15 * i, "end": 15 * i + 15, "address": f"h:{i}", "kv_free_tokens": f}
        for i, f in enumerate(free)
    ]
    route = {"hops": hops, "ticket": {"payload": "x"}, "expires_at": 1e10, "expected_ms_per_token": 1.0}
    return {"model": {"fingerprint": "ab" * 32, "name": "m", "n_layers": 30}, "routes": [route]}


def test_hops_carry_the_free_kv_the_tracker_saw() -> None:
    hops = parse_routes(_answer(4096, None), 0.0).routes[0].hops
    assert [h.kv_free_tokens for h in hops] == [4096, None]
    # Nonsense is "not known", never a number the gateway would trust.
    for bad in (-5, "many", True, 1.5):
        assert parse_routes(_answer(bad, 1), 0.0).routes[0].hops[0].kv_free_tokens is None
    old = _answer(1, 2)
    for hop in old["routes"][0]["hops"]:
        del hop["kv_free_tokens"]  # a tracker from before the field
    assert [h.kv_free_tokens for h in parse_routes(old, 0.0).routes[0].hops] == [None, None]


def test_the_tightest_stage_decides_and_unknown_stages_are_trusted() -> None:
    assert kv_room([8192, 2048]) == 2048
    assert kv_room([None, 3000]) == 3000
    assert kv_room([None, None]) is None and kv_room([]) is None
    assert fits_kv([8192, 6016], 6000) and not fits_kv([8192, 5999], 6000)
    assert fits_kv([None, None], 10**6)  # nothing announced: the nodes decide
    assert not fits_kv([None, 100], 101)


def test_a_request_needs_whole_blocks() -> None:
    # The pool hands out and announces whole 16-position blocks: 40 positions take 3 blocks.
    assert kv_need(30, 10) == 48 and kv_need(32, 16) == 48 and kv_need(31, 1) == 32
    assert kv_need(0, None) == 16 and kv_need(100, None) == 112  # no max_tokens: prompt and one token
    # Two requests of 40 positions each on 80 free: in positions both would fit, in blocks one does.
    free = 80
    first = kv_need(30, 10)
    assert fits_kv([free], first) and not fits_kv([free - first], kv_need(30, 10))


def test_the_answer_carries_the_swarms_largest_contexts() -> None:
    body = {**_answer(1, 2), "kv": {"session_max_tokens": 8192, "free_max_tokens": 300}}
    routes = parse_routes(body, 0.0)
    assert (routes.kv_session_max_tokens, routes.kv_free_max_tokens) == (8192, 300)
    for kv in ({}, {"session_max_tokens": None}, {"session_max_tokens": "x"}, "nonsense"):
        assert parse_routes({**_answer(1), "kv": kv}, 0.0).kv_session_max_tokens is None
    assert parse_routes(_answer(1), 0.0).kv_session_max_tokens is None  # a tracker from before it


def test_the_kv_verdict() -> None:
    assert route_context([4096, None, 8192]) == 4096 and route_context([None]) is None
    assert kv_verdict(5000, 4096, [10_000]) == "too_long"  # past every route's context: 413
    assert kv_verdict(3000, 4096, [1000, 2999]) == "wait"  # fits a context, no free KV now
    assert kv_verdict(3000, 4096, [1000, 3000]) == "fits"
    assert kv_verdict(3000, None, [None, 10]) == "fits"  # a route nobody described: the nodes decide
    assert kv_verdict(3000, None, []) == "fits"


def test_the_kv_wait_is_bounded_and_first_come_first_served() -> None:
    policy = KvWaitPolicy(max_waiters=2, mean_wait_s=2.0)
    assert policy.enter(1, 0.0).action == "queue" and policy.enter(2, 0.5).action == "queue"
    full = policy.enter(3, 1.0)
    assert (full.action, full.status) == ("reject", 503) and full.retry_after_s >= 1
    assert policy.is_first(1) and not policy.is_first(2)
    assert policy.enter(1, 2.0).action == "queue"  # already waiting: keeps its place
    policy.leave(1, 3.0, served=True)
    assert policy.is_first(2) and not policy.is_waiting(1)
    policy.leave(2, 4.0, served=False, timed_out=True)
    policy.leave(2, 5.0, served=True)  # twice: nothing more
    stats = policy.stats()
    assert (stats.waiting, stats.waits_total, stats.served_total, stats.rejected_total) == (0, 2, 1, 1)
    assert stats.timed_out_total == 1 and stats.waited_s_total == 3.0 + 3.5


async def test_the_kv_gate_wakes_the_first_in_line_when_a_session_ends_and_times_out() -> None:
    gate = KvGate(KvWaitPolicy(max_waiters=2), wait_s=1.0, retry_s=30.0)
    order: list[str] = []
    async with trio.open_nursery() as nursery:

        async def wait(name: str) -> None:
            async with gate.waiting() as waiter:
                await waiter.turn()
                order.append(name)
                waiter.served = True

        nursery.start_soon(wait, "a")
        await trio.sleep(0.01)
        nursery.start_soon(wait, "b")
        await trio.sleep(0.01)
        with pytest.raises(KvExhausted) as full:  # two wait already
            gate.enter()
        assert full.value.status == 503 and full.value.code == "kv_exhausted" and full.value.retry_after_s
        await trio.sleep(0.01)
        assert order == []  # both just tried and found no room: they wait for a change
        gate.notify_freed()  # a session ended: the first in line tries again, then (room not known) the next
        await trio.sleep(0.01)
    assert order == ["a", "b"] and gate.statistics().served_total == 2
    start = trio.current_time()
    with pytest.raises(KvExhausted) as late:
        async with gate.waiting() as waiter:
            await waiter.turn()  # nobody frees anything: kv_wait_s passes
    assert trio.current_time() - start >= 1.0 and late.value.retry_after_s
    assert gate.statistics().timed_out_total == 1 and gate.statistics().waiting == 0
