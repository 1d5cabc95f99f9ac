"""Direct push across the emulated WAN (needs root): three stages 10 ms apart, a spare, a node killed.

Tracker, gateway and four nodes ([0,10), [10,20), [20,30), and a spare [10,20))
each run in their own network namespace of the ``link-10ms`` profile. The
official ``openai`` client reaches the gateway through the forwarder. The
gateway runs the default data plane, direct push: the text must be the whole
model's greedy text, and the gateway's metrics must show no hidden state
passed through it. Then the middle stage is SIGKILLed mid-stream: it is
replaced by the spare (the first stage replays its kept outputs into it) and
the client's text is unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import Service
from sim.wan import netns
from sim.wan.profile import load_profile
from sim.wan.support import unavailable_reason
from tests.e2e.swarm_helpers import Reference

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"emulated WAN unavailable: {REASON}"),
]

QUESTION = "Name three rivers of Europe and say where each one flows."
N_NEW = 24


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("wan-push"),
        model=model_path,
        n_nodes=3,
        spare=1,
        layers=["0:10", "10:20", "20:30", "10:20"],
        node_cache=node_cache,
        node_args=["--no-benchmark"],
        gateway_args=[
            "--routes-k",
            "1",
            "--route-ttl-s",
            "1",
            "--check-fraction",
            "0",
            "--probation-checks",
            "0",
        ],
        wan_profile=load_profile("link-10ms"),
    )
    yield s
    names = s.wan.namespaces() if s.wan else []
    s.stop()
    assert not set(names) & set(netns.list_namespaces())


@pytest.fixture(scope="module")
def want(model_path: Path) -> str:
    reference = Reference(model_path)
    try:
        return reference.chat(QUESTION, N_NEW)
    finally:
        reference.close()


def _gateway_metric(swarm: LocalSwarm, name: str, **labels: str) -> float:
    import httpx

    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    text = httpx.get(swarm.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key + " "))


def _sessions(swarm: LocalSwarm, node: Service) -> int:
    import httpx

    assert swarm.wan is not None
    url = f"http://127.0.0.1:{node.admin_port}/status"
    status = swarm.wan.call(node.name, lambda: httpx.get(url, timeout=5).json())
    return int(status["sessions"])


def _chat(client: openai.OpenAI, model: str, on_chunk=None) -> str:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
        stream=True,
    )
    parts: list[str] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if on_chunk is not None:
                on_chunk(len(parts))
    return "".join(parts)


def test_direct_push_across_the_wan_gives_the_whole_models_text_and_nothing_passes_the_gateway(
    swarm: LocalSwarm, want: str
) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-wan", max_retries=0, timeout=120)
    before = _gateway_metric(swarm, "swarm_gateway_hidden_relays_total")
    full = client.chat.completions.create(
        model=swarm.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    assert full.choices[0].message.content == want
    assert _chat(client, swarm.model_name) == want
    # Hidden states went node to node, and each next decode step from the last stage to the first.
    assert _gateway_metric(swarm, "swarm_gateway_hidden_relays_total") == before


def test_a_stage_killed_mid_stream_is_replaced_and_the_text_is_unchanged(
    swarm: LocalSwarm, want: str
) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-wan", max_retries=0, timeout=120)
    before = _gateway_metric(swarm, "swarm_gateway_recoveries_total", kind="span", outcome="ok")
    killed: list[Service] = []

    def on_chunk(n: int) -> None:
        if n == 6 and not killed:
            middle = [node for node in swarm.nodes if node.alive() and node.extra["span"] == (10, 20)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                busy = [node for node in middle if _sessions(swarm, node) > 0]
                if busy:
                    busy[0].kill()
                    killed.append(busy[0])
                    return
                time.sleep(0.02)

    text = _chat(client, swarm.model_name, on_chunk)
    assert killed, "no middle stage held the session"
    assert text == want
    assert _gateway_metric(swarm, "swarm_gateway_recoveries_total", kind="span", outcome="ok") == before + 1
    events = [
        json.loads(line)
        for line in swarm.gateway.log_path.read_text(errors="replace").splitlines()
        if '"stage_replaced"' in line
    ]
    assert events and events[-1]["span"] == [10, 20] and events[-1]["replayed_positions"] > 0
