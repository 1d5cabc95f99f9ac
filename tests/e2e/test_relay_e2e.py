"""Nodes behind NAT: a node reached only through the gateway's WebSocket relay serves a stage.

One swarm for the module, started the way ``swarm-sim up --relay-nodes 1`` does
it: tracker, then the gateway, then node1 [0,15) on direct gRPC and node2
[15,30) with ``--relay`` over ``wss://`` (the gateway's certificate pinned; it
announces no address; the tracker lists it as ``relay:<gateway id>``). 1
llama.cpp thread per node.

1. The tracker records node2 as relayed through this gateway; the openai
   client's text (stream and not) equals the whole model's greedy output
   (``node.reference.ReferenceModel`` with the nodes' settings); frames really
   went over the socket (node2's relay counters).
2. The gateway restarts on the same port (same key): the node's socket drops,
   it dials again with backoff and serves again.
3. The relayed node is SIGKILLed mid-stream after a direct spare for [15,30)
   joined: the stream completes with the same text (span recovery over the
   relay's dropped socket).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import Service, wait_http
from tests.e2e.swarm_helpers import Reference

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
LONGER = "Write a short story about a lighthouse keeper."
N_NEW = 32


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("relay"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        relay_indices=[1],
        node_cache=node_cache,
        gateway_args=["--route-ttl-s", "1"],
        node_args=["--no-benchmark"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(swarm: LocalSwarm) -> openai.OpenAI:
    return openai.OpenAI(base_url=swarm.base_url, api_key="test", max_retries=0, timeout=120)


def status(node: Service) -> dict:
    return httpx.get(f"http://127.0.0.1:{node.admin_port}/status", timeout=5).json()


def chat(client: openai.OpenAI, model: str, question: str, stream: bool, on_chunk=None) -> str:  # type: ignore[no-untyped-def]
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=N_NEW, temperature=0
    )
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    parts: list[str] = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if on_chunk is not None:
                on_chunk(len(parts))
    return "".join(parts)


def test_relayed_node_serves_a_stage_and_output_equals_the_whole_model(
    swarm: LocalSwarm, client: openai.OpenAI, reference: Reference
) -> None:
    relayed = swarm.nodes[1]
    gateway_id = httpx.get(swarm.base_url.removesuffix("/v1") + "/healthz", timeout=5).json()["gateway_id"]
    entry = next(
        n
        for n in httpx.get(swarm.tracker_url + "/v1/swarm", timeout=5).json()["nodes"]
        if n["node_id"] == relayed.extra["node_id"]
    )
    assert entry["relay"] is True and entry["relay_via"] == gateway_id and entry["addresses"] == []
    before = status(relayed)["relay"]
    assert before["connected"] and before["gateway_id"] == gateway_id

    want = reference.chat(QUESTION, N_NEW)
    assert chat(client, swarm.model_name, QUESTION, stream=False) == want
    assert chat(client, swarm.model_name, QUESTION, stream=True) == want
    after = status(relayed)["relay"]
    assert after["frames_in"] > before["frames_in"] and after["frames_out"] > before["frames_out"]
    assert status(relayed)["sessions"] == 0


def test_relay_socket_reconnects_after_the_gateway_restarts(
    swarm: LocalSwarm, client: openai.OpenAI, reference: Reference
) -> None:
    relayed = swarm.nodes[1]
    connects = status(relayed)["relay"]["connects"]
    port = swarm.gateway.port
    swarm.gateway.stop()  # the socket drops; the node dials again with backoff
    gateway = swarm.supervisor.start_gateway(
        tracker_url=swarm.tracker_url, port=port, extra_args=["--route-ttl-s", "1", *swarm.gateway_tls_args]
    )
    gateway.wait_port(120)
    swarm.gateway = gateway
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        relay = status(relayed)["relay"]
        if relay["connected"] and relay["connects"] > connects:
            break
        time.sleep(0.1)
    assert status(relayed)["relay"]["connects"] == connects + 1
    assert chat(client, swarm.model_name, QUESTION, stream=True) == reference.chat(QUESTION, N_NEW)


def test_relayed_node_killed_mid_stream_direct_spare_takes_over(
    swarm: LocalSwarm, client: openai.OpenAI, reference: Reference, model_path: Path, node_cache: Path
) -> None:
    relayed = swarm.nodes[1]
    sup = swarm.supervisor
    killed: list[Service] = []

    def on_chunk(n: int) -> None:
        # The stream is running through the relayed node (the only [15,30) node so far). While the
        # client holds the stream here, a direct spare for the same span joins; then the relayed node dies.
        if n == 4 and not killed:
            assert status(relayed)["sessions"] == 1
            spare = sup.start_node(
                "spare",
                model=model_path,
                layers="15:30",
                tracker_url=swarm.tracker_url,
                cache_dir=node_cache,
                extra_args=["--no-benchmark"],
            )
            spare.wait_port(120)
            node_id = wait_http(spare, f"http://127.0.0.1:{spare.admin_port}/healthz", 120).json()["node_id"]
            wait_http(
                spare,
                swarm.tracker_url + "/v1/swarm",
                120,
                ok=lambda r: any(n["node_id"] == node_id and n["state"] == "live" for n in r.json()["nodes"]),
            )
            relayed.kill()
            killed.append(relayed)

    text = chat(client, swarm.model_name, LONGER, stream=True, on_chunk=on_chunk)
    assert killed
    assert text == reference.chat(LONGER, N_NEW)
    deadline = time.monotonic() + 10
    while status(swarm.nodes[0])["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status(swarm.nodes[0])["sessions"] == 0
