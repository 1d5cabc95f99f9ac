"""Attacks on trust where volunteers really are (issue 27), with real processes on loopback: a tracker,
real nodes on the bundled model, a real gateway driven by the official ``openai`` client, and attackers
with keys made on the spot (tests/e2e/attackers.py).

- Tarpits: three fresh keys announce the whole model at an address that accepts TCP and never
  answers, and a real node of the swarm stops (SIGSTOP: its port still accepts connections). Every
  legitimate request gets the whole model's greedy text; the gateway gives up on the silent node
  after its dial or OPEN deadline, routes around it and names it to the tracker, which sends it back
  to its challenge (out of routing); the fresh keys never leave theirs.
- A name taken by fresh keys: with no model registered, four fresh keys announce another
  fingerprint under the real model's name and go live on probation (the tracker challenges
  nobody here, so nothing keeps them out before they count). The name keeps resolving to the model
  trusted nodes serve; every request by name is served by the real model; the tracker's model list
  and dashboard say which fingerprint the name resolves to and why.
- A liar on a span nobody else holds: a relayed fresh key computing nothing and claiming the whole
  model ``[0, 30)``, announcing the fastest decode there is. Its join challenge, carried by the
  gateway relaying it, has no trusted answer to compare with: it goes live on probation. Its
  requests are checked against nodes that together cover the span (compared at the sampled token),
  judged by a third route, and it is named on its first request: no client sees its output.
- Relayed newcomers are challenged: the gateway relaying a node carries the tracker's challenge
  frames and brings the answers back for the tracker to judge. An honest relayed node passes and
  serves; a relayed liar on a span trusted nodes hold fails its challenge and is never routed.
- A liar without a disjoint twin: one node on ``[0, 15)``, two on ``[15, 30)``, one of those a
  newcomer that replaces every token after answering its challenge honestly. Its runs are checked
  against the other ``[15, 30)`` node with the first stage shared; with no third node to judge, the
  trusted node's word decides: named on its first request, no wrong token delivered.
- The README's swarm as ``swarm-sim up`` starts it: the operator's two nodes (one per half) in the
  tracker's ``trusted_nodes``, a gateway with ``unconfirmed_routes = refuse``. The operator's nodes
  serve at once; a fresh liar on ``[15, 30)`` is checked against the operator's ``[15, 30)`` node and
  banned, and a fresh key on a span nobody else holds ``[0, 30)`` has its output confirmed by the
  operator's nodes covering it: every answer the whole model's text, no wrong token delivered. When
  the operator's ``[0, 15)`` node leaves and a fresh volunteer takes its span, nobody can check the
  volunteer: every request gets 503 ``unconfirmable``, never its unchecked text.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nacl.signing
import openai
import pytest

from node.failpoints import CONSENT, CONSENT_ENV, ENV
from proto.announce import ModelSpec
from proto.signing import public_key_hex
from sim.launcher import LocalSwarm, _wait_announced, start_local_swarm
from sim.procs import NO_SPOT_CHECKS
from tests.e2e.attackers import KeepAlive, Tarpit, announce, client
from tests.e2e.swarm_helpers import Reference, wait_until

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
N_NEW = 12
LEGIT_REQUESTS = 12


def _chat(swarm: LocalSwarm) -> tuple[str, float]:
    c = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    t0 = time.monotonic()
    reply = c.chat.completions.create(
        model=swarm.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    return reply.choices[0].message.content or "", time.monotonic() - t0


def _model(swarm: LocalSwarm) -> ModelSpec:
    (m,) = [
        m for m in httpx.get(swarm.tracker_url + "/v1/models", timeout=10).json()["models"] if m["routable"]
    ]
    return ModelSpec(m["fingerprint"], m["name"], m["architecture"], m["n_layers"], m["n_embd"])


def _states(swarm: LocalSwarm) -> dict[str, str]:
    nodes = httpx.get(f"{swarm.tracker_url}/v1/swarm", timeout=30).json()["nodes"]
    return {n["node_id"]: n["state"] for n in nodes}


def _events(text: str, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if f'"{name}"' in line]


@pytest.fixture(scope="module")
def tarpit_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("tarpit"),
        model=model_path,
        n_nodes=3,
        layers=["0:15", "15:30", "15:30"],
        node_cache=node_cache,
        gateway_args=["--route-ttl-s", "1", "--stats-interval-s", "1", *NO_SPOT_CHECKS],
        node_args=["--no-benchmark"],
        tracker_args=[
            "--heartbeat-interval-s",
            "1",
            "--heartbeat-timeout-s",
            "120",  # the stopped node must leave routing on the gateway's word, not by expiring
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


def test_tarpits_cost_a_legit_request_seconds_and_leave_routing(
    tarpit_swarm: LocalSwarm, reference: Reference
) -> None:
    swarm = tarpit_swarm
    want = reference.chat(QUESTION, N_NEW)
    assert _chat(swarm)[0] == want
    model = _model(swarm)
    tarpit = Tarpit()
    keys = [nacl.signing.SigningKey.generate() for _ in range(3)]
    sybils = {public_key_hex(k) for k in keys}
    # The second [15, 30) node goes silent: it stays live at the tracker (its heartbeats stop, but
    # the timeout is long) and its port accepts connections that nothing answers.
    silent = swarm.nodes[2]
    silent_id = str(httpx.get(f"http://127.0.0.1:{silent.admin_port}/healthz", timeout=10).json()["node_id"])
    beats: KeepAlive | None = None
    stopped = False
    try:
        with client("127.0.5.1") as attacker:
            for key in keys:
                r = attacker.post(
                    swarm.tracker_url + "/v1/announce",
                    json=announce(key, model, address=tarpit.address, tls_fingerprint=secrets.token_hex(32)),
                )
                assert r.status_code == 200, r.text
        beats = KeepAlive(swarm.tracker_url, keys, "127.0.5.1")
        os.kill(silent.pid, signal.SIGSTOP)
        stopped = True
        latencies: list[float] = []
        for _ in range(LEGIT_REQUESTS):
            text, took = _chat(swarm)
            assert text == want
            latencies.append(took)

        def settled() -> dict[str, str] | None:
            st = _states(swarm)
            out = all(st.get(n) == "challenge_failed" for n in sybils) and st.get(silent_id) != "live"
            return st if out else None

        states = wait_until(
            settled, 60, "the Sybils to fail their challenge and the silent node to leave routing"
        )
        print(
            f"\ntarpit attack: {LEGIT_REQUESTS} legit requests, longest {max(latencies):.2f} s, "
            f"median {statistics.median(latencies):.2f} s; silent node now {states[silent_id]}; "
            f"all: {', '.join(f'{t:.2f}' for t in latencies)}"
        )
        gw = swarm.gateway.log_text()
        assert silent_id in {e["node_id"] for e in _events(gw, "node_unreachable")}
        assert sybils.isdisjoint(e.get("node_id") for e in _events(gw, "node_unreachable"))  # never routed
        assert silent_id in {e["node_id"] for e in _events(swarm.tracker.log_text(), "node_rechallenged")}
        # A silent node costs a request one deadline (Info 1.5 s or OPEN 2 s) on top of its work on
        # another route (measured: longest 1.7-3.3 s on a loaded 2-core machine, the retry landing on
        # a node that had not served yet). The goal, kept as the bound.
        assert max(latencies) < 5.0, latencies
    finally:
        if stopped:
            os.kill(silent.pid, signal.SIGCONT)
        if beats is not None:
            beats.close()
        tarpit.close()


HIJACK = "f" * 64  # the largest fingerprint: the old rule (most live shards, ties to the larger) picks it


@pytest.fixture(scope="module")
def name_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("names"),
        model=model_path,
        n_nodes=4,
        layers=["0:15", "0:15", "15:30", "15:30"],
        node_cache=node_cache,
        # Every request checked, so the honest nodes earn trust (one passed check) by serving.
        gateway_args=["--route-ttl-s", "1", "--check-fraction", "1", "--probation-checks", "1"],
        node_args=["--no-benchmark"],
        tracker_args=[
            "--heartbeat-interval-s",
            "1",
            "--probation-checks",
            "1",
            "--unregistered-names",
            "trusted",  # the tracker's default (the harness's is any)
            # Fresh keys live on probation at once, the strongest form of the attack: a relayed key
            # no gateway carries a challenge to waits in `challenging` on a tracker that challenges.
            "--no-challenges",
        ],
    )
    yield s
    s.stop()


def _tracker_models(swarm: LocalSwarm) -> dict[str, dict[str, Any]]:
    rows = httpx.get(swarm.tracker_url + "/v1/models", timeout=10).json()["models"]
    return {m["fingerprint"]: m for m in rows}


def test_fresh_keys_announcing_another_model_under_its_name_move_nothing(
    name_swarm: LocalSwarm, reference: Reference
) -> None:
    swarm = name_swarm
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    by_fingerprint = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)

    def earned() -> bool:
        reply = by_fingerprint.chat.completions.create(
            model=model.fingerprint,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=N_NEW,
            temperature=0,
        )
        assert reply.choices[0].message.content == want
        return bool(_tracker_models(swarm)[model.fingerprint]["name_resolves"])

    wait_until(earned, 90, "the honest nodes to earn trust (passed checks) and the name to resolve", 1.0)
    hijack = ModelSpec(HIJACK, model.name, model.architecture, model.n_layers, model.n_embd)
    keys = [nacl.signing.SigningKey.generate() for _ in range(4)]
    beats: KeepAlive | None = None
    try:
        with client("127.0.6.1") as attacker:
            for key in keys:
                r = attacker.post(
                    swarm.tracker_url + "/v1/announce", json=announce(key, hijack, address=None)
                )
                assert r.status_code == 200, r.text
        beats = KeepAlive(swarm.tracker_url, keys, "127.0.6.1")
        wait_until(
            lambda: all(_states(swarm).get(public_key_hex(k)) == "live" for k in keys),
            30,
            "the hijackers live",
        )
        rows = wait_until(
            lambda: r if HIJACK in (r := _tracker_models(swarm)) else None, 30, "the hijack in the list"
        )
        assert rows[HIJACK]["live_nodes"] == 4 and rows[HIJACK]["trusted_nodes"] == 0
        assert not rows[HIJACK]["name_resolves"] and rows[model.fingerprint]["name_resolves"]
        assert "trusted" in rows[model.fingerprint]["name_reason"]
        by_name = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
        served = []
        for _ in range(6):
            reply = by_name.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=N_NEW,
                temperature=0,
            )
            served.append((reply.choices[0].message.content, reply.system_fingerprint))
        assert all(text == want for text, _ in served), served
        # The gateway lists the hijack by its fingerprint only; the name means the real model.
        listed = httpx.get(swarm.base_url + "/models", timeout=10).json()["data"]
        ids = {m["fingerprint"]: m["id"] for m in listed}
        assert ids[HIJACK] == HIJACK and ids[model.fingerprint] != model.fingerprint
        names = httpx.get(swarm.tracker_url + "/v1/dashboard/state", timeout=10).json()["names"]
        (entry,) = [n for n in names if n["name"] == model.name]
        assert entry["fingerprint"] == model.fingerprint and entry["candidates"] == 2, entry
        print(
            f"\nname attack: 4 fresh keys under {model.name!r}: {len(served)} of {len(served)} by name exact"
        )
    finally:
        if beats is not None:
            beats.close()


# Every request checked, and cold (no kept prefixes): a client's first turns, which a newcomer is
# routed; warm turns go back to the route holding their prefix (docs/security.md, Limits).
CHECKED_GATEWAY = [
    "--route-ttl-s",
    "1",
    "--check-fraction",
    "1",
    "--probation-checks",
    "1",
    "--kv-keep-s",
    "0",
]
# Probation costs nothing in routing here: a liar announcing the fastest decode is routed first, as
# it would be wherever honest nodes are slower than its claim.
LIAR_TRACKER = ["--heartbeat-interval-s", "1", "--probation-checks", "1", "--probation-penalty-ms", "0"]


def _node_id(node: Any) -> str:
    return str(httpx.get(f"http://127.0.0.1:{node.admin_port}/healthz", timeout=10).json()["node_id"])


def _checks_passed(swarm: LocalSwarm) -> dict[str, int]:
    nodes = httpx.get(f"{swarm.tracker_url}/v1/swarm", timeout=30).json()["nodes"]
    return {n["node_id"]: int(n.get("checks_passed") or 0) for n in nodes}


def _earn_trust(swarm: LocalSwarm, want: str, fingerprint: str, nodes: set[str]) -> int:
    """Checked requests until every node of ``nodes`` passed a check at the tracker; the requests sent."""
    c = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    sent = 0

    def trusted() -> bool:
        nonlocal sent
        passed = _checks_passed(swarm)
        if all(passed.get(n, 0) >= 1 for n in nodes):
            return True
        reply = c.chat.completions.create(
            model=fingerprint,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=N_NEW,
            temperature=0,
        )
        assert reply.choices[0].message.content == want
        sent += 1
        return False

    wait_until(trusted, 120, f"{len(nodes)} honest nodes to pass a check", 1.0)
    return sent


def _start_liar(
    swarm: LocalSwarm, model_path: Path, node_cache: Path, layers: str, lies: str, extra: list[str]
) -> Any:
    node = swarm.supervisor.start_node(
        f"liar-{lies.split(',')[0]}",
        model=model_path,
        layers=layers,
        tracker_url=swarm.tracker_url,
        cache_dir=node_cache,
        extra_args=["--no-benchmark", *extra],
        env={ENV: f"{lies},fake_speed", CONSENT_ENV: CONSENT},
    )
    node.wait_port(120)
    _wait_announced(swarm.tracker_url, node, 120)
    return node


def _attack(
    swarm: LocalSwarm, want: str, fingerprint: str, liar_id: str, requests: int
) -> tuple[int, list[str]]:
    """``requests`` chats; (the request after which the gateway had named the liar, the answers)."""
    c = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    named_after = 0
    answers = []
    for i in range(requests):
        reply = c.chat.completions.create(
            model=fingerprint,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=N_NEW,
            temperature=0,
        )
        answers.append(reply.choices[0].message.content or "")
        verdicts = _events(swarm.gateway.log_text(), "spot_check_verdict")
        if not named_after and any(v.get("liar") == liar_id for v in verdicts):
            named_after = i + 1
    return named_after, answers


@pytest.fixture(scope="module")
def covering_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("covering"),
        model=model_path,
        n_nodes=4,
        layers=["0:15", "0:15", "15:30", "15:30"],
        relay_indices=[3],  # the gateway serves a relay (the liar uses it); one honest node is relayed too
        node_cache=node_cache,
        gateway_args=CHECKED_GATEWAY,
        node_args=["--no-benchmark"],
        tracker_args=LIAR_TRACKER,
    )
    yield s
    s.stop()


def _challenges(swarm: LocalSwarm, node_id: str) -> list[dict[str, Any]]:
    trust = httpx.get(f"{swarm.tracker_url}/v1/trust/nodes/{node_id}", timeout=30).json()
    return list(trust["challenges"])


# Runs before the covering test below: the liar banned there bans new keys from its host (loopback).
def test_relayed_newcomers_are_challenged_through_their_gateway(
    covering_swarm: LocalSwarm, reference: Reference, model_path: Path, node_cache: Path
) -> None:
    swarm = covering_swarm
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    honest = {_node_id(n) for n in swarm.nodes}
    relayed_id = _node_id(swarm.nodes[3])
    # The honest relayed node answered its challenge through the gateway (no trusted node of its
    # span had answered yet: on probation), then served and earned trust like the others.
    (mine,) = _challenges(swarm, relayed_id)
    assert mine["outcome"] in {"no_reference", "passed"}, mine
    carried = _events(swarm.gateway.log_text(), "relay_challenge_carried")
    assert any(e["node_id"] == relayed_id and e["routable"] for e in carried), carried
    _earn_trust(swarm, want, model.fingerprint, honest)
    # A relayed liar on [15, 30), a span trusted nodes hold: its challenge answer is compared with
    # theirs, it fails and is never routed.
    liar = swarm.supervisor.start_node(
        "liar-relayed-15",
        model=model_path,
        layers="15:30",
        tracker_url=swarm.tracker_url,
        cache_dir=node_cache,
        extra_args=["--no-benchmark", *swarm.relay_args],
        env={ENV: "no_model,fake_speed", CONSENT_ENV: CONSENT},
    )
    liar.wait_port(120)
    liar_id = _node_id(liar)
    wait_until(
        lambda: _states(swarm).get(liar_id) == "challenge_failed",
        90,
        "the relayed liar to fail its challenge",
    )
    (theirs,) = _challenges(swarm, liar_id)
    assert theirs["outcome"] == "mismatch", theirs
    c = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    for _ in range(4):
        reply = c.chat.completions.create(
            model=model.fingerprint,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=N_NEW,
            temperature=0,
        )
        assert reply.choices[0].message.content == want
    assert _states(swarm).get(liar_id) == "challenge_failed"
    gw = swarm.gateway.log_text()
    assert liar_id not in {e.get("liar") for e in _events(gw, "spot_check_verdict")}  # never in a run
    print(f"\nrelayed newcomers: honest one {mine['outcome']}, liar {theirs['outcome']} ({theirs['detail']})")


def test_a_relayed_liar_on_a_span_nobody_holds_is_checked_by_covering_nodes(
    covering_swarm: LocalSwarm, reference: Reference, model_path: Path, node_cache: Path
) -> None:
    swarm = covering_swarm
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    honest = {_node_id(n) for n in swarm.nodes}
    _earn_trust(swarm, want, model.fingerprint, honest)
    liar = _start_liar(swarm, model_path, node_cache, "0:30", "no_model", list(swarm.relay_args))
    liar_id = _node_id(liar)
    assert wait_until(
        lambda: _states(swarm).get(liar_id) == "live", 60, "the relayed liar live (no reference to compare)"
    )
    named_after, answers = _attack(swarm, want, model.fingerprint, liar_id, 8)
    print(f"\nrelayed liar on [0, 30): named after {named_after} request(s); {len(answers)} answers exact")
    assert all(a == want for a in answers), answers
    assert 1 <= named_after <= 2, named_after
    wait_until(lambda: _states(swarm).get(liar_id) == "banned", 30, "the tracker to ban the liar")


@pytest.fixture(scope="module")
def twin_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("twin"),
        model=model_path,
        n_nodes=3,
        layers=["0:15", "15:30", "15:30"],
        node_cache=node_cache,
        gateway_args=CHECKED_GATEWAY,
        node_args=["--no-benchmark"],
        tracker_args=LIAR_TRACKER,
    )
    yield s
    s.stop()


def test_a_liar_without_a_disjoint_twin_is_checked_with_the_rest_of_the_route_shared(
    twin_swarm: LocalSwarm, reference: Reference, model_path: Path, node_cache: Path
) -> None:
    swarm = twin_swarm
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    first, second, third = swarm.nodes
    # The [15, 30) nodes check each other (the first stage shared); [0, 15) has no twin.
    _earn_trust(swarm, want, model.fingerprint, {_node_id(second), _node_id(third)})
    third.stop()  # now one node on [0, 15) and one on [15, 30) ...
    liar = _start_liar(swarm, model_path, node_cache, "15:30", "swap_sampler,honest_steps=1", [])
    liar_id = _node_id(liar)  # ... and the newcomer beside it, which passed its challenge honestly
    assert wait_until(lambda: _states(swarm).get(liar_id) == "live", 90, "the liar past its challenge")
    named_after, answers = _attack(swarm, want, model.fingerprint, liar_id, 8)
    print(f"\nliar with a shared first stage: named after {named_after} request(s); {len(answers)} exact")
    assert all(a == want for a in answers), answers
    assert 1 <= named_after <= 2, named_after
    (verdict,) = [
        v for v in _events(swarm.gateway.log_text(), "spot_check_verdict") if v.get("liar") == liar_id
    ]
    assert "trusted" in verdict["detail"], verdict
    wait_until(lambda: _states(swarm).get(liar_id) == "banned", 30, "the tracker to ban the liar")


@pytest.fixture(scope="module")
def unconfirmable_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    # Two fresh nodes, one per half: on probation, and nobody can check anybody.
    s = start_local_swarm(
        tmp_path_factory.mktemp("unconfirmable"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        gateway_args=["--route-ttl-s", "1", "--unconfirmed-routes", "refuse", "--kv-keep-s", "0"],
        node_args=["--no-benchmark"],
        tracker_args=["--heartbeat-interval-s", "1"],
    )
    yield s
    s.stop()


def test_a_gateway_refusing_unconfirmed_routes_answers_unconfirmable_never_unchecked_text(
    unconfirmable_swarm: LocalSwarm, reference: Reference
) -> None:
    swarm = unconfirmable_swarm
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    body = {
        "model": model.fingerprint,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": N_NEW,
        "temperature": 0,
    }
    r = httpx.post(swarm.base_url + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unconfirmable", r.text
    assert int(r.headers["retry-after"]) >= 1
    # Requests no shadow could check even with a second route (n > 1) are refused alike.
    several = httpx.post(swarm.base_url + "/chat/completions", json={**body, "n": 2}, timeout=120)
    assert several.status_code == 503 and several.json()["error"]["code"] == "unconfirmable", several.text
    gw = swarm.gateway.log_text()
    assert _events(gw, "route_unconfirmable")  # the routes were left out because nobody could check them
    # The same swarm through a gateway that serves unconfirmed routes (the default): the text, unchecked.
    other = swarm.supervisor.start_gateway(
        name="gateway-serving",
        tracker_url=swarm.tracker_url,
        tracker_id=str(swarm.tracker.extra["tracker_id"]),
        extra_args=["--route-ttl-s", "1", "--kv-keep-s", "0"],
    )
    other.wait_port(120)
    served = httpx.post(f"http://127.0.0.1:{other.port}/v1/chat/completions", json=body, timeout=120)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"] == want
    print(f"\nunconfirmable: refused with {r.status_code} {r.json()['error']['code']}; the other served")


@pytest.fixture(scope="module")
def operator_swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    # The README's swarm as `swarm-sim up` starts it: one node per half, both the operator's
    # (--trusted-nodes), the model registered, a gateway serving no unconfirmed output. The test's
    # own settings: probation costs nothing in routing (a liar claiming the fastest decode is routed
    # first) and no host bans (every key here announces from loopback).
    s = start_local_swarm(
        tmp_path_factory.mktemp("operator"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        trust_nodes=True,
        register_model=True,
        gateway_args=["--route-ttl-s", "1", "--unconfirmed-routes", "refuse", "--kv-keep-s", "0"],
        node_args=["--no-benchmark"],
        tracker_args=[
            "--heartbeat-interval-s",
            "1",
            "--probation-penalty-ms",
            "0",
            "--ban-host-s",
            "0",
            "--unregistered-names",
            "trusted",
        ],
    )
    yield s
    s.stop()


def _attack_clean(
    swarm: LocalSwarm, want: str, fingerprint: str, liar_id: str, requests: int
) -> tuple[int, int, int, list[str]]:
    """``requests`` chats that may each be the whole model's text or a clean 503:
    (the request after which the gateway had named the liar, exact answers, wrong answers, errors)."""
    body = {
        "model": fingerprint,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": N_NEW,
        "temperature": 0,
    }
    named_after, exact, wrong, errors = 0, 0, 0, []
    for i in range(requests):
        r = httpx.post(swarm.base_url + "/chat/completions", json=body, timeout=120)
        if r.status_code == 200:
            text = r.json()["choices"][0]["message"]["content"]
            exact, wrong = exact + (text == want), wrong + (text != want)
        else:
            assert r.status_code == 503, r.text  # a clean error, never a wrong answer
            errors.append(r.json()["error"]["code"])
        verdicts = _events(swarm.gateway.log_text(), "spot_check_verdict")
        if not named_after and any(v.get("liar") == liar_id for v in verdicts):
            named_after = i + 1
    return named_after, exact, wrong, errors


def test_the_readme_swarm_trusts_the_operators_nodes_and_delivers_no_unconfirmed_output(
    operator_swarm: LocalSwarm, reference: Reference, model_path: Path, node_cache: Path
) -> None:
    swarm = operator_swarm
    want = reference.chat(QUESTION, N_NEW)
    model = _model(swarm)
    ours = [_node_id(n) for n in swarm.nodes]
    for node_id in ours:  # trusted from the first announce: no probation, no checks needed
        trust = httpx.get(f"{swarm.tracker_url}/v1/trust/nodes/{node_id}", timeout=30).json()
        assert (trust["probation"], trust["operator_trusted"], trust["checks_passed"]) == (False, True, 0)
    # The refusing gateway serves the operator's nodes at once, by name and by fingerprint.
    for name in (swarm.model_name, model.fingerprint):
        reply = httpx.post(
            swarm.base_url + "/chat/completions",
            json={
                "model": name,
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": N_NEW,
                "temperature": 0,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == want
    # (a) A fresh liar on [15, 30) that answers its challenge honestly (compared with the operator's
    # [15, 30) node's answer) and then replaces every token: checked against the operator's node
    # with the first stage shared, named on the trusted node's word, banned.
    liar = _start_liar(swarm, model_path, node_cache, "15:30", "swap_sampler,honest_steps=1", [])
    liar_id = _node_id(liar)
    assert wait_until(lambda: _states(swarm).get(liar_id) == "live", 90, "the liar past its challenge")
    (challenge,) = _challenges(swarm, liar_id)
    assert challenge["outcome"] == "passed", challenge  # the operator's node was its reference
    named_a, exact_a, wrong_a, errors_a = _attack_clean(swarm, want, model.fingerprint, liar_id, 8)
    print(
        f"\n(a) liar on [15, 30): named after {named_a}; {exact_a} exact, {wrong_a} wrong, errors {errors_a}"
    )
    assert wrong_a == 0 and exact_a >= 1
    assert 1 <= named_a <= 2, named_a
    wait_until(lambda: _states(swarm).get(liar_id) == "banned", 30, "the tracker to ban the liar")
    # (b) A fresh key on a span nobody else holds ([0, 30)), computing nothing: no trusted answer to
    # compare its challenge with, so it is live on probation; its output is confirmed by the
    # operator's nodes covering the span before any of it is delivered, and it is named.
    whole = _start_liar(swarm, model_path, node_cache, "0:30", "no_model", [])
    whole_id = _node_id(whole)
    assert wait_until(lambda: _states(swarm).get(whole_id) == "live", 90, "the unique span live on probation")
    named_b, exact_b, wrong_b, errors_b = _attack_clean(swarm, want, model.fingerprint, whole_id, 8)
    print(f"(b) fresh key on [0, 30): named after {named_b}; {exact_b} exact, {wrong_b} wrong, {errors_b}")
    assert wrong_b == 0 and exact_b >= 1
    assert 1 <= named_b <= 2, named_b
    wait_until(lambda: _states(swarm).get(whole_id) == "banned", 30, "the tracker to ban the fresh key")
    for node_id in ours:  # the operator's nodes kept their standing
        assert _states(swarm).get(node_id) == "live"
    # (c) The operator's [0, 15) node leaves and a fresh volunteer takes its span: nobody can check
    # it (nobody else holds or covers [0, 15)), so it gets no client traffic: 503 unconfirmable.
    swarm.nodes[0].stop()
    wait_until(lambda: _states(swarm).get(ours[0]) != "live", 60, "the operator's [0, 15) node gone")
    fresh = swarm.supervisor.start_node(
        "fresh-0-15",
        model=model_path,
        layers="0:15",
        tracker_url=swarm.tracker_url,
        cache_dir=node_cache,
        extra_args=["--no-benchmark"],
    )
    fresh.wait_port(120)
    fresh_id = _node_id(fresh)
    assert wait_until(lambda: _states(swarm).get(fresh_id) == "live", 90, "the volunteer live on probation")
    body = {
        "model": model.fingerprint,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": N_NEW,
        "temperature": 0,
    }
    refused = []
    for _ in range(4):
        r = httpx.post(swarm.base_url + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 503, r.text  # never its unchecked text
        refused.append(r.json()["error"]["code"])
    print(f"(c) a fresh volunteer nobody can check: {refused}")
    assert set(refused) == {"unconfirmable"}, refused
    gw = swarm.gateway.log_text()
    assert any(fresh_id in json.dumps(e) for e in _events(gw, "route_unconfirmable"))
