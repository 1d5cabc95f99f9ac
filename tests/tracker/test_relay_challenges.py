"""Join challenges of relayed nodes, carried by their gateway (tracker/relay_challenges.py), in process
on a real database: a relayed newcomer waits in ``challenging`` (never routed) until the gateway that
relays it brings back its answer to the tracker's frames; the tracker judges that answer like one it
dialled for (trusted nodes' digests of the same input); only the registered gateway the node named
may carry it, and nobody can report a verdict -- only the node's frames, which the tracker digests.

The node's side is played here with the protocol's own frame builders (proto/codec.py): the answer is
the rows a node would send, and a liar's answer is other rows. Real nodes answering through a real
gateway's relay: tests/e2e/test_attacks_trust_e2e.py."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto import codec
from proto.announce import CheckPass, CheckResults
from proto.errors import TicketInvalidError
from proto.recipe import Recipe
from proto.signing import public_key_hex, route_ticket_envelope, verify_route_ticket
from proto.swarm.v1 import frame_pb2, shard_service_pb2
from tracker.app import create_app
from tracker.challenger import Challenger
from tracker.config import TrackerConfig
from tracker.service import Registry
from tracker.store import Store, make_engine

GW = key(90)  # registered
ROGUE = key(91)  # not registered
GW_ID = public_key_hex(GW)
RECIPE = Recipe("b1234", MODEL.fingerprint, "f16", False, cpu_features="avx2")


@dataclass
class Env:
    registry: Registry
    client: Any
    store: Store
    clock: FakeClock
    config: TrackerConfig

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        r = await self.client.post(
            path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            scope_base={"client": ("127.0.0.1", 40000)},
        )
        return r.status_code, json.loads(await r.get_data())

    async def announce_relayed(self, seed: int, start: int, end: int, via: str = GW_ID) -> None:
        a = replace(announce_for(key(seed), start, end), addresses=(), relay=True, relay_via=via)
        status, body = await self.post(
            "/v1/announce", signed(key(seed), "announce", a.to_json(), self.clock())
        )
        assert status == 200 and body["state"] == "challenging", body

    async def state(self, seed: int) -> str:
        status, body = await self.post_get(f"/v1/trust/nodes/{public_key_hex(key(seed))}")
        assert status == 200
        return str(body["state"])

    async def post_get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        return r.status_code, json.loads(await r.get_data())

    async def poll(self, seeds: list[int], gateway: Any = GW) -> tuple[int, Any]:
        self.clock.advance(0.01)
        nodes = [
            {"node_id": public_key_hex(key(s)), "info": _b64(info(s).SerializeToString())} for s in seeds
        ]
        body = {"gateway_id": public_key_hex(gateway), "nodes": nodes}
        return await self.post(
            "/v1/relay/challenges", signed(gateway, "relay_challenge_poll", body, self.clock(), "gateway_id")
        )

    async def result(self, order: dict[str, Any], replies: list[bytes], *, error: str = "") -> dict[str, Any]:
        self.clock.advance(0.01)
        seed = SEEDS[order["node_id"]]
        body = {
            "node_id": order["node_id"],
            "info": _b64(info(seed).SerializeToString()),
            "input_id": order["input_id"],
            "replies": [_b64(r) for r in replies],
            "error": error,
        }
        status, answer = await self.post(
            "/v1/relay/challenge-results",
            signed(GW, "relay_challenge_result", body, self.clock(), "gateway_id"),
        )
        assert status == 200, answer
        return dict(answer)

    async def routed(self) -> set[str]:
        self.clock.advance(0.01)
        request = signed(
            GW, "route_request", {"model": MODEL.fingerprint, "k": 4}, self.clock(), "gateway_id"
        )
        status, body = await self.post("/v1/routes", request)
        assert status in (200, 503)
        return {h["node_id"] for r in body.get("routes", []) for h in r["hops"]}


SPANS = {1: (0, 15), 2: (0, 15), 3: (15, 30), 4: (0, 15)}
SEEDS = {public_key_hex(key(s)): s for s in SPANS}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def info(seed: int) -> shard_service_pb2.NodeInfo:
    start, end = SPANS[seed]
    out = shard_service_pb2.NodeInfo(node_id=public_key_hex(key(seed)))
    out.model.fingerprint = MODEL.fingerprint
    out.model.n_embd = MODEL.n_embd
    out.model.n_vocab = 49152
    out.shard.start, out.shard.end = start, end
    out.recipe.CopyFrom(RECIPE.to_wire())
    return out


def answer(order: dict[str, Any], rows: np.ndarray | None, token: int = 0) -> list[bytes]:
    """What a node sends back for ``order``'s frames: its OPEN acknowledgement, then ``rows`` (a last
    stage: the sampled ``token``)."""
    frames = [frame_pb2.Frame.FromString(base64.b64decode(f)) for f in order["frames"]]
    step = codec.reassemble(frames[1:])
    n = step.end - step.start
    ack = codec.open_ack_frame(
        frames[0],
        kv_len=0,
        node_id=order["node_id"],
        kv_tokens_granted=n + 1,
        max_frame_bytes=1 << 24,
        max_step_tokens=512,
    )
    if rows is None:
        sampled = frame_pb2.SampledToken(token_id=token, logprob=-0.5)
        sampled.top_logprobs.add(token_id=token, logprob=-0.5)
        result = codec.result_frames(step, kv_len=n, sampled=[sampled])
    else:
        result = codec.result_frames(step, kv_len=n, hidden=rows, digest=codec.output_digest(rows))
    return [codec.serialize_frame(ack), *(codec.serialize_frame(f) for f in result)]


def rows_of(order: dict[str, Any], seed: int) -> np.ndarray:
    step = codec.reassemble([frame_pb2.Frame.FromString(base64.b64decode(f)) for f in order["frames"][1:]])
    n = step.end - step.start
    return np.random.default_rng(seed).standard_normal((n, MODEL.n_embd), dtype=np.float32)


@pytest.fixture
async def env(tmp_path: Path, db_url: str) -> AsyncIterator[Env]:
    clock = FakeClock()
    config = test_config(
        tmp_path, db_url=db_url, registered_gateways=GW_ID, probation_checks=1, challenge_nodes=True
    )
    store = Store(make_engine(db_url))
    try:
        registry = Registry(store, config, key(99), clock=clock, rng=random.Random(0))
        await registry.start()
        registry.challenger = Challenger(registry, None, clock=clock)  # type: ignore[arg-type]  # no dialling here
        yield Env(registry, create_app(registry).test_client(), store, clock, config)
    finally:
        store.close()


async def test_a_relayed_newcomer_is_routed_only_after_its_gateway_carried_its_challenge(env: Env) -> None:
    await env.announce_relayed(1, 0, 15)
    await env.announce_relayed(3, 15, 30)
    assert await env.routed() == set()  # challenging: not routed
    # The tracker's own runner cannot dial it and leaves it waiting for its gateway.
    assert env.registry.challenger is not None
    waiting = await env.registry.challenger.challenge(public_key_hex(key(1)))
    assert waiting is not None and waiting.outcome == "relayed" and not waiting.routable
    assert await env.state(1) == "challenging"

    # Only a registered gateway carries challenges.
    status, body = await env.poll([1, 3], gateway=ROGUE)
    assert status == 403, body
    status, body = await env.poll([1, 3])
    assert status == 200
    orders = {o["node_id"]: o for o in body["orders"]}
    assert set(orders) == {public_key_hex(key(1)), public_key_hex(key(3))}
    order = orders[public_key_hex(key(1))]
    # The frames are the tracker's: an OPEN under a ticket the tracker signed for a one-hop route
    # to the node through this gateway's relay, and the PREFILL of the span's secret input.
    opening = frame_pb2.Frame.FromString(base64.b64decode(order["frames"][0]))
    assert opening.WhichOneof("body") == "open" and opening.open.isolated
    ticket = verify_route_ticket(
        route_ticket_envelope(opening.open.route_ticket),
        tracker_public_key=public_key_hex(key(99)),
        now_s=env.clock(),
        node_id=public_key_hex(key(1)),
    )
    assert [h.address for h in ticket.hops] == [f"relay:{GW_ID}"], ticket

    # No answer (the node dropped its socket): still challenging, not routed.
    missed = await env.result(order, [], error="the relay socket closed")
    assert missed["outcome"] == "unanswered" and await env.state(1) == "challenging"
    # A refusal the node may get over (it has not learnt the tracker's key yet): asked again later.
    opening_frame = frame_pb2.Frame.FromString(base64.b64decode(order["frames"][0]))
    refused = codec.error_frame(TicketInvalidError("unknown tracker key"), opening_frame)
    later = await env.result(order, [codec.serialize_frame(refused)])
    assert later["outcome"] == "unanswered" and await env.state(1) == "challenging", later
    # An answer with no trusted answer to compare: in, on probation.
    honest = rows_of(order, 7)
    first = await env.result(order, answer(order, honest))
    assert first["outcome"] == "no_reference" and first["routable"], first
    assert await env.state(1) == "live"
    assert await env.routed() == set()  # the second half still waits
    last = orders[public_key_hex(key(3))]
    assert (await env.result(last, answer(last, None, token=42)))["outcome"] == "no_reference"
    assert await env.routed() == {public_key_hex(key(1)), public_key_hex(key(3))}

    # It earns trust; its answer becomes the reference for the span.
    env.clock.advance(0.01)
    checks = CheckResults(GW_ID, (CheckPass(public_key_hex(key(1)), 1),)).to_json()
    status, _ = await env.post("/v1/checks", signed(GW, "check_results", checks, env.clock(), "gateway_id"))
    assert status == 200

    # A second relayed newcomer on the span: the same rows pass, other rows (a liar) fail and are
    # never routed.
    await env.announce_relayed(2, 0, 15)
    await env.announce_relayed(4, 0, 15)
    status, body = await env.poll([2, 4])
    orders = {o["node_id"]: o for o in body["orders"]}
    good, bad = orders[public_key_hex(key(2))], orders[public_key_hex(key(4))]
    assert good["input_id"] == order["input_id"]  # the same input for every node of a span
    passed = await env.result(good, answer(good, honest))
    assert passed["outcome"] == "passed" and passed["routable"], passed
    failed = await env.result(bad, answer(bad, rows_of(bad, 8)))
    assert failed["outcome"] == "mismatch" and not failed["routable"], failed
    assert await env.state(4) == "challenge_failed"
    routed = await env.routed()
    assert public_key_hex(key(2)) in routed and public_key_hex(key(4)) not in routed


async def test_only_the_gateway_the_node_named_carries_its_challenge_and_answers_are_checked(
    env: Env,
) -> None:
    await env.announce_relayed(1, 0, 15, via="cd" * 32)  # relayed through another gateway
    status, body = await env.poll([1])
    assert status == 200 and body["orders"] == []
    await env.announce_relayed(2, 0, 15)
    status, body = await env.poll([2])
    (order,) = body["orders"]
    # Rows whose digest is not the one the node claims: refused, the node stays out.
    rows = rows_of(order, 7)
    replies = answer(order, rows)
    last = frame_pb2.Frame.FromString(replies[-1])
    last.result.output_digest = b"\0" * len(last.result.output_digest)
    out = await env.result(order, [*replies[:-1], last.SerializeToString()])
    assert out["outcome"] == "failed" and not out["routable"], out
    assert "digest" in out["detail"], out
    assert await env.state(2) == "challenge_failed"
    assert await env.routed() == set()
