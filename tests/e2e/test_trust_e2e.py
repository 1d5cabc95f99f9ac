"""Trust between strangers, with real processes on loopback: a tracker that accepts reports only from
the gateway its operator registered, real nodes, that gateway, and a model whose chat template attacks.

Shown here: probation flags in routes until a registered gateway reports passed checks; spot-check
results, evidence and usage reports from an unregistered key refused (a forged usage report credits
nothing, the ledger's rows check out signature by signature); a node convicted by evidence is out of
routing at once and its announce is refused when it comes back; a chat template that loops, allocates
too much or writes too much is refused within its limits while the gateway keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nacl.signing
import openai
import pytest
import trio

from common.keyfile import load_or_create_key_file
from common.tracker_client import TrackerClient, TrackerClientError
from proto.announce import CheckPass, CheckResults, Evidence, UsageEntry, UsageReport
from proto.ledger import verify_ledger_entry
from proto.signing import make_payload, public_key_hex, sign_envelope
from sim.procs import Service, Supervisor
from tests.e2e.swarm_helpers import wait_until

pytestmark = pytest.mark.slow

# A chat template that attacks the gateway on demand: the first message's content picks the attack.
HOSTILE_TEMPLATE = (
    "{% set what = messages[0]['content'] %}"
    "{% if what == 'loop' %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{% elif what == 'allocate' %}{{ 'x' | center(messages | length * 4294967296) }}"
    "{% elif what == 'write' %}{% for i in range(99999) %}{{ what * 100 }}{% endfor %}"
    "{% else %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% endif %}"
)
HOSTILE_NAME = "hostile-template"


@dataclass
class Swarm:
    sup: Supervisor
    tracker: Service
    gateway: Service
    nodes: dict[str, Service]
    gateway_key: nacl.signing.SigningKey
    model_path: Path
    node_cache: Path

    @property
    def tracker_url(self) -> str:
        return self.tracker.url

    def node_id(self, name: str) -> str:
        for line in (self.sup.workdir / "logs" / f"{name}.log").read_text(errors="replace").splitlines():
            if '"node_identity"' in line:
                return str(json.loads(line)["node_id"])
        raise AssertionError(f"node {name} logged no identity")

    def swarm_nodes(self) -> dict[str, dict[str, Any]]:
        return {
            n["node_id"]: n for n in httpx.get(self.tracker_url + "/v1/swarm", timeout=10).json()["nodes"]
        }

    def state(self, name: str) -> str | None:
        node = self.swarm_nodes().get(self.node_id(name))
        return None if node is None else str(node["state"])

    def routes(self, model: str, k: int = 3) -> list[list[dict[str, Any]]]:
        # As the registered gateway: the tracker answers only signed route requests here.
        body = self.call(self.gateway_key, "routes", model, k, frozenset(), None, sign=True)
        return [r["hops"] for r in body["routes"]]

    def call(self, key: nacl.signing.SigningKey, fn: str, *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            async with TrackerClient(self.tracker_url, key) as client:
                with trio.fail_after(30):
                    return await getattr(client, fn)(*args, **kwargs)

        return trio.run(run)

    def openai(self, timeout_s: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key="t", max_retries=0, timeout=timeout_s)


def _hostile_model(model_path: Path, out: Path) -> Path:
    """A copy of the test model with the hostile chat template and its own name (another fingerprint)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            "--chat-template",
            HOSTILE_TEMPLATE,
            "--general-name",
            HOSTILE_NAME,
            "--force",
            str(model_path),
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path) -> Iterator[Swarm]:
    work = tmp_path_factory.mktemp("trust")
    gateway_key, _ = load_or_create_key_file(work / "gateway" / "gateway.key")
    hostile = _hostile_model(model_path, work / "hostile.gguf")
    with Supervisor(work) as sup:
        tracker = sup.start_tracker(
            extra_args=[
                "--registered-gateways",
                public_key_hex(gateway_key),
                "--probation-checks",
                "2",
                "--ban-host-s",
                "0",  # every node here is on 127.0.0.1: ban keys only
                "--heartbeat-interval-s",
                "1",
            ]
        ).ready(60)
        nodes: dict[str, Service] = {}
        for name, path in (("a", model_path), ("b", model_path), ("h", hostile)):
            # One at a time: nodes sharing a cache must not write the same shard file at once.
            nodes[name] = sup.start_node(
                name, model=path, layers="0:30", tracker_url=tracker.url, cache_dir=node_cache
            ).ready(120)
        gateway = sup.start_gateway(
            tracker_url=tracker.url, extra_args=["--route-ttl-s", "1", "--stats-interval-s", "1"]
        ).ready(60)
        s = Swarm(sup, tracker, gateway, nodes, gateway_key, model_path, node_cache)
        wait_until(lambda: all(s.state(n) == "live" for n in nodes), 120, "three live nodes")
        yield s


