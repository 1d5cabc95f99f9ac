"""The Route Session's reader-thread forwarding against two scripted nodes over real gRPC (in-process).

Checks what the end-to-end tests cannot see from outside: a sampled token's
next decode step is already at stage 0 before ``decode`` is called, ``decode``
adopts it instead of sending it again, anything else than ``decode`` of that
token fails loudly (stage 0 is one position ahead), and closing after a step
sent ahead frees every stage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from fake_node import FakeNode
from swarm_fixtures import scripted_nodes

from gateway.errors import StageFailed
from gateway.grpc_bridge import NodeChannels
from gateway.route_session import RouteSession, open_route_session
from gateway.routes import Hop, Route, StageInfo
from proto import codec

FINGERPRINT = "fb" * 32
BUDGET = 64


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> list[FakeNode]:
    made = scripted_nodes(
        model_path,
        tmp_path_factory.mktemp("fwd") / "cache",
        "one two three four five six seven eight nine ten eleven twelve",
        FINGERPRINT,
        [(0, 15), (15, 30)],
        first_seed=40,
    ).nodes
    yield made
    for node in made:
        node.stop()


def _stage(node: FakeNode) -> StageInfo:
    return StageInfo(
        node_id=node.node_id,
        address=f"127.0.0.1:{node.port}",
        recipe_fingerprint=node.recipe.fingerprint(),
        n_embd=576,
        n_layers=30,
        n_ctx_train=8192,
        is_last=node.is_last,
        serves_vocab=node.is_last,
        max_frame_bytes=4 << 20,
        max_step_tokens=512,
        max_kv_tokens_per_session=node.kv_per_session,
        fetched_at_s=time.monotonic(),
    )


@asynccontextmanager
async def session(nodes: list[FakeNode]) -> AsyncIterator[RouteSession]:
    route = Route(
        route_id="fake",
        model_fingerprint=FINGERPRINT,
        model_name="fake",
        n_layers=30,
        hops=tuple(Hop(n.node_id, n.start, n.end, f"127.0.0.1:{n.port}") for n in nodes),
        ticket=b"{}",
        expires_at_s=time.time() + 600,
        expected_ms_per_token=1.0,
    )
    channels = NodeChannels(max_frame_bytes=4 << 20, threads=8)
    try:
        async with open_route_session(
            channels,
            route,
            [_stage(n) for n in nodes],
            session_id="ab" * 16,
            request_id="t",
            sampling=codec.SamplingSettings(temperature=0.0),
            kv_budget_tokens=BUDGET,
            step_tokens=256,
            max_frame_bytes=1 << 20,
            reply_timeout_s=10,
            close_timeout_s=5,
        ) as s:
            yield s
    finally:
        await channels.aclose()


def _kv(node: FakeNode) -> int:
    with node.state.lock:
        return node.state.sessions.get("ab" * 16, -1)


async def _until(check, what: str) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(5):
        while not check():  # noqa: ASYNC110 - the fake node's state lives on its gRPC threads: poll it
            await trio.sleep(0.01)
    assert check(), what


async def test_the_next_step_is_at_stage_0_before_decode_is_called_and_is_adopted(
    nodes: list[FakeNode],
) -> None:
    async with session(nodes) as s:
        first = await s.prefill([1, 2, 3, 4])
        assert s.kv_len == 4 and s.steps_sent_ahead == 1
        # Stage 0 computes position 4 (the sampled token) on its own; stage 1 has not seen it yet.
        await _until(lambda: _kv(nodes[0]) == 5, "stage 0 to compute the step sent ahead")
        assert _kv(nodes[1]) == 4
        tokens = [first.token_id]
        for _ in range(5):
            tokens.append((await s.decode(tokens[-1])).token_id)
        assert s.kv_len == 9 and s.steps_sent_ahead == 6
        assert s.relays["reader"] + s.relays["loop"] == 6 and s.relays["reader"] >= 1
        s.finished = True
    await _until(lambda: _kv(nodes[0]) == -1 and _kv(nodes[1]) == -1, "RELEASE to free both stages")


async def test_anything_but_decode_of_the_sampled_token_fails_loudly(nodes: list[FakeNode]) -> None:
    async with session(nodes) as s:
        sampled = await s.prefill([5, 6, 7])
        with pytest.raises(StageFailed, match="already sent"):
            await s.decode(sampled.token_id + 1)
    # leaving with an error sends CANCEL: the extra position on stage 0 goes with the rest
    await _until(lambda: _kv(nodes[0]) == -1 and _kv(nodes[1]) == -1, "CANCEL to free both stages")


async def test_nothing_is_sent_ahead_past_the_kv_budget(nodes: list[FakeNode]) -> None:
    async with session(nodes) as s:
        sampled = await s.prefill(list(range(1, BUDGET - 1)))  # next position: BUDGET - 2, the last one used
        assert s.steps_sent_ahead == 1
        await s.decode(sampled.token_id)  # feeds position BUDGET - 2: its token is the last one generated
        assert s.steps_sent_ahead == 1
        await _until(lambda: _kv(nodes[0]) == BUDGET - 1, "stage 0 to finish the step")
        s.finished = True


async def test_a_client_that_stopped_reading_ends_the_job_like_a_disconnect() -> None:
    """No BrokenResourceError may escape from inside a Route Session's nurseries (it took the gateway
    down once): the job's own scope is cancelled instead and the way out is a plain cancellation."""
    from gateway.serving import Delta, Job, _deliver

    send, receive = trio.open_memory_channel(4)
    job = Job(request=None, client="c", request_id="r", events=receive, cancel_scope=trio.CancelScope())  # type: ignore[arg-type]
    await _deliver(job, send, Delta("a", ()))  # room: delivered at once
    assert receive.receive_nowait() == Delta("a", ())
    receive.close()  # the HTTP side is gone
    reached_after = False
    with job.cancel_scope:
        async with trio.open_nursery() as nursery:  # like the stream nurseries around a session
            nursery.start_soon(trio.sleep_forever)
            await _deliver(job, send, Delta("b", ()))
            reached_after = True
    assert job.cancel_scope.cancelled_caught and not reached_after
