"""Real processes on loopback: a tracker and two ``swarm-node start`` nodes serving [0,15) and [15,30).

A test client (what a gateway does) gets a route and a real ticket from the
tracker, drives sessions through both nodes over gRPC and must get exactly the
whole model's greedy tokens; four concurrent sessions must not see each
other; every bad input gets its status and leaves the nodes serving.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nacl.signing
import numpy as np
import pytest

from common.vocab import Vocabulary
from node.reference import ReferenceModel
from node.shard import extract_shard, extract_vocab
from proto import codec
from proto.signing import RouteTicket, TicketHop, canonical_json, sign_route_ticket
from proto.swarm.v1 import frame_pb2, shard_service_pb2, shard_service_pb2_grpc, status_pb2
from proto.vocab import VocabAssembler
from sim.procs import Service, Supervisor
from tests.node.loopback_client import (
    GRPC_OPTIONS,
    RouteSession,
    Stage,
    StageStream,
    node_channel,
    node_info,
    ticket_bytes,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4,",
]
N_NEW = 16
S = status_pb2


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def wait_for_route(tracker_url: str, model: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            status, body = http_json(f"{tracker_url}/v1/routes", {"model": model, "k": 1})
        except OSError as err:
            status, body = 0, repr(err)
        if status == 200 and body["routes"]:
            return dict(body)
        last = (status, body)
        time.sleep(0.2)
    raise AssertionError(f"no route for {model} within {timeout_s} s: {last}")


def start_node(
    sup: Supervisor, name: str, model: Path, layers: str, tracker_url: str, cache: Path, *extra: str
) -> Service:
    return sup.start_node(
        name,
        model=model,
        layers=layers,
        tracker_url=tracker_url,
        max_sessions=6,
        session_kv_tokens=512,
        cache_dir=cache,
        # Sessions grow in the KV pool to at most 2,048 positions, below the model's 8k context: the
        # admission test asks one past it ("per session"), not one past the model.
        extra_args=[
            *("--heartbeat-interval-s", "1", "--batch-tokens", "256", "--max-session-kv-tokens", "2048"),
            *extra,
        ],
    )


@dataclass
class Swarm:
    supervisor: Supervisor
    tracker: Service
    nodes: list[Service]
    tracker_url: str
    stages: list[Stage]
    route: dict
    workdir: Path

    def ticket(self) -> bytes:
        return ticket_bytes(self.route["ticket"])


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path) -> Iterator[Swarm]:
    workdir = tmp_path_factory.mktemp("swarm")
    sup = Supervisor(workdir)
    try:
        tracker = sup.start_tracker().ready(60)
        url = tracker.url
        # Fingerprint and shard files into the shared cache first, so both nodes start in parallel.
        for start, end in ((0, 15), (15, 30)):
            extract_shard(model_path, start, end, node_cache)
        extract_vocab(model_path, node_cache)
        a = start_node(sup, "node-a", model_path, "0:15", url, node_cache)
        b = start_node(sup, "node-b", model_path, "15:30", url, node_cache)
        a.ready(120)
        b.ready(120)
        stages = [Stage(f"127.0.0.1:{p.port}", node_info(f"127.0.0.1:{p.port}")) for p in (a, b)]
        route = wait_for_route(url, stages[0].info.model.fingerprint)["routes"][0]
        assert [h["node_id"] for h in route["hops"]] == [s.info.node_id for s in stages]
        yield Swarm(sup, tracker, [a, b], url, stages, route, workdir)
    finally:
        sup.stop_all()


@pytest.fixture(scope="module")
def expected(reference: ReferenceModel, vocab: Vocabulary) -> dict[str, list[int]]:
    out = {}
    for prompt in PROMPTS:
        reference.clear()
        out[prompt] = reference.greedy(vocab.tokenize(prompt, add_special=True), N_NEW)[0]
    return out


# --------------------------------------------------------------------------- parity and isolation


def test_two_nodes_give_the_whole_models_greedy_tokens(
    swarm: Swarm, vocab: Vocabulary, expected: dict[str, list[int]]
) -> None:
    prompt = PROMPTS[0]
    session = RouteSession(swarm.stages, swarm.ticket())
    try:
        tokens = session.generate(vocab.tokenize(prompt, add_special=True), N_NEW)
        closed = session.release()
    finally:
        session.close()
    assert tokens == expected[prompt]
    assert [codec.body_kind(f) for f in closed] == ["closed", "closed"]
    assert closed[0].closed.freed_kv_tokens == len(vocab.tokenize(prompt, add_special=True)) + N_NEW - 1


def test_four_concurrent_sessions_do_not_cross_talk(
    swarm: Swarm, vocab: Vocabulary, expected: dict[str, list[int]]
) -> None:
    ticket = swarm.ticket()
    before = [_counts(node) for node in swarm.nodes]

    def run(prompt: str) -> list[int]:
        session = RouteSession(swarm.stages, ticket)
        try:
            return session.generate(vocab.tokenize(prompt, add_special=True), N_NEW)
        finally:
            session.release()
            session.close()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS))
    for prompt, tokens in zip(PROMPTS, results, strict=True):
        assert tokens == expected[prompt], prompt
    # the sessions advanced together: some engine batches carried several sessions' work
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{swarm.nodes[1].admin_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    (line,) = [x for x in metrics.splitlines() if x.startswith("swarm_node_multi_session_batches_total ")]
    assert float(line.split()[1]) > 0
    # every step each node finished waited in its engine queue once: the queue-wait histogram moved by
    # exactly as many steps as the engine-time one (no step failed), at least one per decode step
    for node, was in zip(swarm.nodes, before, strict=True):
        now = _counts(node)
        steps = now["swarm_node_step_seconds"] - was["swarm_node_step_seconds"]
        assert steps >= len(PROMPTS) * (N_NEW - 1)
        assert now["swarm_node_queue_wait_seconds"] - was["swarm_node_queue_wait_seconds"] == steps


def _counts(node: Service) -> dict[str, float]:
    """``_count`` of the node's step and queue-wait histograms, from its admin server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    names = ("swarm_node_step_seconds", "swarm_node_queue_wait_seconds")
    return {n: next((float(x.split()[1]) for x in lines if x.startswith(n + "_count ")), 0.0) for n in names}


