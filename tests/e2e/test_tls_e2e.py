"""gRPC over TLS in a real swarm on loopback: pinned certificates, what an observer sees, impostors.

Real tracker, gateway and node processes. The nodes serve TLS with their own
certificates and announce their fingerprints; the gateway pins them. The test
steers routing with announcements signed by the nodes' own keys (read from
their data directories, as an operator of those nodes could), which lets it
place a socket-level TCP proxy -- a passive observer that records every byte --
between the gateway (and the previous stage) and the last stage, or announce a
node at the address of another node that shows a different certificate:

- through TLS the text is the whole model's greedy output, and the observer
  finds neither the model fingerprint (in every frame header) nor the prompt's
  token ids (a packed field of the prefill frame);
- the same observer in front of a node serving plaintext (the gateway allowing
  it) finds both, so the check can fail;
- a node announced with one certificate but reached at an address whose node
  shows another is refused by the gateway (one log line), and routing works
  again once the announcement is right.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from common.keyfile import load_key_file
from common.tracker_client import TrackerClient
from node.shard import read_model_meta
from proto.announce import Announce, Hardware, Leave, ModelSpec
from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import NO_SPOT_CHECKS, Service
from tests.e2e.swarm_helpers import Reference

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
N_NEW = 16
HARDWARE = Hardware(cpu_cores=1, ram_bytes=1 << 30, gpus=(), backends=("cpu",), free_disk_bytes=1 << 30)


class Observer:
    """A TCP proxy on loopback that forwards both ways and keeps a copy of every byte."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.seen = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closing = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the target is gone: so is this connection
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def snapshot(self) -> bytes:
        with self._lock:
            return bytes(self.seen)

    def close(self) -> None:
        self._closing = True
        self._listener.close()


def varints(values: list[int]) -> bytes:
    """``values`` as protobuf packs a repeated integer field (what a frame's token_ids look like)."""
    out = bytearray()
    for v in values:
        while True:
            byte = v & 0x7F
            v >>= 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                break
    return bytes(out)


def announce_as(
    swarm: LocalSwarm, node: Service, model: ModelSpec, span: tuple[int, int], **fields: object
) -> None:
    """An announcement signed with ``node``'s own key (its data dir), with ``fields`` overridden."""
    assert node.data_dir is not None
    key = load_key_file(node.data_dir / "node.key")
    body = {
        "node_id": key.verify_key.encode().hex(),
        "addresses": (f"127.0.0.1:{node.port}",),
        "relay": False,
        "relay_via": None,
        "hardware": HARDWARE,
        "software_version": "test",
        "model": model,
        "shard_start": span[0],
        "shard_end": span[1],
        "decode_ms_per_token": 5.0,
        "prefill_tokens_per_s": 1000.0,
        "max_sessions": 8,
        "tls_fingerprint": node.tls_fingerprint(),
        **fields,
    }

    async def run() -> None:
        async with TrackerClient(swarm.tracker_url, key) as client:
            with trio.fail_after(20):
                await client.announce(Announce(**body))  # type: ignore[arg-type]

    trio.run(run)


