"""Pure tests of client access and hardening: API keys and their file, quotas with an injected clock,
JSON bodies the parsers must refuse, what 5xx messages show, and the Route Session's deadlines."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from session_sim import Fault, SimSwarm, make_nodes, run_request
from test_route_session_properties import MAX_NEW, PROMPT, REFERENCE, SPANS

from common.keyfile import KeyFileError
from gateway import protocol
from gateway.api_keys import (
    AuthPolicy,
    KeyTable,
    Limits,
    find,
    format_key_file,
    key_hash,
    make_record,
    new_key,
    parse_key_file,
)
from gateway.errors import (
    AuthenticationFailed,
    InvalidRequest,
    NoRoute,
    Overloaded,
    StageBusy,
    StageFailed,
    UpstreamFailed,
    public_message,
    scrub,
)
from gateway.quota import QuotaBook, cap_max_tokens
from gateway.route_session import _gateway_error

# --------------------------------------------------------------------------- keys


def test_a_key_is_random_and_only_its_hash_is_written() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("sk-swarm-") and len(k) == 9 + 43 for k in keys)
    key = new_key()
    record = make_record(key, "alice", 1_700_000_000, Limits(2, 1000, 64))
    text = format_key_file([record])
    assert key not in text and key[9:] not in text and key_hash(key) in text
    assert parse_key_file(text) == [record]
    assert record.id == "key_" + key_hash(key)[:12]


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1]",
        '{"sha256": "abc"}',
        '{"sha256": "' + "A" * 64 + '"}',
        '{"sha256": "' + "a" * 64 + '", "max_tokens": -1}',
        '{"sha256": "' + "a" * 64 + '", "max_tokens": "10"}',
        '{"sha256": "' + "a" * 64 + '", "max_sesions": 1}',  # a typo must not drop a limit silently
    ],
)
def test_a_malformed_key_file_line_is_refused_with_its_number(line: str) -> None:
    with pytest.raises(KeyFileError, match="line 2"):
        parse_key_file("# comment\n" + line + "\n")


def test_the_same_key_twice_is_refused_and_refs_find_one_key() -> None:
    a = make_record(new_key(), "alice", 0, Limits())
    b = make_record(new_key(), "bob", 0, Limits())
    with pytest.raises(KeyFileError, match="twice"):
        parse_key_file(format_key_file([a, a]))
    assert find([a, b], "alice") == [a] and find([a, b], a.id) == [a] and find([a, b], a.id[:12]) == [a]
    assert find([a, b], "key_") == []  # a short prefix matches nothing


def test_authentication_outcomes() -> None:
    key = new_key()
    table = KeyTable([make_record(key, "alice", 0, Limits(max_sessions=3))])
    open_policy = AuthPolicy(allow_anonymous=True, anonymous=Limits(max_tokens=100))
    closed = AuthPolicy(allow_anonymous=False)
    who = table.authenticate(key, "10.0.0.1", closed)
    assert not who.anonymous and who.name == "alice" and who.limits.max_sessions == 3
    assert who.id.startswith("key_") and key not in who.id
    anon = table.authenticate(None, "10.0.0.1", open_policy)
    assert anon.anonymous and anon.id == "anon:10.0.0.1" and anon.limits.max_tokens == 100
    with pytest.raises(AuthenticationFailed) as missing:
        table.authenticate(None, "10.0.0.1", closed)
    assert missing.value.status == 401 and missing.value.code == "missing_api_key"
    for policy in (open_policy, closed):  # a wrong key is never downgraded to anonymous
        with pytest.raises(AuthenticationFailed) as wrong:
            table.authenticate(key + "x", "10.0.0.1", policy)
        assert wrong.value.code == "invalid_api_key" and key not in wrong.value.message
    # No keys at all: everyone is anonymous, whatever token they send.
    assert KeyTable().authenticate("sk-anything", "h", closed).anonymous


# --------------------------------------------------------------------------- quotas


def test_sessions_at_once_per_identity() -> None:
    book = QuotaBook()
    limits = Limits(max_sessions=2)
    assert book.begin("k", limits, 0).ok and book.begin("k", limits, 0).ok
    third = book.begin("k", limits, 0)
    assert not third.ok and third.limit == "sessions" and third.retry_after_s >= 1
    assert book.begin("other", limits, 0).ok  # per identity
    book.end("k", 10, 1)
    assert book.begin("k", limits, 1).ok


def test_tokens_per_minute_bucket_refills_with_the_clock() -> None:
    book = QuotaBook()
    limits = Limits(tokens_per_minute=600)  # 10 tokens per second
    assert book.begin("k", limits, 0).ok
    book.end("k", 900, 0)  # one request may overshoot: the bucket goes to -300
    refused = book.begin("k", limits, 0)
    assert not refused.ok and refused.limit == "tokens_per_minute"
    assert refused.retry_after_s == 31  # (300 + 1) tokens at 10/s, rounded up
    assert not book.begin("k", limits, 30.0).ok
    assert book.begin("k", limits, 30.2).ok
    book.end("k", 0, 31)
    assert book.balance("k", 1000) == 600  # never more than one minute's worth


def test_new_limits_apply_to_an_identity_at_once() -> None:
    book = QuotaBook()
    assert book.begin("k", Limits(max_sessions=5, tokens_per_minute=1000), 0).ok
    refused = book.begin("k", Limits(max_sessions=1, tokens_per_minute=1000), 0)
    assert not refused.ok and refused.limit == "sessions"


def test_idle_identities_are_forgotten() -> None:
    book = QuotaBook()
    limits = Limits(tokens_per_minute=60)
    for i in range(50):
        assert book.begin(f"anon:{i}", limits, 0).ok
        book.end(f"anon:{i}", 30, 0)
    assert len(book) == 50
    book.prune(10)  # buckets not yet full again
    assert len(book) == 50
    book.prune(31)
    assert len(book) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["begin", "end"]), st.integers(0, 3), st.integers(0, 500), st.floats(0, 5)),
        max_size=80,
    )
)
def test_quota_invariants_under_random_operations(ops: list[tuple[str, int, int, float]]) -> None:
    book = QuotaBook()
    limits = Limits(max_sessions=2, tokens_per_minute=1000)
    now = 0.0
    running = {i: 0 for i in range(4)}
    for op, who, tokens, dt in ops:
        now += dt
        ident = f"k{who}"
        if op == "begin":
            decision = book.begin(ident, limits, now)
            if decision.ok:
                running[who] += 1
            else:
                assert decision.retry_after_s >= 1
        elif running[who]:
            book.end(ident, tokens, now)
            running[who] -= 1
        assert book.active(ident) == running[who] <= 2
        balance = book.balance(ident, now)
        assert balance is None or balance <= 1000


def test_max_tokens_cap() -> None:
    assert cap_max_tokens(None, Limits()) is None and cap_max_tokens(5000, Limits()) == 5000
    assert cap_max_tokens(None, Limits(max_tokens=64)) == 64
    assert cap_max_tokens(10, Limits(max_tokens=64)) == 10
    with pytest.raises(ValueError, match="at most 64"):
        cap_max_tokens(65, Limits(max_tokens=64))


# --------------------------------------------------------------------------- bodies that gave 500


def test_deep_nesting_and_lone_surrogates_are_400() -> None:
    deep = json.loads('{"model": "m", "messages": ' + "[" * 80 + "]" * 80 + "}")
    with pytest.raises(InvalidRequest) as nested:
        protocol.check_json_value(deep)
    assert nested.value.status == 400 and "64 levels" in nested.value.message
    body = json.loads('{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}')
    with pytest.raises(InvalidRequest) as surrogate:
        protocol.check_json_value(body)
    assert surrogate.value.param == "messages[0].content" and "surrogate" in surrogate.value.message
    key = json.loads('{"model": "m", "\\udc00": 1}')
    with pytest.raises(InvalidRequest) as bad_key:
        protocol.check_json_value(key)
    (bad_key.value.message + str(bad_key.value.param)).encode("utf-8")  # the answer itself is valid
    protocol.check_json_value(json.loads('{"model": "m", "messages": [{"content": "é€😀 \\ud83d\\ude00"}]}'))


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
def test_check_json_value_refuses_only_with_400(value: object) -> None:
    try:
        protocol.check_json_value(value)
    except InvalidRequest as err:
        assert err.status == 400


# --------------------------------------------------------------------------- what clients read


def test_server_errors_hide_node_ids_and_addresses() -> None:
    node = "3fa2c1d09bd1e2f3" * 4
    failure = StageFailed(f"node {node[:8]} at 10.1.2.3:7461 did not answer Info", node_id=node)
    text = public_message(failure, "chatcmpl-abc")
    assert node[:8] not in text and "10.1.2.3" not in text and "chatcmpl-abc" in text
    busy = StageBusy(f"node {node[:8]} is full", node_id=node)
    assert node[:8] not in public_message(busy, "r")
    tracker = UpstreamFailed("the tracker is unreachable: ConnectError('tracker.example.org:7460')")
    assert "example.org" not in public_message(tracker, "r") and "tracker" in public_message(tracker, "r")
    full = Overloaded(f"every route tried is full right now (node {node[:8]} at [::1]:7461 is full)")
    assert node[:8] not in public_message(full, "r") and "::1" not in public_message(full, "r")
    layers = NoRoute(f"no live node serves exactly layers [15, 30) (live spans: [0, 15) on {node[:8]})")
    assert "[15, 30)" in public_message(layers, "r") and node[:8] not in public_message(layers, "r")
    client = InvalidRequest("'temperature' must be a number", param="temperature")
    assert public_message(client, "r") == client.message  # 4xx messages are the client's own business
    assert scrub("relay:abcdef0123 localhost:8000 192.168.0.1") == "<address> <address> <address>"


# --------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize(("hang_at", "bound_s"), [(30, 20.0), (60, 6.0)])
def test_a_hung_stage_is_noticed_in_seconds_not_at_the_ceiling(hang_at: int, bound_s: float) -> None:
    # Event 30 is in the prefill, 60 in the decode (13-token prompt, 5 positions per step). With the
    # ceilings of a real gateway (120 s per prefill step, 30 s per decode step), the adaptive deadlines
    # (measured steps, the tracker's estimate as prior) notice the hang within the bound.
    nodes, by_span = make_nodes(SPANS, spares=1)
    swarm = SimSwarm(nodes, random.Random(5))
    timeouts = {
        "prefill_step_timeout_s": 120.0,
        "decode_step_timeout_s": 30.0,
        "decode_timeout_floor_s": 3.0,
        "prefill_timeout_floor_s": 15.0,
        "expected_step_s": 0.002,
    }
    result = run_request(
        swarm, by_span, PROMPT, MAX_NEW, faults=[Fault("hang", hang_at, "n8-12-0")], timeouts=timeouts
    )
    assert result.tokens == REFERENCE and result.failed is None and result.recoveries == 1
    assert swarm.now < bound_s, f"the hung stage held the session {swarm.now:.1f} s"


# --------------------------------------------------------------------------- the shell: reloads


def test_the_key_file_is_reread_when_it_changes_and_a_broken_change_keeps_the_keys(tmp_path: Path) -> None:
    import os

    import trio

    from gateway.access import RELOAD_CHECK_S, Access
    from gateway.metrics import Metrics

    path = tmp_path / "keys.jsonl"
    alice, bob = new_key(), new_key()
    path.write_text(format_key_file([make_record(alice, "alice", 0, Limits())]))
    now = [0.0]
    metrics = Metrics()
    access = Access(path, AuthPolicy(allow_anonymous=False), metrics, clock=lambda: now[0])

    def touch(text: str, mtime: float) -> None:
        path.write_text(text)
        os.utime(path, (mtime, mtime))

    async def main() -> None:
        assert (await access.principal("Bearer " + alice, "h")).name == "alice"
        for header in ("", "Bearer", "Bearer   "):
            with pytest.raises(AuthenticationFailed) as missing:
                await access.principal(header, "h")
            assert missing.value.code == "missing_api_key"
        with pytest.raises(AuthenticationFailed):
            await access.principal("Bearer " + bob, "h")
        touch(format_key_file([make_record(bob, "bob", 0, Limits())]), 2_000_000_000)
        assert (await access.principal("Bearer " + alice, "h")).name == "alice"  # not re-checked yet
        now[0] += RELOAD_CHECK_S
        assert (await access.principal("Bearer " + bob, "h")).name == "bob"
        with pytest.raises(AuthenticationFailed):
            await access.principal("Bearer " + alice, "h")  # revoked
        touch("{broken", 2_000_000_100)
        now[0] += RELOAD_CHECK_S
        assert (await access.principal("Bearer " + bob, "h")).name == "bob"  # the last good keys

    trio.run(main)
    assert "key_" not in metrics.render({}) and alice not in metrics.render({})


def test_a_session_that_lost_a_stage_and_its_replacement_names_both() -> None:
    # n8-12-0 hangs, n8-12-1 replaces it and hangs too: the session gives up naming both, so the
    # whole-route re-run (serving.py) avoids both rather than re-opening on the first hung node.
    nodes, by_span = make_nodes(SPANS, spares=2)
    swarm = SimSwarm(nodes, random.Random(5))
    plan = [Fault("hang", 60, "n8-12-0"), Fault("hang", 70, "n8-12-1")]
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan)
    assert result.tokens == REFERENCE and result.route_runs == 2
    (failed,) = swarm.failures
    assert failed.failure.node_id == "n8-12-1"
    assert failed.failure.failed_nodes == {"n8-12-0", "n8-12-1"}
    error = _gateway_error(failed.failure)
    assert isinstance(error, StageFailed) and error.failed_nodes == {"n8-12-0", "n8-12-1"}


# --------------------------------------------------------------------------- tracker outage


def test_route_cache_serves_valid_tickets_through_a_tracker_outage_and_refreshes_after() -> None:
    import secrets

    import httpx
    import nacl.signing
    import trio

    from gateway.metrics import Metrics
    from gateway.routes import STALE_MARGIN_S, TRACKER_RETRY_S, RouteCache
    from gateway.tracker_key import TrackerKey
    from proto.signing import RouteTicket, TicketHop, public_key_hex, sign_route_ticket

    now = [1000.0]
    calls: list[str] = []
    down = [False]

    tracker_key = nacl.signing.SigningKey(bytes([9]) * 32)

    class Tracker:
        key_id = "g" * 64

        async def routes(self, model: str, **_: object) -> dict:
            calls.append(model)
            if down[0]:
                raise httpx.ConnectError("connection refused")
            hop = {"node_id": "a" * 64, "start": 0, "end": 30, "address": "127.0.0.1:1"}
            ticket = RouteTicket(
                "",
                secrets.token_hex(16),
                "f" * 64,
                (TicketHop("a" * 64, 0, 30, "127.0.0.1:1"),),
                now[0],
                now[0] + 300,
            )
            route = {
                "hops": [hop],
                "ticket": sign_route_ticket(tracker_key, ticket),
                "expires_at": now[0] + 300,
                "expected_ms_per_token": 5,
            }
            return {"model": {"fingerprint": "f" * 64, "name": "m", "n_layers": 30}, "routes": [route]}

    metrics = Metrics()
    cache = RouteCache(
        Tracker(),  # type: ignore[arg-type]
        k=2,
        ttl_s=10,
        tracker_timeout_s=5,
        metrics=metrics,
        tracker_key=TrackerKey(public_key_hex(tracker_key)),
        clock=lambda: now[0],
    )

    async def main() -> None:
        first = await cache.routes("m")
        assert len(calls) == 1
        down[0] = True
        now[0] += 11  # past the TTL: the tracker is asked, fails, the cached tickets serve
        stale = await cache.routes("m")
        assert stale.routes == first.routes and len(calls) == 2
        now[0] += 1
        await cache.routes("m")
        assert len(calls) == 2  # not asked again within TRACKER_RETRY_S
        cache.invalidate("m")  # a node failed: the routes stay as the outage fallback
        assert (await cache.fetch_excluding("m", frozenset())).routes == first.routes
        with pytest.raises(UpstreamFailed):  # no cached route avoids the excluded node
            await cache.fetch_excluding("m", frozenset({"a" * 64}))
        now[0] = first.routes[0].expires_at_s - STALE_MARGIN_S + 0.1  # tickets about to expire
        with pytest.raises(UpstreamFailed):
            await cache.routes("m")
        down[0] = False
        now[0] += TRACKER_RETRY_S
        fresh = await cache.routes("m")
        assert fresh.routes[0].ticket != first.routes[0].ticket  # refreshed from the tracker

    trio.run(main)
    text = metrics.render({})
    assert 'swarm_gateway_tracker_route_requests_total{outcome="stale"} 3.0' in text


# --------------------------------------------------------------------------- a reader that stops


def test_a_job_whose_reader_takes_nothing_for_stall_s_is_cancelled_as_stalled() -> None:
    import trio
    import trio.testing

    from gateway.generation import Delta
    from gateway.jobs import Job, deliver
    from gateway.protocol import GenerationRequest

    async def main() -> None:
        send, receive = trio.open_memory_channel[object](1)
        job = Job(
            request=GenerationRequest(kind="chat", model="m"),
            client="c",
            request_id="r",
            events=receive,  # type: ignore[arg-type]
            cancel_scope=trio.CancelScope(),
            stall_s=30.0,
        )
        start = trio.current_time()
        with job.cancel_scope:
            await deliver(job, send, Delta("a", ()))  # room: at once
            async with trio.open_nursery() as nursery:

                async def reader_takes_one_then_stops() -> None:
                    await trio.sleep(10)
                    await receive.receive()

                nursery.start_soon(reader_takes_one_then_stops)
                await deliver(job, send, Delta("b", ()))  # waits 10 s for the reader
                assert trio.current_time() - start == pytest.approx(10.0) and not job.stalled
                await deliver(job, send, Delta("c", ()))  # the reader is gone for good
            raise AssertionError("not reached: the job is cancelled")
        assert job.cancel_scope.cancelled_caught and job.stalled
        assert trio.current_time() - start == pytest.approx(40.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
