"""activation_encoding = "auto" through real processes: a tracker, a gateway, and two scripted nodes
(``fake_node.py``: the node's own session machine, push path and gRPC service), the first of which
announced a slow uplink. The route answer carries that bandwidth for the hop into the second stage;
the gateway's OPEN tells the first stage to push f16, and the first stage's session really encodes
its pushes in f16 while the text stays right."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from swarm_fixtures import announce, scripted_nodes, url, wait_until

from proto.announce import ModelSpec
from proto.swarm.v1 import frame_pb2
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fb" * 32
MODEL = ModelSpec(fingerprint=FINGERPRINT, name="fake-model", architecture="llama", n_layers=30, n_embd=576)
TEXT = "One slow hop, half the bytes: the text is the same."


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("encodings-swarm")
    fake = scripted_nodes(
        model_path, tmp / "cache", TEXT, FINGERPRINT, [(0, 15), (15, 30)], first_seed=40, step_delay_s=0.02
    )
    sup = Supervisor(tmp)
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges", "--probation-checks", "0"]).ready(60)
        first, last = fake.nodes
        announce(url(tracker), first.key, MODEL, first.start, first.end, first.port, uplink_mbit_s=20.0)
        announce(url(tracker), last.key, MODEL, last.start, last.end, last.port)  # uplink unsaid
        gateway = sup.start_gateway(
            tracker_url=url(tracker),
            extra_args=[
                *("--activation-encoding", "auto", "--auto-f32-min-mbit-s", "100"),
                *("--check-fraction", "0", "--probation-checks", "0"),
            ],
        ).ready(60)
        yield {"tracker": tracker, "gateway": gateway, "nodes": fake.nodes, "expected": fake.expected}
    finally:
        sup.stop_all()
        for node in fake.nodes:
            node.stop()


def test_the_slow_senders_hop_carries_f16(swarm: dict) -> None:
    first, last = swarm["nodes"]
    routes = httpx.post(url(swarm["tracker"]) + "/v1/routes", json={"model": FINGERPRINT, "k": 1}, timeout=10)
    hops = routes.json()["routes"][0]["hops"]
    assert [h["bandwidth_mbit_s"] for h in hops] == [None, 20.0]  # the hop into stage 1: stage 0's uplink
    client = openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="sk-x", max_retries=0, timeout=30)
    stream = client.completions.create(
        model="fake-model", prompt="x", max_tokens=40, temperature=0, stream=True
    )
    seen: dict[str, int] = {}
    text = ""
    for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if not seen:  # mid-generation: what each node's session was told in its OPEN
            for node, name in ((first, "first"), (last, "last")):
                sessions = dict(node.machine._sessions)
                assert len(sessions) == 1, name
                seen[name] = next(iter(sessions.values())).out_encoding
    assert seen == {"first": frame_pb2.ENCODING_F16, "last": frame_pb2.ENCODING_F32}
    assert text == swarm["expected"]
    wait_until(lambda: not first.state.sessions and not last.state.sessions, 5, "sessions to end")


@pytest.fixture(scope="module")
def checked_swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    """Two node-disjoint routes with the same split, one with a slow first hop; every request checked."""
    tmp = tmp_path_factory.mktemp("encodings-checked")
    spans = [(0, 15), (15, 30), (0, 15), (15, 30)]
    fake = scripted_nodes(
        model_path, tmp / "cache", TEXT, FINGERPRINT, spans, first_seed=50, step_delay_s=0.02
    )
    sup = Supervisor(tmp)
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges", "--probation-checks", "0"]).ready(60)
        for node, uplink in zip(fake.nodes, (20.0, None, 1000.0, None), strict=True):
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port, uplink_mbit_s=uplink)
        gateway = sup.start_gateway(
            tracker_url=url(tracker),
            extra_args=[
                *("--activation-encoding", "auto", "--auto-f32-min-mbit-s", "100"),
                *("--check-fraction", "1", "--probation-checks", "0"),
            ],
        ).ready(60)
        yield {"gateway": gateway, "nodes": fake.nodes, "expected": fake.expected}
    finally:
        sup.stop_all()
        for node in fake.nodes:
            node.stop()


def test_a_checks_shadow_sends_in_the_primarys_encodings(checked_swarm: dict) -> None:
    """Spot checks compare digests bit for bit: the shadow route's first stage (whatever its own
    uplink) pushes in the encoding the primary's first stage was given."""
    firsts = [n for n in checked_swarm["nodes"] if n.start == 0]
    base = url(checked_swarm["gateway"])
    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-x", max_retries=0, timeout=30)
    for _ in range(2):  # whichever route is the primary
        stream = client.completions.create(
            model="fake-model", prompt="x", max_tokens=40, temperature=0, stream=True
        )
        seen: list[int] = []
        text = ""
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if not seen:
                for node in firsts:
                    sessions = dict(node.machine._sessions)
                    assert len(sessions) == 1  # primary and shadow: one session on each route
                    seen.append(next(iter(sessions.values())).out_encoding)
        assert len(set(seen)) == 1, seen
        assert text == checked_swarm["expected"]
        wait_until(lambda: not any(n.state.sessions for n in firsts), 5, "sessions to end")
    started = [
        line
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines()
        if line.startswith("swarm_gateway_checks_total") and 'outcome="started"' in line
    ]
    assert started and float(started[0].split()[-1]) == 2