def leave_as(swarm: LocalSwarm, node: Service) -> None:
    assert node.data_dir is not None
    key = load_key_file(node.data_dir / "node.key")

    async def run() -> None:
        async with TrackerClient(swarm.tracker_url, key) as client:
            with trio.fail_after(20):
                await client.leave(Leave(key.verify_key.encode().hex(), "test"))

    trio.run(run)


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("tls-swarm"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        # Routes refreshed every second, so steered announcements are seen; plaintext nodes allowed for
        # the control. No challenges: the test's announcements move nodes without a challenge round.
        gateway_args=["--route-ttl-s", "1", "--allow-plaintext-nodes", *NO_SPOT_CHECKS],
        tracker_args=["--no-challenges", "--probation-checks", "0"],
        node_args=["--no-benchmark"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_spec(model_path: Path, node_cache: Path) -> ModelSpec:
    meta = read_model_meta(model_path, node_cache)
    return ModelSpec(
        meta.fingerprint, (meta.name or meta.path.stem)[:200], meta.architecture, meta.n_layers, meta.n_embd
    )


def chat(swarm: LocalSwarm) -> str:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-tls", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=swarm.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N_NEW,
        temperature=0,
    )
    return out.choices[0].message.content or ""


def prompt_ids(reference: Reference) -> list[int]:
    text = reference.template.render([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    return list(reference.vocab.tokenize(text, add_special=False))


def settle() -> None:
    time.sleep(2.5)  # the gateway's cached routes (route_ttl_s 1) pick up the new announcement


def test_nodes_announce_their_certificates_and_the_text_is_exact(
    swarm: LocalSwarm, reference: Reference
) -> None:
    nodes = httpx.get(f"{swarm.tracker_url}/v1/swarm", timeout=10).json()["nodes"]
    pins = {n.tls_fingerprint() for n in swarm.nodes}
    assert len(pins) == 2 and all(len(p) == 64 for p in pins)
    assert chat(swarm) == reference.chat(QUESTION, N_NEW)
    assert len(nodes) == 2


def test_an_observer_between_the_stages_sees_no_plaintext(
    swarm: LocalSwarm, reference: Reference, model_spec: ModelSpec
) -> None:
    last = swarm.nodes[1]
    observer = Observer(last.port)
    try:
        announce_as(swarm, last, model_spec, (15, 30), addresses=(f"127.0.0.1:{observer.port}",))
        settle()
        assert chat(swarm) == reference.chat(QUESTION, N_NEW)
        seen = observer.snapshot()
    finally:
        announce_as(swarm, last, model_spec, (15, 30))
        observer.close()
    assert observer.connections >= 1 and len(seen) > 10_000  # the frames went through the observer
    assert model_spec.fingerprint.encode() not in seen
    assert varints(prompt_ids(reference)) not in seen


def test_a_node_showing_another_certificate_than_announced_is_refused(
    swarm: LocalSwarm, reference: Reference, model_spec: ModelSpec, model_path: Path, node_cache: Path
) -> None:
    last = swarm.nodes[1]
    # A real node process with its own certificate, unknown to the tracker, serving the same layers.
    other = swarm.supervisor.start_node(
        "other",
        model=model_path,
        layers="15:30",
        tracker_url=None,
        tls=True,
        cache_dir=node_cache,
        extra_args=["--no-benchmark"],
    )
    other.wait_port(120)
    assert other.tls_fingerprint() and other.tls_fingerprint() != last.tls_fingerprint()
    gateway_log = len(swarm.gateway.log_text())
    try:
        # The last stage's signed announcement (its pin) now names the other node's address.
        announce_as(swarm, last, model_spec, (15, 30), addresses=(f"127.0.0.1:{other.port}",))
        settle()
        client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-tls", max_retries=0, timeout=120)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=swarm.model_name, messages=[{"role": "user", "content": QUESTION}], max_tokens=4
            )
        assert refused.value.status_code in (502, 503)
        log = swarm.gateway.log_text()[gateway_log:]
        assert "node_tls_refused" in log and last.tls_fingerprint()[:16] in log
        status = httpx.get(f"http://127.0.0.1:{other.admin_port}/status", timeout=10).json()
        assert status["tokens_processed"] == 0  # nothing reached the other node's engine
    finally:
        announce_as(swarm, last, model_spec, (15, 30))
        other.stop()
    settle()
    assert chat(swarm) == reference.chat(QUESTION, N_NEW)


def test_the_same_observer_reads_a_plaintext_node(
    swarm: LocalSwarm, reference: Reference, model_spec: ModelSpec, model_path: Path, node_cache: Path
) -> None:
    """The control: without TLS the observer's capture holds the markers the TLS test looks for."""
    last = swarm.nodes[1]
    plain = swarm.supervisor.start_node(
        "plain",
        model=model_path,
        layers="15:30",
        tracker_url=None,
        tls=False,
        cache_dir=node_cache,
        extra_args=["--no-benchmark"],
    )
    plain.wait_port(120)
    assert plain.tls_fingerprint() == ""
    observer = Observer(plain.port)
    try:
        # The TLS last stage out of the way (announced where nothing listens: heartbeats keep that).
        announce_as(swarm, last, model_spec, (15, 30), addresses=("127.0.0.1:1",))
        announce_as(swarm, plain, model_spec, (15, 30), addresses=(f"127.0.0.1:{observer.port}",))
        settle()
        assert chat(swarm) == reference.chat(QUESTION, N_NEW)
        seen = observer.snapshot()
    finally:
        leave_as(swarm, plain)
        announce_as(swarm, last, model_spec, (15, 30))
        observer.close()
        plain.stop()
    assert model_spec.fingerprint.encode() in seen
    assert varints(prompt_ids(reference)) in seen