def test_broken_stream_reattach_with_a_new_epoch_continues_exactly(
    swarm: Swarm, vocab: Vocabulary, expected: dict[str, list[int]]
) -> None:
    prompt = PROMPTS[3]
    session = RouteSession(swarm.stages, swarm.ticket())
    try:
        out = [session.step(vocab.tokenize(prompt, add_special=True)).token_id]  # type: ignore[union-attr]
        for _ in range(5):
            out.append(session.step([out[-1]]).token_id)  # type: ignore[union-attr]
        # The stream to the last stage breaks; the gateway re-opens every stage with epoch 2.
        session.streams[1].cancel()
        session.streams[1] = StageStream(session.channels[1], 60)
        session.headers = [dataclasses.replace(h, route_epoch=2) for h in session.headers]
        session.step_id += 1
        for stream, header in zip(session.streams, session.headers, strict=True):
            stream.send(
                codec.open_frame(
                    header,
                    step_id=session.step_id,
                    route_ticket=swarm.ticket(),
                    kv_budget_tokens=256,
                    keep_kv_len=session.kv,
                    sampling=codec.SamplingSettings(temperature=0.0),
                )
            )
        acks = [stream.recv() for stream in session.streams]
        assert all(a.open_ack.reattached and a.kv_len == session.kv for a in acks), acks
        while len(out) < N_NEW:
            out.append(session.step([out[-1]]).token_id)  # type: ignore[union-attr]
        # a frame of the old epoch is stale now; one of the new epoch from a connection that does not own
        # the session (and has no hop token) is refused too
        stale = Raw(swarm.stages[1])
        try:
            frame = stale.hidden_step(session.session_id, session.step_id + 1, session.kv, 1)
            assert _status(stale.ask(frame)) == S.STATUS_ROUTE_EPOCH
            frame.route_epoch = 2
            assert _status(stale.ask(frame)) == S.STATUS_TICKET_INVALID
        finally:
            stale.close()
        session.release()
    finally:
        session.close()
    assert out == expected[prompt]


# --------------------------------------------------------------------------- refusals over real gRPC


