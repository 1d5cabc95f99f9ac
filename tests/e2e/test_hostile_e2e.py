"""Attacks on a node's streams and sessions, on a real swarm: tracker, two nodes and a gateway on loopback.

The tracker registers the gateway's key, so route tickets go to that gateway
only and name it; nodes open sessions on them only with that gateway's
per-OPEN proof. Each test runs an attack from issue 17 as a stranger would
(a key generated on the spot, raw gRPC) and checks it is refused or bounded
while a legitimate client keeps getting exactly the whole model's text:

* unsigned (or stranger-signed) ``/v1/routes`` requests get no ticket;
* a ticket copied from the gateway's OPEN opens nothing for another key;
* a foreign connection that knows a live session's id cannot CANCEL it or
  take it over with a re-attach;
* 100 idle gRPC streams (no ticket, no frame) do not take the node offline;
* re-sending one 2,040-token prefill step 100 times without reading the
  replies grows the node by a bounded number of bytes (RSS measured);
* no refusal logs a traceback.
"""

from __future__ import annotations

import secrets
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import nacl.signing
import openai
import pytest
import trio

from common.keyfile import load_or_create_key_file
from common.tls import TLS_SERVER_NAME, fingerprint_pem, is_fingerprint
from common.tracker_client import TrackerClient
from proto import codec
from proto.signing import (
    make_payload,
    public_key_hex,
    route_ticket_envelope,
    sign_envelope,
    verify_route_ticket,
)
from proto.swarm.v1 import frame_pb2, status_pb2
from sim.launcher import LocalSwarm, start_local_swarm
from tests.e2e.swarm_helpers import Reference, wait_until
from tests.node.loopback_client import (
    GRPC_OPTIONS,
    RouteSession,
    Stage,
    StageStream,
    node_info,
    open_proof,
    ticket_bytes,
)

pytestmark = pytest.mark.slow

S = status_pb2
MAX_SESSIONS = 4  # so 4 x 4 + 64 = 80 streams filled the node before unproven streams made room
IDLE_TIMEOUT_S = 3.0
QUESTION = "What is the capital of France?"
N_NEW = 16


class Hostile:
    def __init__(self, swarm: LocalSwarm, gateway_key: nacl.signing.SigningKey, model_path: Path) -> None:
        self.swarm = swarm
        self.gateway_key = gateway_key
        self.stranger = nacl.signing.SigningKey.generate()
        self.stages = [node_info_stage(n.port) for n in swarm.nodes]
        self.fingerprint = self.stages[0].info.model.fingerprint
        # The pin of each node's gRPC certificate (from its data dir), which it also announces.
        self.pins = {s.address: n.tls_fingerprint() for s, n in zip(self.stages, swarm.nodes, strict=True)}
        for stage in self.stages:
            assert is_fingerprint(self.pins[stage.address]), f"node {stage.address} serves no TLS"
            assert stage.info.tls_fingerprint == self.pins[stage.address]

    def bound_ticket(self, key: nacl.signing.SigningKey | None = None) -> bytes:
        """A ticket for the whole route, from a route request signed with ``key`` (the gateway's)."""

        async def run() -> dict[str, Any]:
            async with TrackerClient(self.swarm.tracker_url, key or self.gateway_key) as client:
                with trio.fail_after(30):
                    return await client.routes(self.fingerprint, k=1, sign=True)

        answer = trio.run(run)
        (route,) = answer["routes"]
        assert [h["node_id"] for h in route["hops"]] == [s.info.node_id for s in self.stages]
        return ticket_bytes(route["ticket"])

    def chat(self) -> str:
        client = openai.OpenAI(base_url=self.swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=self.swarm.model_name,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=N_NEW,
            temperature=0,
        )
        return reply.choices[0].message.content or ""

    def metric(self, node: int, name: str, **labels: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.swarm.nodes[node].admin_port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"node {node} has no metric {name} {labels}")

    def open_frame(
        self, stage: Stage, sid: str, ticket: bytes, *, epoch: int = 1, step_id: int = 1, budget: int = 64
    ) -> frame_pb2.Frame:
        return codec.open_frame(
            header(stage, sid, epoch), step_id=step_id, route_ticket=ticket, kv_budget_tokens=budget
        )


