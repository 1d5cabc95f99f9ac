"""Preemption and waiting for KV, through a real gateway and tracker, with scripted nodes.

Real gateway and tracker processes and the official ``openai`` client; the
nodes are the node's own protocol stack on real gRPC with a scripted engine
(tests/gateway/fake_node.py), whose last stage can be told to preempt a
session: free its KV and answer STATUS_PREEMPTED / RETRY_RESUME, as a node
whose KV pool ran out does for its youngest session (the node side of that
decision is node/preemption.py; these tests are about the gateway's answer).

- A stream preempted twice pauses and goes on: the client's text is exactly
  the text of the same request undisturbed; the gateway counts the resumes;
  both nodes hold no session afterwards.
- Preempted more than ``max_preemptions`` times, the request fails with 503
  ``preempted`` (nothing leaks).
- A request that fits the swarm's context but not the free KV the nodes
  announced waits (it is answered once a heartbeat announces room); with no
  room coming it gets 503 ``kv_exhausted`` with Retry-After after
  ``kv_wait_s``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nacl.signing
import openai
import pytest
import trio
from fake_node import PREEMPTIONS
from swarm_fixtures import announce, metric_lines, scripted_nodes, url, wait_until

from common.tracker_client import TrackerClient
from proto.announce import Heartbeat, ModelSpec
from proto.signing import public_key_hex
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fc" * 32
MODEL = ModelSpec(
    fingerprint=FINGERPRINT, name="fake-preempt-model", architecture="llama", n_layers=30, n_embd=576
)
SCRIPT_TEXT = "Once upon a time a small model learned to wait for its turn, and every word came out the same."
KV_WAIT_S = 3.0
ROUTE_TTL_S = 1.0


def heartbeat(tracker_url: str, key: nacl.signing.SigningKey, kv_free_tokens: int) -> None:
    async def run() -> None:
        async with TrackerClient(tracker_url, key) as client:
            with trio.fail_after(10):
                await client.heartbeat(
                    Heartbeat(
                        node_id=public_key_hex(key),
                        active_sessions=0,
                        queue_depth=0,
                        kv_free_tokens=kv_free_tokens,
                        tokens_served=0,
                        kv_pool_tokens=4096,
                        kv_session_max_tokens=4096,
                    )
                )

    trio.run(run)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("fake-preempt-swarm")
    nodes = scripted_nodes(
        model_path,
        tmp / "cache",
        SCRIPT_TEXT,
        FINGERPRINT,
        [(0, 15), (15, 30)],
        first_seed=60,
        kv_per_session=4096,
    )
    sup = Supervisor(tmp)
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges", "--probation-checks", "0"]).ready(60)
        for node in nodes.nodes:
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port)
        gateway = sup.start_gateway(
            tracker_url=url(tracker),
            extra_args=[
                "--check-fraction",
                "0",
                "--probation-checks",
                "0",
                "--max-preemptions",
                "2",
                "--kv-wait-s",
                str(KV_WAIT_S),
                "--kv-keep-s",
                "0",  # no warm KV kept after a request: a node holding a session afterwards leaked it
                "--route-ttl-s",
                str(ROUTE_TTL_S),  # a heartbeat's free KV reaches the gateway's cached routes this soon
            ],
        ).ready(60)
        yield {"nodes": nodes, "gateway": gateway, "tracker": tracker}
    finally:
        PREEMPTIONS.update(left=0, after=0, done=0)
        sup.stop_all()
        for node in nodes.nodes:
            node.stop()


def _client(swarm: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="sk-test", max_retries=0, timeout=60)


def _counter(swarm: dict, name: str, outcome: str) -> float:
    lines = [line for line in metric_lines(url(swarm["gateway"]), name) if f'outcome="{outcome}"' in line]
    return float(lines[0].split()[-1]) if lines else 0.0


def _stream(client: openai.OpenAI, max_tokens: int) -> str:
    chunks = client.completions.create(
        model="fake-preempt-model",
        prompt="Tell me a story.",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _all_free(swarm: dict) -> bool:
    return all(not n.state.sessions and not n.backend.kv for n in swarm["nodes"].nodes)


@pytest.mark.parametrize("refuse", [0, 1], ids=["preempted", "refused_mid_generation"])
def test_a_preempted_stream_resumes_with_exactly_the_undisturbed_text(swarm: dict, refuse: int) -> None:
    """Preempted (STATUS_PREEMPTED), or refused a step mid-generation (RESOURCE_EXHAUSTED: no room and
    nobody to preempt): released everywhere, resumed by re-prefill, the same text."""
    client = _client(swarm)
    PREEMPTIONS.update(left=0, after=0, done=0, refuse=0)
    reference = _stream(client, 16)
    assert reference and swarm["nodes"].expected.startswith(reference)
    resumed_before = _counter(swarm, "swarm_gateway_preemptions_total", "resumed")
    PREEMPTIONS.update(left=2, after=4, done=0, refuse=refuse)  # at the 5th generated token, twice
    got = _stream(client, 16)
    assert PREEMPTIONS["done"] == 2 and PREEMPTIONS["left"] == 0
    assert got == reference
    assert _counter(swarm, "swarm_gateway_preemptions_total", "resumed") == resumed_before + 2
    wait_until(lambda: _all_free(swarm), 30, "both nodes freed every session")
    PREEMPTIONS.update(refuse=0)


def test_preempted_more_often_than_allowed_fails_with_503_preempted(swarm: dict) -> None:
    client = _client(swarm)
    failed_before = _counter(swarm, "swarm_gateway_preemptions_total", "failed")
    PREEMPTIONS.update(left=3, after=2, done=0)  # max_preemptions is 2: the third one ends it
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(
            model="fake-preempt-model", prompt="Tell me a story.", max_tokens=16, temperature=0
        )
    assert PREEMPTIONS["done"] == 3
    assert refused.value.status_code == 503
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "preempted" and "request id" in body["message"]
    assert _counter(swarm, "swarm_gateway_preemptions_total", "failed") == failed_before + 1
    wait_until(lambda: _all_free(swarm), 30, "both nodes freed every session")
    PREEMPTIONS.update(left=0, after=0, done=0)


def test_a_request_waits_for_kv_room_then_runs_and_without_room_gets_503_kv_exhausted(swarm: dict) -> None:
    tracker = url(swarm["tracker"])
    nodes = swarm["nodes"].nodes
    for node in nodes:
        heartbeat(tracker, node.key, kv_free_tokens=8)  # fewer than the prompt plus max_tokens
    time.sleep(ROUTE_TTL_S + 0.2)  # the gateway's cached routes (and their free KV) have expired
    base = url(swarm["gateway"])
    body = {"model": "fake-preempt-model", "prompt": "Tell me a story.", "max_tokens": 12, "temperature": 0}
    # No room comes: after kv_wait_s, 503 kv_exhausted with Retry-After.
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    waited = time.monotonic() - t0
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["code"] == "kv_exhausted"
    assert waited >= KV_WAIT_S - 0.5
    assert _counter(swarm, "swarm_gateway_kv_waits_total", "timed_out") >= 1
    # Room comes while it waits: it runs.
    served_before = _counter(swarm, "swarm_gateway_kv_waits_total", "served")
    with httpx.Client(timeout=60) as http:
        import threading

        result: dict[str, httpx.Response] = {}
        waiter = threading.Thread(
            target=lambda: result.update(r=http.post(base + "/v1/completions", json=body))
        )
        waiter.start()
        wait_until(
            lambda: any(
                line.split()[-1] != "0.0" and line.split()[-1] != "0"
                for line in metric_lines(base, "swarm_gateway_kv_waiting")
            ),
            30,
            "the request waits for KV",
        )
        for node in nodes:
            heartbeat(tracker, node.key, kv_free_tokens=4096)
        waiter.join(60)
    assert "r" in result and result["r"].status_code == 200, result
    assert result["r"].json()["choices"][0]["text"]
    assert _counter(swarm, "swarm_gateway_kv_waits_total", "served") == served_before + 1
