"""The WebSocket relay over ``wss://``: a gateway with a certificate, nodes behind NAT pinning it.

Real processes on loopback: a tracker, a gateway serving HTTPS with a
self-signed certificate (``--tls-cert-file``/``--tls-key-file``), a node
serving [0,15) over direct gRPC (TLS; it also serves the vocabulary, which is
not fetched over the relay) and a node serving [15,30) only through the relay
(``--relay https://...``) with the gateway's certificate pinned
(``--relay-tls-fingerprint``). The openai
client (over HTTPS, trusting that certificate) gets the whole model's greedy
text, and the frames went over the socket. A second node pinning another
certificate never connects: its relay refuses the gateway and says why.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.tls import generate_self_signed
from sim.procs import NO_SPOT_CHECKS, Service, Supervisor
from tests.e2e.swarm_helpers import Reference, wait_until

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
N_NEW = 16


def https_context(cert_file: Path) -> ssl.SSLContext:
    """Trust the test gateway's self-signed certificate (its name is not 127.0.0.1)."""
    context = ssl.create_default_context(cafile=str(cert_file))
    context.check_hostname = False
    return context


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("relay-tls")
    cert = generate_self_signed()
    cert_file, key_file = tmp / "gateway.crt", tmp / "gateway.key"
    cert_file.write_bytes(cert.cert_pem)
    key_file.write_bytes(cert.key_pem)
    os.chmod(key_file, 0o600)
    sup = Supervisor(tmp)
    try:
        tracker = sup.start_tracker(extra_args=["--probation-checks", "0"]).ready(60)
        tracker_url = f"http://127.0.0.1:{tracker.port}"
        gateway = sup.start_gateway(
            tracker_url=tracker_url,
            extra_args=[
                *("--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file)),
                *("--route-ttl-s", "1", *NO_SPOT_CHECKS),
            ],
        )
        gateway.wait_port(60)
        base = f"https://127.0.0.1:{gateway.port}"
        http = httpx.Client(verify=https_context(cert_file), timeout=5)
        wait_until(lambda: _ok(http, f"{base}/healthz"), 60, "the gateway answers over HTTPS")
        sup.start_node(
            "direct",
            model=model_path,
            layers="0:15",
            tracker_url=tracker_url,
            cache_dir=node_cache,
            extra_args=["--no-benchmark"],
        ).wait_port(120)
        node = sup.start_node(
            "relayed",
            model=model_path,
            layers="15:30",
            tracker_url=tracker_url,
            cache_dir=node_cache,
            extra_args=["--no-benchmark", "--relay", base, "--relay-tls-fingerprint", cert.fingerprint],
        )
        node.wait_port(120)
        # A relayed newcomer serves only once its gateway has carried the tracker's join challenge.
        relayed_id = httpx.get(f"http://127.0.0.1:{node.admin_port}/healthz", timeout=5).json()["node_id"]
        wait_until(
            lambda: _live(tracker_url, relayed_id),
            120,
            "the relayed node answered its join challenge and is live",
        )
        models = wait_until(
            lambda: _ok(http, f"{base}/v1/models") and http.get(f"{base}/v1/models").json()["data"],
            120,
            "the relayed node is routable",
        )
        yield {
            "supervisor": sup,
            "gateway": gateway,
            "node": node,
            "base": base,
            "cert": cert,
            "cert_file": cert_file,
            "http": http,
            "model": models[0]["id"],
            "tracker_url": tracker_url,
        }
    finally:
        sup.stop_all()


def _ok(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _live(tracker_url: str, node_id: str) -> bool:
    try:
        nodes = httpx.get(f"{tracker_url}/v1/swarm", timeout=5).json().get("nodes", [])
    except httpx.HTTPError:
        return False
    return any(n.get("node_id") == node_id and n.get("state") == "live" for n in nodes)


def status(node: Service) -> dict:
    return httpx.get(f"http://127.0.0.1:{node.admin_port}/status", timeout=5).json()


def test_a_node_behind_nat_serves_over_wss_with_the_gateway_pinned(swarm: dict, reference: Reference) -> None:
    node = swarm["node"]
    before = status(node)["relay"]
    assert before["connected"]
    client = openai.OpenAI(
        base_url=swarm["base"] + "/v1",
        api_key="sk-relay-tls",
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(verify=https_context(swarm["cert_file"]), timeout=120),
    )
    out = client.chat.completions.create(
        model=swarm["model"],
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    assert (out.choices[0].message.content or "") == reference.chat(QUESTION, N_NEW)
    after = status(node)["relay"]
    assert after["frames_in"] > before["frames_in"] and after["frames_out"] > before["frames_out"]
    assert "relay_plaintext" not in node.log_text()
    assert swarm["cert"].fingerprint in swarm["gateway"].log_text()  # gateway_tls names what to pin


def test_a_node_pinning_another_certificate_refuses_the_gateway(
    swarm: dict, model_path: Path, node_cache: Path
) -> None:
    wrong = generate_self_signed().fingerprint
    node = swarm["supervisor"].start_node(
        "mispinned",
        model=model_path,
        layers="15:30",
        tracker_url=swarm["tracker_url"],
        cache_dir=node_cache,
        extra_args=["--no-benchmark", "--relay", swarm["base"], "--relay-tls-fingerprint", wrong],
    )
    node.wait_port(120)
    wait_until(lambda: "not the pinned" in node.log_text(), 60, "the node refuses the gateway's certificate")
    relay = status(node)["relay"]
    assert not relay["connected"] and relay["connects"] == 0
    node.stop()