class Raw:
    """A stream to one stage with hand-made frames."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.channel = node_channel(stage.address, options=GRPC_OPTIONS)
        self.stream = StageStream(self.channel, 60)

    def header(self, sid: str, epoch: int = 1, **kw: object) -> codec.SessionHeader:
        fields = dict(
            session_id=sid,
            route_epoch=epoch,
            model_fingerprint=self.stage.info.model.fingerprint,
            recipe_fingerprint=self.stage.info.recipe.fingerprint,
            shard_start=self.stage.start,
            shard_end=self.stage.end,
        )
        fields.update(kw)
        return codec.SessionHeader(**fields)  # type: ignore[arg-type]

    def ask(self, frame: frame_pb2.Frame | bytes) -> frame_pb2.Frame:
        if isinstance(frame, bytes):
            self.stream.send_bytes(frame)
        else:
            self.stream.send_bytes(frame.SerializeToString())
        return self.stream.recv()

    def open(self, sid: str, ticket: bytes, epoch: int = 1, step_id: int = 1) -> frame_pb2.Frame:
        return self.ask(
            codec.open_frame(
                self.header(sid, epoch), step_id=step_id, route_ticket=ticket, kv_budget_tokens=64
            )
        )

    def hidden_step(
        self, sid: str, step_id: int, start: int, n: int, width: int | None = None
    ) -> frame_pb2.Frame:
        x = (
            np.random.default_rng(step_id)
            .standard_normal((n, width or self.stage.info.model.n_embd))
            .astype(np.float32)
        )
        (frame,) = codec.step_frames(
            self.header(sid), frame_pb2.PHASE_PREFILL, step_id=step_id, start=start, hidden=x * 0.1
        )
        return frame

    def close(self) -> None:
        self.stream.close()
        self.channel.close()


def _status(frame: frame_pb2.Frame) -> int:
    assert codec.body_kind(frame) == "error", frame
    return frame.error.status


def test_bad_inputs_get_their_status_and_the_node_keeps_serving(
    swarm: Swarm, vocab: Vocabulary, expected: dict[str, list[int]]
) -> None:
    # A good session is open on both nodes through all of this and must finish exactly.
    good = RouteSession(swarm.stages, swarm.ticket())
    prompt_ids = vocab.tokenize(PROMPTS[2], add_special=True)
    produced = [good.step(prompt_ids).token_id]  # type: ignore[union-attr]

    raw = Raw(swarm.stages[1])
    ticket = swarm.ticket()
    try:
        # schema version
        frame = codec.open_frame(raw.header("bad-1"), step_id=1, route_ticket=ticket, kv_budget_tokens=8)
        frame.schema_version = 9
        assert _status(raw.ask(frame)) == S.STATUS_SCHEMA_VERSION
        # model and recipe fingerprints, shard
        assert (
            _status(
                raw.ask(
                    codec.open_frame(
                        raw.header("bad-1", model_fingerprint="0" * 64),
                        step_id=1,
                        route_ticket=ticket,
                        kv_budget_tokens=8,
                    )
                )
            )
            == S.STATUS_FINGERPRINT_MISMATCH
        )
        assert (
            _status(
                raw.ask(
                    codec.open_frame(
                        raw.header("bad-1", recipe_fingerprint="0" * 64),
                        step_id=1,
                        route_ticket=ticket,
                        kv_budget_tokens=8,
                    )
                )
            )
            == S.STATUS_FINGERPRINT_MISMATCH
        )
        assert (
            _status(
                raw.ask(
                    codec.open_frame(
                        raw.header("bad-1", shard_start=0), step_id=1, route_ticket=ticket, kv_budget_tokens=8
                    )
                )
            )
            == S.STATUS_SHARD_MISMATCH
        )
        # garbage and an oversized frame
        assert _status(raw.ask(b"\x08\x01\xff\xff\xff")) == S.STATUS_BAD_FRAME
        assert _status(raw.ask(b"\x00" * (codec.DEFAULT_MAX_FRAME_BYTES + 1000))) == S.STATUS_TOO_LARGE
        # an open session for payload checks
        assert codec.body_kind(raw.open("bad-2", ticket)) == "open_ack"
        frame = raw.hidden_step("bad-2", 2, 0, 3)
        frame.activation.tensors[0].checksum = b"\x01\x02\x03\x04"
        assert _status(raw.ask(frame)) == S.STATUS_CHECKSUM
        assert _status(raw.ask(raw.hidden_step("bad-2", 2, 0, 3, width=100))) == S.STATUS_SHAPE
        frame = raw.hidden_step("bad-2", 2, 0, 3)
        frame.activation.tensors[0].dtype = 5
        assert _status(raw.ask(frame)) == S.STATUS_DTYPE
        # position that does not match the KV length
        reply = raw.ask(raw.hidden_step("bad-2", 2, 4, 1))
        assert _status(reply) == S.STATUS_POSITION_MISMATCH and reply.kv_len == 0
        # a good step, then an idempotent replay of it
        first = raw.ask(raw.hidden_step("bad-2", 2, 0, 3))
        assert codec.body_kind(first) == "result" and first.kv_len == 3
        again = raw.ask(raw.hidden_step("bad-2", 2, 0, 3))
        assert again.SerializeToString() == first.SerializeToString()
        # unknown session; released session; frame after cancel
        assert _status(raw.ask(raw.hidden_step("nobody", 2, 0, 1))) == S.STATUS_UNKNOWN_SESSION
        closed = raw.ask(codec.release_frame(raw.header("bad-2"), step_id=3, expected_kv_len=3))
        assert codec.body_kind(closed) == "closed" and closed.closed.freed_kv_tokens == 3
        assert _status(raw.ask(raw.hidden_step("bad-2", 4, 3, 1))) == S.STATUS_SESSION_CLOSED
        assert codec.body_kind(raw.open("bad-3", ticket)) == "open_ack"
        assert (
            codec.body_kind(raw.ask(codec.cancel_frame(raw.header("bad-3"), step_id=2, reason="bye")))
            == "closed"
        )
        assert _status(raw.ask(raw.hidden_step("bad-3", 3, 0, 1))) == S.STATUS_SESSION_CLOSED
        # forged ticket: signed by another key; expired ticket: signed by the real tracker key
        forged_key = nacl.signing.SigningKey.generate()
        hops = tuple(TicketHop(h["node_id"], h["start"], h["end"], h["address"]) for h in swarm.route["hops"])
        fp = swarm.stages[0].info.model.fingerprint
        now = time.time()
        forged = canonical_json(
            sign_route_ticket(forged_key, RouteTicket("x", secrets.token_hex(16), fp, hops, now, now + 300))
        )
        reply = raw.open("bad-4", forged)
        assert _status(reply) == S.STATUS_TICKET_INVALID and reply.error.session_closed
        tracker_key = nacl.signing.SigningKey(
            bytes.fromhex((swarm.workdir / "tracker" / "tracker.key").read_text().strip())
        )
        expired = canonical_json(
            sign_route_ticket(
                tracker_key, RouteTicket("x", secrets.token_hex(16), fp, hops, now - 600, now - 300)
            )
        )
        assert _status(raw.open("bad-5", expired)) == S.STATUS_TICKET_INVALID
        tampered = bytearray(ticket)
        tampered[ticket.index(b'"signature":"') + 14] ^= 1
        assert _status(raw.open("bad-6", bytes(tampered))) == S.STATUS_TICKET_INVALID
        assert _status(raw.open("bad-7", b"not json")) == S.STATUS_TICKET_INVALID
    finally:
        raw.close()

    # the good session carries on, exactly
    try:
        while len(produced) < N_NEW:
            produced.append(good.step([produced[-1]]).token_id)  # type: ignore[union-attr]
        good.release()
    finally:
        good.close()
    assert produced == expected[PROMPTS[2]]


def test_admission_refuses_clearly_when_slots_or_budget_run_out(swarm: Swarm) -> None:
    raw = Raw(swarm.stages[1])
    ticket = swarm.ticket()
    try:
        most = swarm.stages[1].info.limits.max_kv_tokens_per_session  # what one session may grow to
        too_big = raw.ask(
            codec.open_frame(raw.header("big"), step_id=1, route_ticket=ticket, kv_budget_tokens=most + 16)
        )
        assert _status(too_big) == S.STATUS_RESOURCE_EXHAUSTED and "per session" in too_big.error.message
        opened = []
        for i in range(swarm.stages[1].info.limits.max_sessions + 1):
            reply = raw.open(f"slot-{i}", ticket)
            if codec.body_kind(reply) != "open_ack":
                break
            opened.append(f"slot-{i}")
        assert _status(reply) == S.STATUS_RESOURCE_EXHAUSTED and "slots" in reply.error.message
        assert len(opened) == swarm.stages[1].info.limits.max_sessions
        for sid in opened:
            assert codec.body_kind(raw.ask(codec.release_frame(raw.header(sid), step_id=2))) == "closed"
        assert codec.body_kind(raw.open("slot-again", ticket)) == "open_ack"  # freed at once
        raw.ask(codec.release_frame(raw.header("slot-again"), step_id=2))
    finally:
        raw.close()


def test_info_health_vocab_and_status(swarm: Swarm, model_path: Path) -> None:
    b = swarm.stages[1]
    assert b.info.is_last and not swarm.stages[0].info.is_last
    assert (b.start, b.end) == (15, 30) and b.info.model.n_layers == 30 and b.info.model.n_embd == 576
    assert b.info.limits.max_sessions == 6 and b.info.limits.max_kv_tokens_per_session >= 512
    assert b.info.recipe.fingerprint == swarm.stages[0].info.recipe.fingerprint
    with node_channel(b.address, options=GRPC_OPTIONS) as channel:
        stub = shard_service_pb2_grpc.ShardServiceStub(channel)
        health = stub.Health(shard_service_pb2.HealthRequest(), timeout=10)
        assert health.status == shard_service_pb2.SERVING_STATUS_SERVING
        assembler = VocabAssembler(b.info.model.fingerprint)
        data = None
        for chunk in stub.GetVocab(
            shard_service_pb2.VocabRequest(
                model_fingerprint=b.info.model.fingerprint, max_chunk_bytes=512 * 1024
            ),
            timeout=30,
        ):
            data = assembler.add(chunk)
    assert data is not None and data[:4] == b"GGUF"
    # swarm-node status against the admin server
    admin = f"http://127.0.0.1:{swarm.nodes[0].admin_port}"
    done = subprocess.run(
        [sys.executable, "-m", "node.cli", "status", "--admin-url", admin],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f'"node_id": "{swarm.stages[0].info.node_id}"' in done.stdout and '"shard": [' in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "node.cli", "status", "--address", b.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and '"is_last": true' in done.stdout, done.stderr
    status, body = http_json(f"{admin}/healthz")
    assert status == 200 and body["status"] == "serving"
    with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for name in (
        "swarm_node_sessions",
        "swarm_node_queue_depth",
        "swarm_node_kv_tokens_used",
        "swarm_node_tokens_per_second",
        "swarm_node_batch_tokens",
        "swarm_node_refusals_total",
    ):
        assert f"# TYPE {name} " in metrics, name
    # announce once, then signed heartbeats (every second in these tests) accepted by the tracker
    deadline = time.monotonic() + 10
    while (state := http_json(f"{admin}/status")[1])["heartbeats"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state["announces"] == 1 and state["heartbeats"] >= 1 and state["tracker_failures"] == 0
    assert state["tracker_key_known"]
    # the tracker knows both nodes, with their measured speed
    status, state = http_json(f"{swarm.tracker_url}/v1/swarm")
    shards = {n["node_id"]: n["shard"] for n in state["nodes"]}
    assert shards[swarm.stages[0].info.node_id]["decode_ms_per_token"] > 0


def test_layers_auto_takes_the_span_the_tracker_recommends(
    swarm: Swarm, model_path: Path, node_cache: Path
) -> None:
    c = start_node(
        swarm.supervisor,
        "node-c",
        model_path,
        "auto",
        swarm.tracker_url,
        node_cache,
        "--capacity-layers",
        "15",
        "--no-benchmark",
    ).ready(120)
    try:
        info = node_info(f"127.0.0.1:{c.port}")
        start, end = info.shard.start, info.shard.end
        assert 0 <= start < end <= 30 and end - start <= 15
        assert '"auto":true' in c.log_text()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            nodes = {n["node_id"]: n for n in http_json(f"{swarm.tracker_url}/v1/swarm")[1]["nodes"]}
            if info.node_id in nodes:
                break
            time.sleep(0.2)
        shard = nodes[info.node_id]["shard"]
        assert (shard["start"], shard["end"]) == (start, end)
    finally:
        assert c.stop() == 0


def test_sigterm_frees_sessions_and_stops(swarm: Swarm) -> None:
    """Last in the module: stop node A gracefully while it holds a session."""
    session = RouteSession(swarm.stages[:1], swarm.ticket())
    session.step([1, 2, 3], sample=False)
    a = swarm.nodes[0]
    code = a.stop(grace_s=30)
    notice = session.streams[0].recv()  # the node says so before it goes
    session.close()
    assert code == 0, a.log_tail()
    assert notice.error.status == S.STATUS_UNAVAILABLE and notice.error.session_closed
    log = a.log_text()
    assert '"event":"node_stopping"' in log and '"event":"node_stopped"' in log