def node_info_stage(port: int) -> Stage:
    address = f"127.0.0.1:{port}"
    return Stage(address, node_info(address))


def header(stage: Stage, sid: str, epoch: int = 1) -> codec.SessionHeader:
    return codec.SessionHeader(
        sid, epoch, stage.info.model.fingerprint, stage.info.recipe.fingerprint, stage.start, stage.end
    )


def pinned_channel(address: str, pin: str) -> grpc.Channel:
    """A raw gRPC channel over TLS to a node, trusting exactly the certificate whose sha256 is ``pin``
    (what every dialler of a node does; a stranger learns the pin from the node's announcement)."""
    host, _, port = address.rpartition(":")
    pem = ssl.get_server_certificate((host, int(port)), timeout=10).encode("ascii")
    assert fingerprint_pem(pem) == pin, f"{address} shows another certificate than its pin"
    credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.secure_channel(
        address, credentials, options=[*GRPC_OPTIONS, ("grpc.ssl_target_name_override", TLS_SERVER_NAME)]
    )


def stream_to(hostile: Hostile, stage: Stage) -> tuple[grpc.Channel, StageStream]:
    channel = pinned_channel(stage.address, hostile.pins[stage.address])
    return channel, StageStream(channel, timeout_s=120)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def hostile(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[Hostile]:
    work = tmp_path_factory.mktemp("hostile")
    swarm = start_local_swarm(
        work,
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        max_sessions=MAX_SESSIONS,
        node_cache=node_cache,
        tracker_args=["--heartbeat-interval-s", "1"],
        node_args=["--no-benchmark", "--stream-idle-timeout-s", str(IDLE_TIMEOUT_S)],
        register_gateway=True,  # the tracker knows the gateway's key: tickets for it alone
    )
    gateway_key, _ = load_or_create_key_file(work / "gateway" / "gateway.key")  # the key it runs with
    try:
        yield Hostile(swarm, gateway_key, model_path)
    finally:
        swarm.stop()


def test_route_tickets_go_to_the_registered_gateway_only_and_name_it(hostile: Hostile) -> None:
    url = f"{hostile.swarm.tracker_url}/v1/routes"
    unsigned = httpx.post(url, json={"model": hostile.fingerprint, "k": 1}, timeout=10)
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "gateway_signature_required"
    assert httpx.get(url, params={"model": hostile.fingerprint}, timeout=10).status_code == 401
    stranger = sign_envelope(
        hostile.stranger,
        make_payload(
            "route_request", "gateway_id", hostile.stranger, time.time(), {"model": hostile.fingerprint}
        ),
    )
    refused = httpx.post(url, json=stranger, timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "unregistered_gateway"
    envelope = route_ticket_envelope(hostile.bound_ticket())
    tracker_id = httpx.get(f"{hostile.swarm.tracker_url}/healthz", timeout=10).json()["tracker_id"]
    ticket = verify_route_ticket(envelope, tracker_public_key=tracker_id, now_s=time.time())
    assert ticket.gateway_id == public_key_hex(hostile.gateway_key)


def test_a_ticket_copied_from_the_gateway_opens_nothing_for_another_key(
    hostile: Hostile, reference: Reference
) -> None:
    ticket = hostile.bound_ticket()  # what every stage of a route sees in its OPEN
    stage = hostile.stages[0]
    channel, stream = stream_to(hostile, stage)
    try:
        # As many OPENs as the node has slots (one bearer ticket used to fill all 8): none is granted.
        for i in range(MAX_SESSIONS + 1):
            frame = hostile.open_frame(stage, f"grab{i}", ticket)
            if i % 2:  # the stranger signs a proof with its own key
                frame.open.gateway_proof = open_proof(hostile.stranger, stage.info.node_id, frame)
            stream.send(frame)
            reply = stream.recv()
            assert codec.body_kind(reply) == "error" and reply.error.status == S.STATUS_TICKET_INVALID
            assert ("missing_proof" if i % 2 == 0 else "untrusted_key") in reply.error.message
        assert hostile.metric(0, "swarm_node_sessions") == 0
        # The same ticket with the gateway's proof does open: the refusals above were about the key.
        frame = hostile.open_frame(stage, "legit", ticket)
        frame.open.gateway_proof = open_proof(hostile.gateway_key, stage.info.node_id, frame)
        stream.send(frame)
        assert codec.body_kind(stream.recv()) == "open_ack"
        stream.send(codec.cancel_frame(header(stage, "legit"), step_id=2))
        assert codec.body_kind(stream.recv()) == "closed"
    finally:
        stream.close()
        channel.close()
    assert hostile.chat() == reference.chat(QUESTION, N_NEW)


def test_a_foreign_connection_cannot_cancel_or_take_over_a_live_session(
    hostile: Hostile, reference: Reference
) -> None:
    prompt = reference.vocab.tokenize("The capital of France is", add_special=True)
    reference.ref.clear()
    want, _ = reference.ref.greedy(prompt, 12)
    ticket = hostile.bound_ticket()
    sid = secrets.token_hex(16)
    owner = RouteSession(hostile.stages, ticket, session_id=sid, gateway_key=hostile.gateway_key)
    try:
        got = [owner.step(prompt).token_id]  # type: ignore[union-attr]
        got.append(owner.step([got[-1]]).token_id)  # type: ignore[union-attr]
        for k, stage in enumerate(hostile.stages):
            # A stranger that knows the session id (every stage of the route sees it) and its ticket.
            channel, foreign = stream_to(hostile, stage)
            try:
                foreign.send(codec.cancel_frame(header(stage, sid), step_id=10_000, reason="hostile"))
                refused = foreign.recv()
                assert refused.error.status == S.STATUS_TICKET_INVALID and not refused.error.session_closed
                reopen = hostile.open_frame(stage, sid, ticket, epoch=2, step_id=5000, budget=256)
                foreign.send(reopen)  # a re-attach with the copied ticket and no proof
                assert foreign.recv().error.status == S.STATUS_TICKET_INVALID
                reopen.open.gateway_proof = open_proof(hostile.stranger, stage.info.node_id, reopen)
                foreign.send(reopen)  # ... or its own key's proof
                assert foreign.recv().error.status == S.STATUS_TICKET_INVALID
                foreign.send(codec.cancel_frame(header(stage, sid, epoch=2), step_id=10_001))
                assert foreign.recv().error.status == S.STATUS_ROUTE_EPOCH  # the session stayed at epoch 1
                foreign.send(codec.cancel_frame(header(stage, sid), step_id=10_002))
                assert foreign.recv().error.status == S.STATUS_TICKET_INVALID
            finally:
                foreign.close()
                channel.close()
            assert hostile.metric(k, "swarm_node_sessions") == 1
        while len(got) < len(want):  # the owner goes on as if nothing happened
            got.append(owner.step([got[-1]]).token_id)  # type: ignore[union-attr]
        assert got == list(want)
        assert [codec.body_kind(f) for f in owner.release()] == ["closed", "closed"]
    finally:
        owner.close()


def test_idle_streams_do_not_take_the_node_offline(hostile: Hostile, reference: Reference) -> None:
    stage = hostile.stages[0]
    closed_before = hostile.metric(0, "swarm_node_idle_streams_closed_total")
    seen_before = sum(hostile.metric(0, "swarm_node_streams_total", outcome=o) for o in ("opened", "refused"))
    # Four TLS connections (pinned, completed handshakes) carrying 100 gRPC streams that send nothing.
    channels = [pinned_channel(stage.address, hostile.pins[stage.address]) for _ in range(4)]
    idle = [StageStream(channels[i % 4], timeout_s=120) for i in range(100)]  # no ticket, no frame
    try:

        def seen() -> float:
            return sum(
                hostile.metric(0, "swarm_node_streams_total", outcome=o) for o in ("opened", "refused")
            )

        wait_until(lambda: seen() >= seen_before + 100, 30, "the node to see the 100 streams")
        # While they are open (or were just pushed out), a client gets the whole model's text.
        assert hostile.chat() == reference.chat(QUESTION, N_NEW)
        # Every one past the per-address bound of unproven streams (16) made the oldest go; none of
        # them, and none of the gateway's, was refused.
        assert hostile.metric(0, "swarm_node_idle_streams_closed_total") - closed_before >= 100 - 16
        assert hostile.metric(0, "swarm_node_streams_total", outcome="refused") == 0
        assert hostile.metric(0, "swarm_node_unproven_connections") <= 16
        # And those time out.
        wait_until(
            lambda: hostile.metric(0, "swarm_node_unproven_connections") == 0,
            IDLE_TIMEOUT_S + 10,
            "the idle streams to time out",
        )
        assert hostile.metric(0, "swarm_node_idle_streams_closed_total") - closed_before >= 100
    finally:
        for s in idle:
            s.close()
            s.cancel()
        for c in channels:
            c.close()


def test_re_sending_a_big_prefill_step_without_reading_is_bounded(
    hostile: Hostile, reference: Reference
) -> None:
    """Issue 17 measured 467 MB of growth for 100 re-sends (the reply bound was 512 frames of any size)."""
    stage = hostile.stages[0]  # no downstream: the step's reply carries its 2,040 hidden rows (4.7 MB)
    node = hostile.swarm.nodes[0]
    ticket = hostile.bound_ticket()
    channel, stream = stream_to(hostile, stage)
    try:
        frame = hostile.open_frame(stage, "amplify", ticket, budget=2048)
        frame.open.gateway_proof = open_proof(hostile.gateway_key, stage.info.node_id, frame)
        stream.send(frame)
        assert codec.body_kind(stream.recv()) == "open_ack"
        tokens = [(7 * i) % 1000 + 10 for i in range(2040)]
        (step,) = codec.step_frames(
            header(stage, "amplify"), frame_pb2.PHASE_PREFILL, step_id=2, start=0, token_ids=tokens
        )
        data = codec.serialize_frame(step)
        stream.send_bytes(data)
        wait_until(
            lambda: hostile.metric(0, "swarm_node_kv_tokens_used") >= 2040, 120, "the step to be computed"
        )
        time.sleep(1.0)  # its reply is queued; let the node settle
        frames_in = hostile.metric(0, "swarm_node_frames_total", direction="in")
        before = rss_bytes(node.pid)
        for _ in range(100):
            stream.send_bytes(data)  # the same step again; nothing read
        wait_until(
            lambda: hostile.metric(0, "swarm_node_frames_total", direction="in") >= frames_in + 100,
            60,
            "the node to take them",
        )
        time.sleep(1.0)
        growth = rss_bytes(node.pid) - before
        suppressed = hostile.metric(0, "swarm_node_replays_suppressed_total")
        print(
            f"RSS growth after 100 re-sends of a 2,040-token step: {growth / 2**20:.1f} MiB; "
            f"{suppressed:g} answers from the cache suppressed"
        )
        assert growth < 150 * 2**20, f"the node grew by {growth / 2**20:.0f} MiB"
        assert suppressed >= 90
        # The node still answers: the replies waiting are the step's, once computed and once from the cache.
        replies = stream.recv_step()
        assert codec.body_kind(replies[-1]) == "result" and replies[-1].kv_len == 2040
        stream.send(codec.cancel_frame(header(stage, "amplify"), step_id=3))
    finally:
        stream.cancel()
        channel.close()
    assert hostile.chat() == reference.chat(QUESTION, N_NEW)


def test_no_refusal_logged_a_traceback(hostile: Hostile) -> None:
    for service in [*hostile.swarm.nodes, hostile.swarm.gateway, hostile.swarm.tracker]:
        assert "Traceback" not in service.log_text(), service.log_tail()
