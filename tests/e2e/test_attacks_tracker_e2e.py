"""Attacks on the tracker (issue 17), with real processes on loopback: a tracker, two real nodes on the
bundled model, a real gateway, and attackers with keys made on the spot, each on a loopback address of
its own (127.0.x.y: the tracker sees other hosts).

Shown here, while a client of the gateway keeps getting the whole model's greedy text:

- Sybil: signed announcements of fake whole-model shards at a dead address and at a tarpit (accepts
  TCP, never answers) end ``challenge_failed`` and are never routed;
- 1,000 junk announcements, then four concurrent ``GET /v1/models`` loops: ``/healthz`` and
  ``/v1/routes`` keep answering (the model list is computed off the event loop, once per snapshot,
  and paginated); the junk is pruned once it has been silent ``--prune-after-s``;
- one key flooding signed heartbeats is refused on its own (429): the nodes' heartbeats and those of
  honest fake nodes on the nodes' address are all accepted;
- a deeply nested body and a lone surrogate are 400 with a clear message, and the tracker logs no
  internal error.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import nacl.signing
import openai
import pytest

from proto.announce import ModelSpec
from proto.signing import make_payload, public_key_hex
from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import NO_SPOT_CHECKS
from tests.e2e.attackers import Tarpit
from tests.e2e.attackers import announce as _announce
from tests.e2e.attackers import client as _client
from tests.e2e.attackers import heartbeat as _heartbeat
from tests.e2e.swarm_helpers import Reference, wait_until

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
N_NEW = 16
PRUNE_AFTER_S = 5.0
# Junk never heartbeats: it stays live this long (through the read flood), expires, and is pruned
# PRUNE_AFTER_S later. The real nodes heartbeat every second.
HEARTBEAT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("attacks"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        gateway_args=["--route-ttl-s", "1", *NO_SPOT_CHECKS],
        node_args=["--no-benchmark"],
        tracker_args=[
            "--heartbeat-interval-s",
            "1",
            "--heartbeat-timeout-s",
            str(HEARTBEAT_TIMEOUT_S),
            "--prune-after-s",
            str(PRUNE_AFTER_S),
            "--challenge-timeout-s",
            "20",
            "--challenge-info-timeout-s",
            "2",
            "--challenge-attempts",
            "2",
            "--probation-checks",
            "0",
        ],
    )
    yield s
    s.stop()


def _model(swarm: LocalSwarm) -> ModelSpec:
    (m,) = [
        m for m in httpx.get(swarm.tracker_url + "/v1/models", timeout=10).json()["models"] if m["routable"]
    ]
    return ModelSpec(m["fingerprint"], m["name"], m["architecture"], m["n_layers"], m["n_embd"])


def _chat(swarm: LocalSwarm) -> str:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=swarm.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def _nodes(swarm: LocalSwarm) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    offset: int | None = 0
    while offset is not None:
        page = httpx.get(f"{swarm.tracker_url}/v1/swarm?offset={offset}", timeout=30).json()
        out.update({n["node_id"]: n for n in page["nodes"]})
        offset = page["next_offset"]
    return out


def _node_complaints(swarm: LocalSwarm) -> int:
    """Lines in which the real nodes say the tracker refused or did not answer them."""
    return sum(
        1
        for node in swarm.nodes
        for line in node.log_text().splitlines()
        if '"tracker_refused"' in line or '"tracker_unreachable"' in line
    )


def _dead_address() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def test_sybil_shards_at_dead_and_tarpit_addresses_are_never_routed(
    swarm: LocalSwarm, reference: Reference
) -> None:
    want = reference.chat(QUESTION, N_NEW)
    assert _chat(swarm) == want
    model = _model(swarm)
    tarpit = Tarpit()
    unpinned_tarpit = Tarpit()  # where a Sybil announcing no TLS certificate claims to be
    stop = threading.Event()
    beats: threading.Thread | None = None
    try:
        dead = _dead_address()
        sybils: dict[str, nacl.signing.SigningKey] = {}
        with _client("127.0.4.1") as attacker:
            for address in (dead, tarpit.address):
                for _ in range(3):
                    key = nacl.signing.SigningKey.generate()
                    # A real attacker announces a (made-up) certificate fingerprint: the challenger
                    # dials only nodes that announce one, so these are dialled and must fail there.
                    announce = _announce(key, model, address=address, tls_fingerprint=secrets.token_hex(32))
                    r = attacker.post(swarm.tracker_url + "/v1/announce", json=announce)
                    assert r.status_code == 200 and r.json()["state"] == "challenging", r.text
                    sybils[public_key_hex(key)] = key
            # One announcing no certificate: refused without a dial (no allow_plaintext_nodes).
            key = nacl.signing.SigningKey.generate()
            r = attacker.post(
                swarm.tracker_url + "/v1/announce",
                json=_announce(key, model, address=unpinned_tarpit.address),
            )
            assert r.status_code == 200 and r.json()["state"] == "challenging", r.text
            unpinned = public_key_hex(key)
            sybils[unpinned] = key

        def keep_alive() -> None:  # the attacker heartbeats its Sybils, as a real one would
            with _client("127.0.4.1") as attacker:
                while not stop.wait(1.0):
                    for key in sybils.values():
                        attacker.post(swarm.tracker_url + "/v1/heartbeat", json=_heartbeat(key))

        beats = threading.Thread(target=keep_alive)
        beats.start()
        honest = {n["node_id"] for n in _nodes(swarm).values() if n["state"] == "live"}
        assert len(honest) == 2
        replies = []
        deadline = time.monotonic() + 90
        while True:  # clients keep being served while the challenges run, and afterwards
            replies.append(_chat(swarm))
            routes = httpx.post(
                swarm.tracker_url + "/v1/routes", json={"model": model.fingerprint, "k": 8}, timeout=30
            ).json()["routes"]
            assert {h["node_id"] for r in routes for h in r["hops"]} <= honest
            nodes = _nodes(swarm)
            states = {nid: nodes[nid]["state"] for nid in sybils}
            if set(states.values()) == {"challenge_failed"} or time.monotonic() > deadline:
                break
        assert set(states.values()) == {"challenge_failed"}, states
        assert replies and all(r == want for r in replies), replies
        assert tarpit.held, "the challenger never dialled the tarpit"
        assert not unpinned_tarpit.held, "the challenger dialled a node that announced no certificate"
        failed = {
            e["node_id"]: e["detail"]
            for line in swarm.tracker.log_text().splitlines()
            if '"node_challenged"' in line and (e := json.loads(line))["outcome"] == "failed"
        }
        assert set(sybils) <= set(failed)
        assert "announced no TLS certificate" in failed[unpinned], failed[unpinned]
    finally:
        stop.set()
        if beats is not None:
            beats.join(10)
        tarpit.close()
        unpinned_tarpit.close()


def test_junk_flood_then_read_flood_leaves_health_routes_and_chats_served(
    swarm: LocalSwarm, reference: Reference
) -> None:
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)

    def junk(source: str, first: int, count: int) -> Counter[int]:
        got: Counter[int] = Counter()
        with _client(source) as c:
            for i in range(first, first + count):
                fake = ModelSpec(f"{i + 1:064x}", f"junk-{i}", "llama", 30, 576)
                r = c.post(
                    swarm.tracker_url + "/v1/announce",
                    json=_announce(nacl.signing.SigningKey.generate(), fake, address=None),
                )
                got[r.status_code] += 1
        return got

    with ThreadPoolExecutor(4) as pool:  # relayed junk: waits for a challenge no gateway carries
        counts = sum(
            (f.result() for f in [pool.submit(junk, f"127.0.1.{s + 1}", s * 250, 250) for s in range(4)]),
            Counter(),
        )
    assert counts == {200: 1000}
    listing = httpx.get(swarm.tracker_url + "/v1/models?limit=10", timeout=30).json()
    assert listing["total"] >= 1001 and len(listing["models"]) == 10 and listing["next_offset"] == 10

    stop = threading.Event()
    reads: Counter[int] = Counter()

    def reader() -> None:
        with _client("127.0.2.1", timeout_s=60) as c:
            while not stop.is_set():
                reads[c.get(swarm.tracker_url + "/v1/models").status_code] += 1

    health: list[float] = []
    route_times: list[float] = []
    with ThreadPoolExecutor(5) as pool:
        readers = [pool.submit(reader) for _ in range(4)]
        chat = pool.submit(_chat, swarm)
        try:
            with _client() as probe:
                end = time.monotonic() + 8
                while time.monotonic() < end:
                    t0 = time.monotonic()
                    assert probe.get(swarm.tracker_url + "/healthz").status_code == 200
                    health.append(time.monotonic() - t0)
                    t0 = time.monotonic()
                    r = probe.post(
                        swarm.tracker_url + "/v1/routes", json={"model": model.fingerprint, "k": 1}
                    )
                    route_times.append(time.monotonic() - t0)
                    assert r.status_code == 200 and r.json()["routes"], r.text
                    time.sleep(0.1)
            assert chat.result() == want
        finally:
            stop.set()
            for f in readers:
                f.result()
    assert reads[200] >= 4, reads  # the readers were served (and then limited: 429)
    # Before this was fixed, /healthz took 0.7 s (median) and routes 1.7 s under this flood on a 2-core
    # machine (docs/tracker.md); the bounds here are generous multiples of what is measured now.
    assert statistics.median(health) < 0.5 and max(health) < 5.0, health
    assert statistics.median(route_times) < 1.0 and max(route_times) < 10.0, route_times
    # The junk never heartbeats: it expires, and PRUNE_AFTER_S later it and its models are gone.
    wait_until(
        lambda: httpx.get(swarm.tracker_url + "/v1/models", timeout=30).json()["total"] == 1,
        HEARTBEAT_TIMEOUT_S + PRUNE_AFTER_S + 120,
        "the junk to be pruned",
    )
    assert {
        n["state"] for n in _nodes(swarm).values() if n["shard"]["model_fingerprint"] == model.fingerprint
    } >= {"live"}
    assert _chat(swarm) == want


def test_one_key_flooding_is_refused_alone_and_honest_heartbeats_all_pass(
    swarm: LocalSwarm, reference: Reference
) -> None:
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    complaints = _node_complaints(swarm)
    honest_keys = [nacl.signing.SigningKey.generate() for _ in range(5)]
    with _client() as c:  # fake nodes on the real nodes' address (relayed: accepted, then challenging)
        for i, k in enumerate(honest_keys):
            r = c.post(
                swarm.tracker_url + "/v1/announce", json=_announce(k, model, address=None, start=i, end=i + 1)
            )
            assert r.status_code == 200, r.text
    flood_key = nacl.signing.SigningKey.generate()
    with _client("127.0.3.1") as c:
        assert (
            c.post(
                swarm.tracker_url + "/v1/announce",
                json=_announce(flood_key, model, address=None, start=0, end=1),
            ).status_code
            == 200
        )

    stop = threading.Event()
    flood: Counter[int] = Counter()
    honest: Counter[int] = Counter()

    def flooder() -> None:
        with _client("127.0.3.1") as c:
            while not stop.is_set():
                flood[
                    c.post(swarm.tracker_url + "/v1/heartbeat", json=_heartbeat(flood_key)).status_code
                ] += 1

    def beating() -> None:
        with _client() as c:
            while not stop.is_set():
                for k in honest_keys:
                    honest[c.post(swarm.tracker_url + "/v1/heartbeat", json=_heartbeat(k)).status_code] += 1
                stop.wait(0.5)

    with ThreadPoolExecutor(6) as pool:
        started = time.monotonic()
        jobs = [pool.submit(flooder) for _ in range(4)] + [pool.submit(beating)]
        try:
            time.sleep(3)
            assert _chat(swarm) == want
            time.sleep(max(0.0, started + 12 - time.monotonic()))
        finally:
            stop.set()
            for j in jobs:
                j.result()
        elapsed = time.monotonic() - started
    # The flood key gets its burst (200) and 20 a second, then 429 for its own quota, never a 503
    # for a shared cache; the honest keys on the real nodes' address are all accepted.
    assert set(flood) <= {200, 429} and flood[429] > 0, flood
    assert flood[200] <= 200 + 20 * (elapsed + 2), (flood, elapsed)
    assert set(honest) == {200} and honest[200] >= 25, honest
    assert _node_complaints(swarm) == complaints  # the real nodes' heartbeats: all accepted
    # Accepted and kept: they wait for their join challenge (no gateway relays them to carry it).
    assert {_nodes(swarm)[public_key_hex(k)]["state"] for k in honest_keys} == {"challenging"}


def _signed_raw(key: nacl.signing.SigningKey, kind: str, body: dict[str, Any]) -> dict[str, str]:
    """An envelope whose payload JSON carries ``\\ud800`` escapes as written (canonical JSON cannot)."""
    payload = make_payload(kind, "node_id", key, time.time(), body)
    raw = json.dumps(payload, ensure_ascii=True, sort_keys=True, separators=(",", ":")).encode()
    return {
        "payload": base64.b64encode(raw).decode(),
        "signature": base64.b64encode(key.sign(raw).signature).decode(),
        "public_key": public_key_hex(key),
    }


def test_nested_json_and_lone_surrogates_are_400_with_a_clear_message(swarm: LocalSwarm) -> None:
    key = nacl.signing.SigningKey.generate()
    model = _model(swarm)
    a = json.loads(base64.b64decode(_announce(key, model, address=None)["payload"]))
    headers = {"content-type": "application/json"}
    cases = [
        ("/v1/announce", b"[" * 20_000 + b"]" * 20_000, "nested deeper than"),
        ("/v1/heartbeat", b'{"a":' * 100 + b"1" + b"}" * 100, "nested deeper than"),
        ("/v1/routes", b'{"model":"\\ud800"}', "lone UTF-16 surrogate"),
        (
            "/v1/announce",
            json.dumps(_signed_raw(key, "announce", {**a, "region": "\ud800"})).encode(),
            "region",
        ),
        (
            "/v1/announce",
            json.dumps(
                _signed_raw(key, "announce", {**a, "model": {**a["model"], "name": "x\udfffy"}})
            ).encode(),
            "model.name holds a lone UTF-16 surrogate",
        ),
    ]
    with _client("127.0.5.1") as c:
        for path, body, message in cases:
            r = c.post(swarm.tracker_url + path, content=body, headers=headers)
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert message in r.json()["error"]["message"] and "Traceback" not in r.text
    log = swarm.tracker.log_text()
    assert '"internal_error"' not in log and "Traceback" not in log
    assert public_key_hex(key) not in _nodes(swarm)