def _model(swarm: Swarm, name: str) -> str:
    """The fingerprint the tracker knows node ``name``'s model by."""
    return str(swarm.swarm_nodes()[swarm.node_id(name)]["shard"]["model_fingerprint"])


def test_probation_flags_in_routes_until_a_registered_gateway_reports_passed_checks(swarm: Swarm) -> None:
    model = _model(swarm, "a")
    a, b = swarm.node_id("a"), swarm.node_id("b")
    assert {h["node_id"]: h["probation"] for r in swarm.routes(model) for h in r} == {a: True, b: True}
    result = swarm.call(
        swarm.gateway_key,
        "report_checks",
        CheckResults(public_key_hex(swarm.gateway_key), (CheckPass(a, 2),)),
    )
    assert result == {"credited": 1, "unknown": 0, "graduated": [a]}
    routes = wait_until(
        lambda: (r := swarm.routes(model)) and r[0][0]["node_id"] == a and r, 10, "the trusted node first"
    )
    assert {h["node_id"]: h["probation"] for r in routes for h in r} == {a: False, b: True}


def test_reports_from_an_unregistered_gateway_are_refused(swarm: Swarm) -> None:
    rogue = nacl.signing.SigningKey.generate()
    a, b, h = (swarm.node_id(n) for n in "abh")
    before = swarm.call(rogue, "node_trust", b)
    for fn, payload in (
        ("report_checks", CheckResults(public_key_hex(rogue), (CheckPass(b, 100),))),
        ("report_evidence", _evidence(public_key_hex(rogue), liar=a, honest=b, judge=h)),
    ):
        with pytest.raises(TrackerClientError) as err:
            swarm.call(rogue, fn, payload)
        assert (err.value.status, err.value.code) == (403, "unregistered_gateway")
    assert swarm.call(rogue, "node_trust", b)["checks_passed"] == before["checks_passed"]
    assert swarm.state("a") == "live"


