"""``--relay URL --relay-auto``: a node uses the relay only when the tracker cannot reach its gRPC port.

Tracker and gateway, then two nodes that both pass ``--relay-auto``:
node1 [0,15) listens on 127.0.0.1 (the tracker's probe of the caller's
address reaches it: direct gRPC); node2 [15,30) listens only on 127.0.0.2, so
the probe of 127.0.0.1:<port> is refused and it falls back to the relay. The
swarm serves a chat request through both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sim.procs import Service, Supervisor, wait_http

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def procs(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[tuple[Service, Service, list[Service]]]:
    sup = Supervisor(tmp_path_factory.mktemp("relay-auto"))
    try:
        tracker = sup.start_tracker()
        tracker.wait_port(60)
        tracker_url = f"http://127.0.0.1:{tracker.port}"
        wait_http(tracker, tracker_url + "/healthz", 60)
        gateway = sup.start_gateway(tracker_url=tracker_url, extra_args=["--route-ttl-s", "1"])
        gateway.wait_port(60)
        gw = f"http://127.0.0.1:{gateway.port}"
        wait_http(gateway, gw + "/healthz", 60)
        nodes = []
        for name, layers, host in (("node1", "0:15", "127.0.0.1"), ("node2", "15:30", "127.0.0.2")):
            node = sup.start_node(
                name,
                model=model_path,
                layers=layers,
                tracker_url=tracker_url,
                cache_dir=node_cache,
                extra_args=[
                    "--no-benchmark",
                    "--relay",
                    gw,
                    "--relay-auto",
                    "--host",
                    host,
                    "--advertise-host",
                    host,
                ],
            )
            node.wait_port(120)
            wait_http(node, f"http://127.0.0.1:{node.admin_port}/healthz", 120)
            nodes.append(node)
        yield tracker, gateway, nodes
    finally:
        sup.stop_all()


def test_only_the_unreachable_node_falls_back_to_the_relay(
    procs: tuple[Service, Service, list[Service]],
) -> None:
    tracker, gateway, nodes = procs
    tracker_url = f"http://127.0.0.1:{tracker.port}"

    def both_live(resp: httpx.Response) -> bool:
        return resp.status_code == 200 and sum(n["state"] == "live" for n in resp.json()["nodes"]) == 2

    entries = wait_http(tracker, tracker_url + "/v1/swarm", 120, ok=both_live).json()["nodes"]
    by_start = {n["shard"]["start"]: n for n in entries}
    assert by_start[0]["relay"] is False and by_start[0]["addresses"]
    assert by_start[15]["relay"] is True and by_start[15]["addresses"] == []
    statuses = [httpx.get(f"http://127.0.0.1:{n.admin_port}/status", timeout=5).json() for n in nodes]
    assert statuses[0]["relay"] is None and statuses[1]["relay"]["connected"] is True

    base = f"http://127.0.0.1:{gateway.port}/v1"

    def routable(resp: httpx.Response) -> bool:
        return resp.status_code == 200 and bool(resp.json().get("data"))

    model = wait_http(gateway, base + "/models", 60, ok=routable).json()["data"][0]["id"]
    client = openai.OpenAI(base_url=base, api_key="test", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content
