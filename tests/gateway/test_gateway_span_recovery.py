"""Span recovery through the real gateway and tracker processes, with scripted nodes (no model loaded;
slow tier all the same: it starts processes).

Three ``FakeNode`` servers: [0,15), and [15,30) twice. A streaming request
runs; the [15,30) node that carries it is stopped (its gRPC server goes away
mid-stream). The gateway replaces just that stage: the [0,15) node is
re-attached at route epoch 2 with its KV kept (it never sees position 0
again), the spare is opened at epoch 2 and gets the span's history replayed
(its token ids, the penalty history, continue the script), and the client's
text is exactly the script.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fake_node import FakeNode
from swarm_fixtures import announce, metric_lines, scripted_nodes, url

from proto.announce import ModelSpec
from sim.procs import NO_SPOT_CHECKS, Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fb" * 32
MODEL = ModelSpec(fingerprint=FINGERPRINT, name="fake-span", architecture="llama", n_layers=30, n_embd=576)
SCRIPT_TEXT = "One stage dies, its spare takes over, and the text goes on without a seam."


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("fake-span")
    fake = scripted_nodes(
        model_path,
        tmp / "cache",
        SCRIPT_TEXT,
        FINGERPRINT,
        [(0, 15), (15, 30), (15, 30)],
        first_seed=40,
        step_delay_s=0.02,
    )
    nodes, expected = fake.nodes, fake.expected
    sup = Supervisor(tmp)
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges"]).ready(60)  # fake nodes: no engine
        for node in nodes:
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port)
        # Unchecked requests: a check's shadow (the first stage shared, the other [15, 30) node)
        # would open sessions of its own on the spare this test counts.
        gateway = sup.start_gateway(tracker_url=url(tracker), extra_args=NO_SPOT_CHECKS).ready(60)
        yield {"nodes": nodes, "tracker": tracker, "gateway": gateway, "expected": expected}
    finally:
        sup.stop_all()
        for node in nodes:
            node.stop()


def test_only_the_failed_stage_is_replaced_and_the_text_is_intact(swarm: dict) -> None:
    first, *lasts = swarm["nodes"]
    client = openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="t", max_retries=0, timeout=30)
    stopped: list[FakeNode] = []
    lock = threading.Lock()
    parts: list[str] = []
    stream = client.chat.completions.create(
        model="fake-span", stream=True, temperature=0, messages=[{"role": "user", "content": "go"}]
    )
    for chunk in stream:
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            parts.append(text)
        if len(parts) == 5 and not stopped:
            with lock:
                busy = next(n for n in lasts if n.state.sessions)
                busy.stop()
                stopped.append(busy)
    assert stopped
    assert "".join(parts) == swarm["expected"]
    spare = next(n for n in lasts if n is not stopped[0])
    assert (
        spare.state.opened == 1 and first.state.opened == 1
    )  # the first stage was re-attached, not re-opened
    replaced = [
        json.loads(line)
        for line in swarm["gateway"].log_path.read_text(errors="replace").splitlines()
        if '"stage_replaced"' in line
    ]
    assert [(e["failed_node"], e["replacement_node"], e["span"], e["route_epoch"]) for e in replaced] == [
        (stopped[0].node_id, spare.node_id, [15, 30], 2)
    ]
    assert replaced[0]["replayed_positions"] > 0
    lines = metric_lines(url(swarm["gateway"]), "swarm_gateway_recoveries_total")
    assert any(
        'kind="span"' in line and 'outcome="ok"' in line and float(line.split()[-1]) == 1 for line in lines
    ), lines