def test_a_forged_usage_report_credits_nothing_and_the_ledger_checks_out(swarm: Swarm) -> None:
    model = _model(swarm, "a")
    reply = swarm.openai().completions.create(model=model, prompt="The sea is", max_tokens=8, temperature=0)
    assert reply.choices[0].text
    tracker_id = httpx.get(swarm.tracker_url + "/healthz", timeout=10).json()["tracker_id"]

    def ledger_rows(node: str) -> list[dict[str, Any]]:
        return list(swarm.call(swarm.gateway_key, "node_ledger", node)["entries"])

    served = wait_until(
        lambda: [(n, rows) for n in (swarm.node_id("a"), swarm.node_id("b")) if (rows := ledger_rows(n))],
        20,
        "the gateway's usage report",
    )
    node, rows = served[0]
    for row in rows:  # every row: the registered gateway's signed report and the tracker's receipt
        report = verify_ledger_entry(row, node_id=node, tracker_public_key=tracker_id)
        assert report.gateway_id == public_key_hex(swarm.gateway_key)
    total = swarm.call(swarm.gateway_key, "node_usage", node)["all_time"]["tokens"]
    rogue = nacl.signing.SigningKey.generate()
    forged = UsageReport(public_key_hex(rogue), "forged-1", model, (UsageEntry(node, 1 << 40, 1),))
    with pytest.raises(TrackerClientError) as err:
        swarm.call(rogue, "report_usage", forged)
    assert (err.value.status, err.value.code) == (403, "unregistered_gateway")
    # the registered gateway's id with another key's signature: refused before anything else
    envelope = sign_envelope(
        rogue,
        {
            **make_payload("usage", "gateway_id", rogue, time.time(), forged.to_json()),
            "gateway_id": public_key_hex(swarm.gateway_key),
        },
    )
    envelope["public_key"] = public_key_hex(swarm.gateway_key)
    answer = httpx.post(swarm.tracker_url + "/v1/usage", json=envelope, timeout=10)
    assert answer.status_code == 401 and answer.json()["error"]["reason"] == "bad_signature"
    assert swarm.call(swarm.gateway_key, "node_usage", node)["all_time"]["tokens"] == total
    assert all(r["request_id"] != "forged-1" for r in ledger_rows(node))
    # what a node operator runs: every row checked against the gateway's and the tracker's signatures
    checked = subprocess.run(
        [sys.executable, "-m", "node.cli", "ledger", "--tracker", swarm.tracker_url]
        + ["--node-id", node, "--tracker-id", tracker_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    summary = json.loads(checked.stdout)
    assert summary["rows"] == summary["verified"] >= 1 and summary["tokens_verified"] == total
    assert summary["tokens_by_gateway"] == {public_key_hex(swarm.gateway_key): total}


def test_routing_uses_the_decode_time_the_gateway_measured(swarm: Swarm) -> None:
    model = _model(swarm, "a")
    client = swarm.openai()
    for _ in range(2):
        client.completions.create(model=model, prompt="Count: one, two,", max_tokens=12, temperature=0)

    def measured() -> dict[str, float]:
        return {
            n: float(row["shard"]["observed_ms_per_token"])
            for n, row in swarm.swarm_nodes().items()
            if row["shard"] and row["shard"]["observed_ms_per_token"] is not None
        }

    speeds = wait_until(measured, 20, "a statistics report with measured node speeds")
    for node, ms in speeds.items():
        claimed = swarm.swarm_nodes()[node]["shard"]["decode_ms_per_token"]
        # what one token took through the whole model on this loaded 2-core machine: a few ms to a few
        # hundred, never the 0.01 ms a liar would claim
        assert 0.5 < ms < 5000, (node, ms, claimed)


def test_a_hostile_chat_template_is_refused_and_the_gateway_keeps_serving(swarm: Swarm) -> None:
    client = swarm.openai(timeout_s=60)
    real = _model(swarm, "a")
    # an honest conversation renders through the hostile model's template (its plain branch)
    ok = client.chat.completions.create(
        model=HOSTILE_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert ok.choices[0].message.content is not None
    served: list[str] = []
    stop = threading.Event()

    def keep_serving() -> None:  # the real model, meanwhile, through the same gateway
        while not stop.is_set():
            r = client.completions.create(model=real, prompt="One, two,", max_tokens=4, temperature=0)
            served.append(r.choices[0].text)

    worker = threading.Thread(target=keep_serving)
    worker.start()
    try:
        for attack, why in (
            ("loop", "did not finish within"),
            ("allocate", "needs more than"),
            ("write", "too long"),
        ):
            t0 = time.monotonic()
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model=HOSTILE_NAME, messages=[{"role": "user", "content": attack}], max_tokens=4
                )
            took = time.monotonic() - t0
            assert why in err.value.message, (attack, err.value.message)
            assert took < 10, (attack, took)
            health = httpx.get(swarm.gateway.url + "/health", timeout=5)
            assert health.status_code == 200
    finally:
        stop.set()
        worker.join(60)
    assert served and all(t == served[0] for t in served)  # the other model was served all along
    assert swarm.gateway.alive()
    again = client.chat.completions.create(
        model=HOSTILE_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert again.choices[0].message.content == ok.choices[0].message.content


def test_a_node_convicted_by_evidence_is_banned_and_its_announce_refused(swarm: Swarm) -> None:
    model = _model(swarm, "a")
    a, b, h = (swarm.node_id(n) for n in "abh")
    verdict = _evidence(public_key_hex(swarm.gateway_key), liar=b, honest=a, judge=h)
    answer = swarm.call(swarm.gateway_key, "report_evidence", verdict)
    assert answer["banned"] is True and answer["node_id"] == b
    assert swarm.state("b") == "banned"
    assert all(hop["node_id"] != b for r in swarm.routes(model) for hop in r)
    # the node hears it on its next heartbeat; restarted (same key), its announce is refused
    wait_until(lambda: '"banned"' in swarm.nodes["b"].log_text(), 20, "the node's heartbeat refused")
    swarm.nodes["b"].stop()
    seen = len(swarm.nodes["b"].log_text().splitlines())  # the restarted process appends to this log
    restarted = swarm.sup.start_node(
        "b", model=swarm.model_path, layers="0:30", tracker_url=swarm.tracker_url, cache_dir=swarm.node_cache
    )
    restarted.ready(120)
    refused = wait_until(
        lambda: [
            e
            for line in restarted.log_text().splitlines()[seen:]
            if '"tracker_refused"' in line and (e := json.loads(line)).get("status") == 403
        ],
        60,
        "the restarted node's announce refused",
    )
    assert refused[-1]["code"] == "banned" and "caught lying" in refused[-1]["message"]
    assert swarm.state("b") == "banned"
    trust = swarm.call(swarm.gateway_key, "node_trust", b)
    assert trust["banned_until"] is not None and trust["evidence"][0]["conclusive"] is True
    # the evidence is kept exactly as the gateway signed it
    assert trust["evidence"][0]["envelope"]["public_key"] == public_key_hex(swarm.gateway_key)


def _evidence(gateway_id: str, *, liar: str, honest: str, judge: str) -> Evidence:
    """A verdict as a gateway's spot check builds it: the first stage's digests parted; the judge
    agreed with the honest run."""
    return Evidence.from_json(
        {
            "gateway_id": gateway_id,
            "request_id": "chatcmpl-e2e",
            "liar": liar,
            "conclusive": True,
            "stage": 0,
            "positions": [0, 9],
            "reports": {
                "primary": {"node_id": liar, "epoch": 1, "step_id": 2, "digest": "0f" * 16},
                "shadow": {"node_id": honest, "epoch": 1, "step_id": 2, "digest": "a5" * 16},
            },
            "judge": {"node_id": judge, "epoch": 1, "step_id": 2, "digest": "a5" * 16},
            "detail": "outvoted by the judge",
            "time": time.time(),
        }
    )


# --- a registered model: its name and its vocabulary are bound to its fingerprint ------------------


@dataclass
class Registered:
    sup: Supervisor
    tracker: Service
    gateway: Service
    honest: Service  # a real node of the registered model (layers 0..15: a peer, on no full route)
    fake: Any  # a scripted node announcing the registered fingerprint, serving a tampered vocabulary
    fingerprint: str
    name: str
    expected: str  # what the scripted node generates, as text (read with the real vocabulary)
    hijack: Path  # the test model with another chat template (and so another fingerprint), same name


@pytest.fixture(scope="module")
def registered(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[Registered]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
    from swarm_fixtures import announce, scripted_nodes  # the gateway tests' scripted nodes

    from common.vocab import Vocabulary
    from node.shard import extract_vocab
    from proto.announce import ModelSpec

    work = tmp_path_factory.mktemp("registered")
    hijack = work / "hijack.gguf"  # same name, its own chat template: another fingerprint
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            "--chat-template",
            "{{ 'owned' }}",
            "--force",
        ]
        + [str(model_path), str(hijack)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with Vocabulary(model_path) as vocab:
        name = vocab.metadata("general.name") or ""
    with Supervisor(work) as sup:
        tracker = sup.start_tracker(extra_args=["--heartbeat-interval-s", "1"]).ready(60)
        added = subprocess.run(
            [sys.executable, "-m", "tracker.cli", "model", "add", str(model_path)]
            + ["--tracker", tracker.url, "--data-dir", str(work / "tracker")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert added.returncode == 0, added.stdout + added.stderr
        registry = httpx.get(f"{tracker.url}/v1/registry/models", timeout=10).json()["models"]
        [fingerprint] = [m["fingerprint"] for m in registry if m["name"] == name]
        honest = sup.start_node(
            "honest", model=model_path, layers="0:15", tracker_url=tracker.url, cache_dir=node_cache
        )
        honest.ready(120)
        tampered = extract_vocab(hijack, work / "hijack-cache").read_bytes()
        nodes = scripted_nodes(
            model_path, node_cache, " The registry vouches for this.", fingerprint, [(0, 30)], first_seed=200
        )
        fake = nodes.nodes[0]
        fake.vocab = tampered  # what it serves to gateways that ask
        spec = ModelSpec(fingerprint=fingerprint, name=name, architecture="llama", n_layers=30, n_embd=576)
        announce(tracker.url, fake.key, spec, 0, 30, fake.port)
        gateway = sup.start_gateway(tracker_url=tracker.url).ready(60)
        s = Registered(sup, tracker, gateway, honest, fake, fingerprint, name, nodes.expected, hijack)
        wait_until(
            lambda: (
                {n["state"] for n in httpx.get(tracker.url + "/v1/swarm", timeout=10).json()["nodes"]}
                == {"live"}
                and len(httpx.get(tracker.url + "/v1/swarm", timeout=10).json()["nodes"]) == 2
            ),
            120,
            "the honest and the scripted node live",
        )
        try:
            yield s
        finally:
            fake.stop()


def test_a_hijacked_name_is_refused(registered: Registered, node_cache: Path) -> None:
    hijacker = registered.sup.start_node(
        "hijacker",
        model=registered.hijack,
        layers="0:30",
        tracker_url=registered.tracker.url,
        cache_dir=node_cache,
    )
    hijacker.ready(120)
    refused = wait_until(
        lambda: [
            e
            for line in hijacker.log_text().splitlines()
            if '"tracker_refused"' in line and (e := json.loads(line)).get("code") == "model_name_bound"
        ],
        60,
        "the hijacker's announce refused",
    )
    assert refused[0]["status"] == 403 and registered.fingerprint[:16] in refused[0]["message"]
    nodes = httpx.get(registered.tracker.url + "/v1/swarm", timeout=10).json()["nodes"]
    assert len(nodes) == 2  # the hijacker is not in the registry at all
    models = httpx.get(registered.tracker.url + "/v1/models", timeout=10).json()["models"]
    assert [m["fingerprint"] for m in models if m["name"] == registered.name] == [registered.fingerprint]
    hijacker.stop()


def test_a_vocabulary_that_does_not_match_the_fingerprint_is_refused(registered: Registered) -> None:
    client = openai.OpenAI(base_url=registered.gateway.url + "/v1", api_key="t", max_retries=0, timeout=60)
    # the only full route is the scripted node's, and it serves a vocabulary whose chat template is not
    # the model's: the gateway refuses it, takes the one the honest peer proves, and serves the request
    reply = client.completions.create(model=registered.name, prompt="Hello", max_tokens=16, temperature=0)
    assert (
        reply.choices[0].text == registered.expected[: len(reply.choices[0].text)] and reply.choices[0].text
    )
    events = [json.loads(line) for line in registered.gateway.log_text().splitlines() if '"vocab_' in line]
    refused = [e for e in events if e["event"] == "vocab_refused"]
    checked = [e for e in events if e["event"] == "vocab_checked"]
    assert refused and refused[0]["address"] == f"127.0.0.1:{registered.fake.port}"
    assert "tokenizer.chat_template" in refused[0]["reason"]
    assert checked and checked[0]["address"] == f"127.0.0.1:{registered.honest.port}"
    cached = registered.sup.workdir / "gateway" / "vocab" / f"{registered.fingerprint}.checked.gguf"
    from gateway.vocab_check import read_kv

    assert b"owned" not in read_kv(cached.read_bytes())["tokenizer.chat_template"].raw
