"""The gateway's trust reporter against a real tracker over loopback HTTP: spot checks credited,
verdicts filed (a conclusive one bans the liar), refusals dropped, outages retried; measured speeds.

The service here is a stand-in holding exactly what the reporter reads from ``GatewayService``
(``gateway_id``, ``metrics``, and ``standing``: a real ``NodeStanding`` holding the queued verdicts and
checks passed): the reporter's whole input."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nacl.signing
import pytest
import trio

from common.tracker_client import TrackerClient
from gateway.metrics import Metrics
from gateway.node_standing import NodeStanding
from gateway.trust_report import ObservedSpeed, report_trust_once
from proto.announce import Announce, Hardware, ModelSpec
from proto.signing import public_key_hex
from tracker.config import TrackerConfig
from tracker.server import RunningTracker, serve_tracker

MODEL = ModelSpec(fingerprint="cd" * 32, name="m", architecture="llama", n_layers=30, n_embd=576)
HARDWARE = Hardware(cpu_cores=2, ram_bytes=1 << 30, gpus=(), backends=("cpu",), free_disk_bytes=1 << 30)
GW = nacl.signing.SigningKey(b"\x07" * 32)


def node_key(i: int) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(bytes([40 + i]) * 32)


def nid(i: int) -> str:
    return public_key_hex(node_key(i))


@dataclass
class Service:
    gateway_id: str
    metrics: Metrics = field(default_factory=Metrics)
    standing: NodeStanding = field(default_factory=NodeStanding)


def service_with(checks_passed: dict[str, int], evidence: list[dict[str, Any]]) -> Service:
    service = Service(public_key_hex(GW))
    for node, checks in checks_passed.items():
        service.standing.credit(node, checks)
    for item in evidence:
        service.standing.add_evidence(item)
    return service


def verdict(liar: int, honest: int, judge: int) -> dict[str, Any]:
    """A verdict as ``gateway.checks.evidence`` builds it (last stage: sampled tokens differ)."""

    def report(node: int, token: int) -> dict[str, Any]:
        return {
            "node_id": nid(node),
            "epoch": 1,
            "step_id": 14,
            "digest": "",
            "token_id": token,
            "logprob": -0.25,
            "top_logprobs": [[token, -0.25], [9, -2.5]],
        }

    return {
        "gateway_id": public_key_hex(GW),
        "request_id": "chatcmpl-1",
        "liar": nid(liar),
        "conclusive": True,
        "stage": 1,
        "positions": [12, 13],
        "reports": {"primary": report(liar, 8), "shadow": report(honest, 7)},
        "judge": report(judge, 7),
        "detail": "outvoted by the judge",
        "time": 1.0,
    }


async def start_tracker(nursery: trio.Nursery, tmp_path: Path, **over: Any) -> RunningTracker:
    config = TrackerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "tracker"),
        zeroconf=False,
        dashboard=False,
        challenge_nodes=False,
        probation_checks=2,
        **over,
    ).validate()
    ready: list[RunningTracker] = []
    await nursery.start(
        lambda task_status: serve_tracker(config, on_ready=ready.append, task_status=task_status)
    )
    return ready[0]


async def announce(url: str, i: int) -> None:
    async with TrackerClient(url, node_key(i)) as client:
        await client.announce(
            Announce(nid(i), (f"127.0.0.{i}:9000",), False, None, HARDWARE, "t", MODEL, 0, 30, 10.0, 100.0, 4)
        )


async def test_checks_and_verdicts_reach_the_tracker(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        tracker = await start_tracker(nursery, tmp_path, registered_gateways=public_key_hex(GW))
        for i in (1, 2, 3):
            await announce(tracker.url, i)
        service = service_with({nid(2): 2, nid(3): 1}, [verdict(1, 2, 3)])
        async with TrackerClient(tracker.url, GW) as client:
            sent = await report_trust_once(service, client, timeout_s=10)
            assert sent == {"checks": 2, "evidence": 1}
            assert service.standing.evidence == [] and service.standing.checks_passed == {}
            trust = {i: await client.node_trust(nid(i)) for i in (1, 2, 3)}
            assert trust[1]["state"] == "banned" and trust[1]["banned_until"] is not None
            assert (trust[2]["checks_passed"], trust[2]["probation"]) == (2, False)
            assert (trust[3]["checks_passed"], trust[3]["probation"]) == (1, True)
            routes = await client.routes(MODEL.fingerprint, k=3, sign=True)
            assert {h["node_id"]: h["probation"] for r in routes["routes"] for h in r["hops"]} == {
                nid(2): False,
                nid(3): True,
            }
        nursery.cancel_scope.cancel()


async def test_refused_reports_are_dropped_and_an_outage_keeps_them(tmp_path: Path) -> None:
    other = nacl.signing.SigningKey(b"\x08" * 32)
    async with trio.open_nursery() as nursery:
        tracker = await start_tracker(nursery, tmp_path, registered_gateways=public_key_hex(other))
        await announce(tracker.url, 1)
        service = service_with({nid(1): 3}, [verdict(1, 2, 3)])
        async with TrackerClient(tracker.url, GW) as client:  # not the registered gateway
            assert await report_trust_once(service, client, timeout_s=10) == {"checks": 0, "evidence": 0}
        assert service.standing.evidence == [] and service.standing.checks_passed == {}
        refused = service.metrics.total("swarm_gateway_trust_reports_total", outcome="refused")
        assert refused == 2
        nursery.cancel_scope.cancel()
    # the tracker is gone: everything stays queued for the next round
    service = service_with({nid(1): 3}, [verdict(1, 2, 3)])
    async with TrackerClient(tracker.url, GW) as client:
        with pytest.raises(Exception):  # noqa: B017  (a transport error of httpx)
            await report_trust_once(service, client, timeout_s=5)
    assert len(service.standing.evidence) == 1 and service.standing.checks_passed == {nid(1): 3}


@dataclass(frozen=True)
class _Stage:  # what ObservedSpeed reads of gateway.session_machine.StageSpec
    node_id: str
    start: int
    end: int


@dataclass(frozen=True)
class _Stats:
    ewma_step_s: float


@dataclass
class _Machine:
    stages: list[_Stage]
    step_s: float

    def statistics(self) -> _Stats:
        return _Stats(self.step_s)


@dataclass
class _Session:
    machine: _Machine


def test_measured_decode_time_is_shared_by_layers_and_averaged_per_node() -> None:
    observed = ObservedSpeed()
    route = [_Stage("a", 0, 10), _Stage("b", 10, 30)]
    observed.record(_Session(_Machine(route, 0.030)), "m")  # 30 ms per token: a 10 ms, b 20 ms
    observed.record(_Session(_Machine(route, 0.060)), "m")
    observed.record(_Session(_Machine(route, math.nan)), "m")  # no decode step measured: ignored

    @dataclass
    class _Checked:  # a checked run holds its sessions in ``runs``
        runs: dict[str, _Session]

    observed.record(_Checked({"shadow": _Session(_Machine([_Stage("c", 0, 30)], 0.012))}), "m")
    speeds = {s.node_id: (round(s.decode_ms_per_token, 6), s.samples) for s in observed.drain()}
    assert speeds == {"a": (15.0, 2), "b": (30.0, 2), "c": (12.0, 1)}
    assert observed.drain() == ()
