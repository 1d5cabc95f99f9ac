"""A man in the middle between gateway and tracker cannot hand the gateway his certificate pin.

Real processes: ``swarm-tracker serve`` and ``swarm-gateway serve``; two scripted
nodes (``FakeNode``, real gRPC over TLS, [0,30) each: two one-hop routes); and,
in front of the tracker, an HTTP proxy that forwards everything and rewrites the
``/v1/routes`` answers it carries, as an attacker on that path could. The
attacker's "node" is a TCP listener that counts the connections it receives.

The gateway pins the tracker's key (``--tracker-id``), checks every route
ticket against the hops of its route and drops a route whose answer says
anything the signed ticket does not: the client is served by the other route,
or gets a clear 503 when every route was rewritten.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from swarm_fixtures import announce, metric_lines, scripted_nodes, url

from proto.announce import ModelSpec
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fb" * 32
MODEL = ModelSpec(fingerprint=FINGERPRINT, name="fake-model", architecture="llama", n_layers=30, n_embd=576)
SCRIPT_TEXT = "Served only where the tracker's signature says."
ATTACKER_PIN = "ee" * 32


class Attacker:
    """Where the rewritten hop points: counts every TCP connection anyone makes to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


class TamperingProxy:
    """Forwards every request to the tracker; rewrites the ``/v1/routes`` answers as ``mode`` says:
    ``none``, ``pin`` (the first route's hop gets the attacker's pin), ``address`` (and his address),
    ``all`` (every route's hop gets both)."""

    def __init__(self, tracker_url: str, attacker: Attacker) -> None:
        self.mode = "none"
        self.rewritten = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")
                }
                upstream = httpx.request(
                    self.command, tracker_url + self.path, content=body, headers=headers, timeout=30
                )
                out = upstream.content
                if self.path.startswith("/v1/routes") and proxy.mode != "none":
                    out = proxy.rewrite(upstream.json())
                self.send_response(upstream.status_code)
                self.send_header("Content-Type", upstream.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = _forward  # noqa: N815 (http.server's names)

        self.attacker = attacker
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def rewrite(self, answer: dict) -> bytes:
        routes = answer.get("routes") or []
        for route in routes if self.mode == "all" else routes[:1]:
            hop = route["hops"][0]
            hop["tls_fingerprint"] = ATTACKER_PIN
            if self.mode in ("address", "all"):
                hop["address"] = self.attacker.address
            self.rewritten += 1
        return json.dumps(answer).encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("route-pins")
    fake = scripted_nodes(
        model_path, tmp / "cache", SCRIPT_TEXT, FINGERPRINT, [(0, 30), (0, 30)], first_seed=40
    )
    attacker = Attacker()
    sup = Supervisor(tmp)
    proxy: TamperingProxy | None = None
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges", "--probation-checks", "0"]).ready(60)
        for node in fake.nodes:
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port)
        proxy = TamperingProxy(url(tracker), attacker)
        gateway = sup.start_gateway(
            tracker_url=proxy.url,  # every look-up goes through the man in the middle
            tracker_id=str(tracker.extra["tracker_id"]),
            extra_args=[
                *("--route-ttl-s", "0.5", "--routes-k", "2", "--kv-keep-s", "0"),
                *("--check-fraction", "0", "--probation-checks", "0", "--rtt-probe-interval-s", "0.5"),
            ],
        ).ready(60)
        yield {
            "nodes": fake.nodes,
            "expected": fake.expected,
            "tracker": tracker,
            "gateway": gateway,
            "proxy": proxy,
            "attacker": attacker,
        }
    finally:
        sup.stop_all()
        if proxy is not None:
            proxy.close()
        attacker.close()
        for node in fake.nodes:
            node.stop()


def _client(swarm: dict) -> openai.OpenAI:
    for node in swarm["nodes"]:  # nodes expire without heartbeats: announce again
        announce(url(swarm["tracker"]), node.key, MODEL, node.start, node.end, node.port)
    return openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="sk-test", max_retries=0, timeout=30)


def _ask(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], temperature=0
    )
    return str(r.choices[0].message.content)


def _refused(swarm: dict) -> float:
    lines = metric_lines(url(swarm["gateway"]), "swarm_gateway_route_tickets_refused_total")
    return sum(float(line.split()[-1]) for line in lines if 'reason="hops_mismatch"' in line)


def _set_mode(swarm: dict, mode: str) -> None:
    swarm["proxy"].mode = mode
    time.sleep(0.7)  # past route_ttl_s: the next request asks the tracker (through the proxy) again


def test_untampered_answers_serve_through_both_routes(swarm: dict) -> None:
    client = _client(swarm)
    _set_mode(swarm, "none")
    for _ in range(3):
        assert _ask(client) == swarm["expected"]
    assert _refused(swarm) == 0
    assert "route_ticket_refused" not in swarm["gateway"].log_text()


@pytest.mark.parametrize("mode", ["pin", "address"])
def test_a_rewritten_hop_is_refused_and_the_other_route_serves(swarm: dict, mode: str) -> None:
    client = _client(swarm)
    before, rewritten = _refused(swarm), swarm["proxy"].rewritten
    _set_mode(swarm, mode)
    for _ in range(3):
        assert _ask(client) == swarm["expected"]
        time.sleep(0.6)  # a fresh look-up (and a fresh rewrite) for the next request
    assert swarm["proxy"].rewritten > rewritten
    assert _refused(swarm) > before
    assert swarm["attacker"].accepted == 0  # neither a session nor a ping ever went to his address
    log = swarm["gateway"].log_text()
    assert "route_ticket_refused" in log and "node_tls_refused" not in log  # refused before any dial
    _set_mode(swarm, "none")


def test_every_route_rewritten_is_a_clear_503_and_untampered_answers_serve_again(swarm: dict) -> None:
    client = _client(swarm)
    _set_mode(swarm, "all")
    with pytest.raises(openai.APIStatusError) as err:
        _ask(client)
    assert err.value.status_code == 503
    assert "valid ticket" in str(err.value)
    assert swarm["attacker"].accepted == 0
    _set_mode(swarm, "none")
    assert _ask(client) == swarm["expected"]
