"""The tracker over HTTPS in a real swarm on loopback: nodes and a gateway that pin its certificate.

Real processes: the tracker serves HTTPS with the self-signed certificate it
makes on first start (``--tls-self-signed``); two nodes and the gateway are
given its fingerprint (``--tracker-tls-fingerprint``), announce, heartbeat and
look up routes through it, and the text is the reference's. A gateway and a
node given another fingerprint are refused at every connection with a log line
naming the certificate shown and the one pinned: the node never appears in the
registry, the gateway serves nothing. ``swarm-node ledger`` and ``status`` reach the tracker
the same way (one-shot commands go through the same client).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.tls import generate_self_signed
from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import NO_SPOT_CHECKS, wait_until
from tests.e2e.swarm_helpers import Reference

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
N_NEW = 12


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("tracker-tls"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        tracker_tls=True,
        gateway_args=[*NO_SPOT_CHECKS],
        node_args=["--no-benchmark"],
    )
    yield s
    s.stop()


def chat(base_url: str, model: str, max_tokens: int = N_NEW) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="sk-tracker-tls", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return out.choices[0].message.content or ""


def registered(swarm: LocalSwarm) -> dict[str, str]:
    resp = httpx.get(f"{swarm.tracker_url}/v1/swarm", timeout=10, verify=swarm.tracker_verify)
    resp.raise_for_status()
    return {n["node_id"]: n["state"] for n in resp.json()["nodes"]}


def test_nodes_and_gateway_reach_the_https_tracker_pinned(swarm: LocalSwarm, reference: Reference) -> None:
    pin = swarm.tracker_tls_fingerprint
    assert swarm.tracker_url.startswith("https://") and len(pin) == 64
    # HTTPS only: plain HTTP to the tracker's port gets no answer.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{swarm.tracker.port}/healthz", timeout=10)
    nodes = registered(swarm)
    assert sorted(nodes.values()) == ["live", "live"]
    assert {str(n.extra["node_id"]) for n in swarm.nodes} == set(nodes)
    # The gateway's route look-ups went to the HTTPS tracker; the nodes announced there.
    assert chat(swarm.base_url, swarm.model_name) == reference.chat(QUESTION, N_NEW)
    for node in swarm.nodes:
        assert f'"tracker":"{swarm.tracker_url}"' in node.log_text().replace(" ", "")
        assert "tracker_tls_refused" not in node.log_text()
    assert "tracker_tls_refused" not in swarm.gateway.log_text()
    assert pin in swarm.tracker.log_text()  # tracker_tls: the fingerprint it serves with


def test_a_wrong_pin_is_refused_with_a_clear_error(
    swarm: LocalSwarm, model_path: Path, node_cache: Path
) -> None:
    pin, wrong = swarm.tracker_tls_fingerprint, generate_self_signed().fingerprint
    expected = f"shows TLS certificate sha256 {pin}, not the pinned {wrong}"
    sup = swarm.supervisor
    before = set(registered(swarm))
    node = sup.start_node(
        "wrong-pin-node",
        model=model_path,
        layers="0:15",
        tracker_url=swarm.tracker_url,
        cache_dir=node_cache,
        extra_args=["--no-benchmark", "--tracker-tls-fingerprint", wrong],
    )
    gateway = sup.start_gateway(
        tracker_url=swarm.tracker_url,
        name="wrong-pin-gateway",
        extra_args=["--tracker-tls-fingerprint", wrong, *NO_SPOT_CHECKS],
    ).ready(60)
    try:
        with pytest.raises(openai.APIStatusError) as refused:
            chat(f"http://127.0.0.1:{gateway.port}/v1", swarm.model_name, max_tokens=2)
        assert refused.value.status_code in (502, 503)
        wait_until(lambda: expected in gateway.log_text(), 30, "the gateway's tracker_tls_refused line")
        assert "tracker_tls_refused" in gateway.log_text()
        wait_until(lambda: expected in node.log_text(), 120, "the node's tracker_tls_refused line")
        assert node.alive()  # it keeps trying (the right tracker may come back), announcing nothing
        assert set(registered(swarm)) == before
    finally:
        node.stop()
        gateway.stop()


def test_swarm_node_status_reads_the_ledger_with_the_nodes_pin(swarm: LocalSwarm) -> None:
    node = swarm.nodes[0]
    done = subprocess.run(
        [sys.executable, "-m", "node.cli", "status", "--admin-url", f"http://127.0.0.1:{node.admin_port}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["tracker_tls_fingerprint"] == swarm.tracker_tls_fingerprint
    assert "all_time" in body["contribution"], body["contribution"]  # not an error: pinned, verified


def test_swarm_node_ledger_pins_the_tracker(swarm: LocalSwarm) -> None:
    data_dir = swarm.nodes[0].data_dir
    assert data_dir is not None

    def ledger(pin: str) -> subprocess.CompletedProcess[str]:
        argv = ["ledger", "--tracker", swarm.tracker_url, "--data-dir", str(data_dir)]
        return subprocess.run(
            [sys.executable, "-m", "node.cli", *argv, "--tracker-tls-fingerprint", pin],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = ledger(swarm.tracker_tls_fingerprint)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["node_id"] == swarm.nodes[0].extra["node_id"]
    wrong = generate_self_signed().fingerprint
    refused = ledger(wrong)
    assert refused.returncode == 1
    assert f"not the pinned {wrong}" in refused.stderr and refused.stderr.count("\n") == 1
