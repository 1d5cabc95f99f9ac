"""Real hypercorn on loopback, port 0, driven by common.tracker_client over real HTTP."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from tracker_helpers import MODEL, announce_for, heartbeat_for, key, test_config

from common.tracker_client import TrackerClient, TrackerClientError
from proto.announce import UsageEntry, UsageReport
from proto.signing import public_key_hex, verify_route_ticket
from tracker.server import RunningTracker, serve_tracker

ROOT = Path(__file__).resolve().parents[2]


async def test_announce_heartbeat_routes_expiry_over_http(tmp_path: Path, db_url: str) -> None:
    config = test_config(
        tmp_path,
        db_url=db_url,
        heartbeat_timeout_s=1.0,
        heartbeat_interval_s=0.25,
        expiry_check_interval_s=0.05,
        port_file=str(tmp_path / "port"),
    )
    shutdown = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            ready: list[RunningTracker] = []
            port = await nursery.start(
                functools.partial(serve_tracker, config, shutdown=shutdown, on_ready=ready.append)
            )
            (running,) = ready
            assert port == running.port > 0 and running.url == f"http://127.0.0.1:{port}"
            assert (tmp_path / "port").read_text().strip() == str(running.port)
            k1, k2 = key(1), key(2)
            async with TrackerClient(running.url, k1) as c1, TrackerClient(running.url, k2) as c2:
                assert (await c1.healthz())["status"] == "ok"
                with pytest.raises(TrackerClientError) as info:
                    await c1.heartbeat(heartbeat_for(k1))
                assert info.value.status == 404
                assert (await c1.announce(announce_for(k1, 0, 12, port=9001)))["created"] is True
                assert await c2.recommend(MODEL.fingerprint, 20) == (12, 30)
                await c2.announce(announce_for(k2, 12, 30, port=9002))
                body = await c1.routes(MODEL.name, k=1)
                (route,) = body["routes"]
                assert [h["address"] for h in route["hops"]] == ["127.0.0.1:9001", "127.0.0.1:9002"]
                verify_route_ticket(
                    route["ticket"],
                    tracker_public_key=running.registry.tracker_id,
                    now_s=time.time(),
                    node_id=public_key_hex(k2),
                )
                # Node 2 keeps beating, node 1 falls silent and expires; the route disappears.
                with trio.move_on_after(2.0):
                    while True:
                        await c2.heartbeat(heartbeat_for(k2, active=1))
                        body = await c1.routes(MODEL.fingerprint)
                        if not body["routes"]:
                            break
                        await trio.sleep(0.2)
                assert body["routes"] == [] and body["uncovered"] == [[0, 12]]
                # Routing drops a silent node at once; the expiry loop marks it expired within its interval.
                with trio.move_on_after(2.0):
                    while True:
                        await c2.heartbeat(heartbeat_for(k2, active=1))
                        nodes = {n["node_id"]: n["state"] for n in (await c1.swarm())["nodes"]}
                        if nodes[public_key_hex(k1)] == "expired":
                            break
                        await trio.sleep(0.05)
                assert nodes == {public_key_hex(k1): "expired", public_key_hex(k2): "live"}
                # Heartbeat again: restored, routable again.
                assert (await c1.heartbeat(heartbeat_for(k1)))["restored"] is True
                assert len((await c1.routes(MODEL.fingerprint))["routes"]) == 1
                # A gateway reports usage with its own key.
                report = UsageReport(
                    gateway_id=public_key_hex(key(40)),
                    request_id="r-1",
                    model_fingerprint=MODEL.fingerprint,
                    entries=(UsageEntry(public_key_hex(k1), 10, 8),),
                )
                async with TrackerClient(running.url, key(40)) as gw:
                    assert await gw.report_usage(report) == {"recorded": 1, "duplicates": 0}
                # A body over the limit is refused by the real server too.
                raw = httpx.AsyncClient(base_url=running.url)
                async with raw:
                    r = await raw.post(
                        "/v1/announce",
                        content=b"[" + b"0," * 40_000 + b"0]",
                        headers={"content-type": "application/json"},
                    )
                    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
            shutdown.set()


@pytest.mark.slow  # runs swarm-tracker serve
def test_cli_serve_port_zero_writes_port_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_TRACKER_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tracker.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
            "--port-file",
            str(port_file),
            "--no-zeroconf",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert port_file.exists(), proc.stderr.read() if proc.poll() is not None else "no port file"
        port = int(port_file.read_text())
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["status"] == "ok"
        assert (tmp_path / "data" / "tracker.key").stat().st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert f'"event":"tracker_listening","port":{port}' in err
        assert '"event":"tracker_stopped"' in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
