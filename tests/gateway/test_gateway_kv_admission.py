"""The gateway's KV admission order, through real gateway and tracker processes (scripted nodes).

The nodes announce 300 free KV positions. A long request (a ~500-token prompt) cannot fit and waits;
under ``--kv-admission shortest`` a short request that fits is answered while the long one waits
(under ``fifo`` it would wait behind it until ``kv_wait_s`` and get 503), and so is a second; the
long one has then been bypassed ``--kv-admission-max-bypass`` (2) times, so a third short request
waits behind it although it fits. Room comes (a heartbeat of 4,096 free): the long one is answered,
then the third.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nacl.signing
import pytest
import trio
from swarm_fixtures import announce, metric_lines, scripted_nodes, url, wait_until

from common.tracker_client import TrackerClient
from proto.announce import Heartbeat, ModelSpec
from proto.signing import public_key_hex
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fd" * 32
MODEL = ModelSpec(
    fingerprint=FINGERPRINT, name="fake-admission-model", architecture="llama", n_layers=30, n_embd=576
)
SCRIPT_TEXT = "Short ones first, but never for ever."
ROUTE_TTL_S = 1.0
KV_WAIT_S = 60.0


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
    tmp = tmp_path_factory.mktemp("fake-admission-swarm")
    nodes = scripted_nodes(
        model_path,
        tmp / "cache",
        SCRIPT_TEXT,
        FINGERPRINT,
        [(0, 15), (15, 30)],
        first_seed=70,
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
                "--kv-keep-s",
                "0",
                "--kv-wait-s",
                str(KV_WAIT_S),
                "--kv-retry-s",
                "0.5",
                "--route-ttl-s",
                str(ROUTE_TTL_S),
                "--kv-admission",
                "shortest",
                "--kv-admission-max-bypass",
                "2",
                "--kv-admission-max-wait-s",
                "0",
            ],
        ).ready(60)
        yield {"nodes": nodes, "gateway": gateway, "tracker": tracker}
    finally:
        sup.stop_all()
        for node in nodes.nodes:
            node.stop()


def _gauge(base: str, name: str) -> float:
    lines = metric_lines(base, name)
    return sum(float(line.split()[-1]) for line in lines)


def test_a_short_request_passes_a_long_waiter_at_most_n_times(swarm: dict) -> None:
    tracker, base = url(swarm["tracker"]), url(swarm["gateway"])
    for node in swarm["nodes"].nodes:
        heartbeat(tracker, node.key, kv_free_tokens=300)
    time.sleep(ROUTE_TTL_S + 0.2)  # the gateway's cached routes (and their free KV) have expired
    long_body = {"model": "fake-admission-model", "prompt": "word " * 500, "max_tokens": 4, "temperature": 0}
    short_body = {"model": "fake-admission-model", "prompt": "Hi", "max_tokens": 4, "temperature": 0}
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(base + "/v1/completions", json=body, timeout=KV_WAIT_S + 30)

    long = threading.Thread(target=post, args=("long", long_body))
    long.start()
    wait_until(lambda: _gauge(base, "swarm_gateway_kv_waiting") == 1, 30, "the long request waits for KV")
    for name in ("short1", "short2"):
        post(name, short_body)  # answered while the long one waits (under fifo: 503 after kv_wait_s)
        assert results[name].status_code == 200, results[name].text
        assert long.is_alive() and "long" not in results
    third = threading.Thread(target=post, args=("short3", short_body))
    third.start()
    wait_until(lambda: _gauge(base, "swarm_gateway_kv_waiting") == 2, 30, "the third waits behind the long")
    assert _gauge(base, "swarm_gateway_kv_overdue_total") == 1
    for node in swarm["nodes"].nodes:
        heartbeat(tracker, node.key, kv_free_tokens=4096)
    long.join(60)
    third.join(60)
    assert results["long"].status_code == 200 and results["short3"].status_code == 200, results
    assert results["long"].json()["choices"][0]["text"]
    assert _gauge(base, "swarm_gateway_kv_waiting") == 0
