"""Where the pins travel: announcements, route answers, OPEN's push targets, and who pushes to whom."""

from __future__ import annotations

import pytest
import trio

from gateway.errors import UpstreamFailed
from gateway.routes import parse_routes
from gateway.session_machine import RouteConfig, RouteMachine, SendFrame, StageSpec
from node.push import PushLinks
from proto import codec
from proto.announce import Announce, PayloadError
from proto.errors import BadFrameError
from proto.swarm.v1 import frame_pb2

MODEL_FP, RECIPE_FP = "ab" * 32, "cd" * 32
PIN_A, PIN_B, PIN_C = "1a" * 32, "2b" * 32, "3c" * 32


def _opens(pins: list[str]) -> list[frame_pb2.OpenSession]:
    config = RouteConfig("s", "r", MODEL_FP, codec.SamplingSettings(temperature=0.0), 16, 4, 1 << 20)
    stages = [
        StageSpec(f"n{i}", f"127.0.0.1:{7000 + i}", 10 * i, 10 * i + 10, RECIPE_FP, b"t", tls_fingerprint=pin)
        for i, pin in enumerate(pins)
    ]
    machine = RouteMachine(config, stages, new_token=lambda: b"tok")
    sends = [c for c in machine.open(0.0) if isinstance(c, SendFrame)]
    return [c.frame.open for c in sorted(sends, key=lambda c: c.slot)]


def test_tls_stages_push_to_each_other_pinned() -> None:
    first, middle, last = _opens([PIN_A, PIN_B, PIN_C])
    assert (first.downstream.address, first.downstream.tls_fingerprint) == ("127.0.0.1:7001", PIN_B)
    assert (middle.downstream.address, middle.downstream.tls_fingerprint) == ("127.0.0.1:7002", PIN_C)
    assert (last.ring.address, last.ring.tls_fingerprint) == ("127.0.0.1:7000", PIN_A)


def test_plaintext_stages_push_to_each_other_and_mixed_hops_go_through_the_gateway() -> None:
    first, last = _opens(["", ""])
    assert first.downstream.address == "127.0.0.1:7001" and not first.downstream.tls_fingerprint
    first, middle, last = _opens([PIN_A, "", PIN_C])
    assert first.downstream.address == ""  # TLS -> plaintext: through the gateway
    assert middle.downstream.address == ""  # plaintext -> TLS: through the gateway
    assert (last.ring.address, last.ring.tls_fingerprint) == ("127.0.0.1:7000", PIN_A)


def test_push_targets_carry_a_well_formed_pin_or_none() -> None:
    header = codec.SessionHeader("s", 1, MODEL_FP, RECIPE_FP, 0, 10)
    frame = codec.open_frame(header, step_id=1, route_ticket=b"{}", kv_budget_tokens=8)
    frame.open.downstream.CopyFrom(codec.push_target("n1", "h:1", b"t", (10, 20), RECIPE_FP, "XYZ"))
    with pytest.raises(BadFrameError, match="tls_fingerprint"):
        codec.validate_frame(frame)
    frame.open.downstream.tls_fingerprint = PIN_B
    codec.validate_frame(frame)


def _route_answer(pin: object) -> dict:
    hop = {"node_id": "n0", "start": 0, "end": 30, "address": "h:1", "tls_fingerprint": pin}
    route = {"hops": [hop], "ticket": {"payload": "x"}, "expires_at": 1e10, "expected_ms_per_token": 1.0}
    return {"model": {"fingerprint": MODEL_FP, "name": "m", "n_layers": 30}, "routes": [route]}


def test_route_answers_give_each_hop_its_pin() -> None:
    assert parse_routes(_route_answer(PIN_A), 0.0).routes[0].hops[0].tls_fingerprint == PIN_A
    assert parse_routes(_route_answer(None), 0.0).routes[0].hops[0].tls_fingerprint == ""
    with pytest.raises(UpstreamFailed):
        parse_routes(_route_answer("not-a-pin"), 0.0)


def test_announcements_carry_the_pin() -> None:
    body = {
        "node_id": "ee" * 32,
        "addresses": ["10.0.0.1:7470"],
        "relay": False,
        "relay_via": None,
        "hardware": {"cpu_cores": 1, "ram_bytes": 1, "gpus": [], "backends": ["cpu"], "free_disk_bytes": 1},
        "software_version": "t",
        "model": {"fingerprint": MODEL_FP, "name": "m", "architecture": "llama", "n_layers": 30, "n_embd": 8},
        "shard_start": 0,
        "shard_end": 30,
        "decode_ms_per_token": 1.0,
        "prefill_tokens_per_s": 1.0,
        "max_sessions": 1,
    }
    assert Announce.from_json(body).tls_fingerprint == ""
    announced = Announce.from_json({**body, "tls_fingerprint": PIN_A})
    assert announced.tls_fingerprint == PIN_A and announced.to_json()["tls_fingerprint"] == PIN_A
    with pytest.raises(PayloadError, match="tls_fingerprint"):
        Announce.from_json({**body, "tls_fingerprint": PIN_A.upper()})


async def test_a_tls_node_never_pushes_in_plaintext() -> None:
    failures: list[str] = []
    failed = trio.Event()
    opened: list[tuple[str, str | None]] = []

    def on_failure(session_id: str, message: str, epoch: int | None) -> None:
        failures.append(message)
        failed.set()

    def opener(address: str, *, pin: str | None):  # type: ignore[no-untyped-def]
        opened.append((address, pin))
        raise AssertionError("never dialled")

    links = PushLinks(opener, on_failure)
    async with trio.open_nursery() as nursery:
        await nursery.start(links.run)
        links.push("s", codec.push_target("n1", "h:1", b"t", (10, 20), RECIPE_FP), [b"frame"])
        with trio.fail_after(5):
            await failed.wait()
        nursery.cancel_scope.cancel()
    assert opened == [] and "only over TLS" in failures[0]
