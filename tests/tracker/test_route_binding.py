"""Route tickets for registered gateways only (real hypercorn on loopback, port 0, real HTTP).

With gateways registered, ``/v1/routes`` answers only a request signed by one
of them (unsigned: 401, an unregistered key: 403), and every ticket names the
signer under the tracker's signature. With none registered the tracker stays
open: unsigned requests get bearer tickets, signed ones tickets bound to the
signer.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import httpx
import pytest
import trio
from tracker_helpers import MODEL, announce_for, key, test_config

from common.tracker_client import TrackerClient, TrackerClientError
from proto.signing import make_payload, public_key_hex, sign_envelope, verify_route_ticket
from tracker.server import RunningTracker, serve_tracker

GATEWAY = key(40)
STRANGER = key(41)


async def _with_tracker(tmp_path: Path, registered: str, body) -> None:  # type: ignore[no-untyped-def]
    config = test_config(tmp_path, registered_gateways=registered)
    shutdown = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            ready: list[RunningTracker] = []
            await nursery.start(
                functools.partial(serve_tracker, config, shutdown=shutdown, on_ready=ready.append)
            )
            (running,) = ready
            async with (
                TrackerClient(running.url, key(1)) as node1,
                TrackerClient(running.url, key(2)) as node2,
            ):
                await node1.announce(announce_for(key(1), 0, 12, port=9001))
                await node2.announce(announce_for(key(2), 12, 30, port=9002))
            await body(running)
            shutdown.set()


def _ticket_gateway(running: RunningTracker, answer: dict) -> str:
    (route,) = answer["routes"]
    ticket = verify_route_ticket(
        route["ticket"], tracker_public_key=running.registry.tracker_id, now_s=time.time()
    )
    return ticket.gateway_id


async def test_registered_gateways_only_get_tickets_and_the_tickets_name_them(tmp_path: Path) -> None:
    async def body(running: RunningTracker) -> None:
        async with TrackerClient(running.url, GATEWAY) as gw, TrackerClient(running.url, STRANGER) as other:
            answer = await gw.routes(MODEL.fingerprint, k=1, sign=True)
            assert _ticket_gateway(running, answer) == public_key_hex(GATEWAY)
            with pytest.raises(TrackerClientError) as unsigned:
                await gw.routes(MODEL.fingerprint, k=1, gateway_id=public_key_hex(GATEWAY))
            assert unsigned.value.status == 401
            assert unsigned.value.body["error"]["code"] == "gateway_signature_required"
            with pytest.raises(TrackerClientError) as stranger:
                await other.routes(MODEL.fingerprint, k=1, sign=True)
            assert stranger.value.status == 403
        async with httpx.AsyncClient() as http:
            got = await http.get(f"{running.url}/v1/routes", params={"model": MODEL.fingerprint})
            assert got.status_code == 401
            # A signed request is good once: the same bytes again are a replay.
            signed = sign_envelope(
                GATEWAY,
                make_payload(
                    "route_request", "gateway_id", GATEWAY, time.time(), {"model": MODEL.fingerprint, "k": 1}
                ),
            )
            first = await http.post(f"{running.url}/v1/routes", json=signed)
            again = await http.post(f"{running.url}/v1/routes", json=signed)
            assert first.status_code == 200 and again.status_code == 401
            assert again.json()["error"]["reason"] == "replayed_nonce"
            # Fields the request may not carry are refused, signed or not.
            odd = sign_envelope(
                GATEWAY,
                make_payload(
                    "route_request", "gateway_id", GATEWAY, time.time(), {"model": MODEL.fingerprint, "x": 1}
                ),
            )
            assert (await http.post(f"{running.url}/v1/routes", json=odd)).status_code == 400

    await _with_tracker(tmp_path, public_key_hex(GATEWAY), body)


async def test_an_open_tracker_gives_bearer_tickets_to_unsigned_requests(tmp_path: Path) -> None:
    async def body(running: RunningTracker) -> None:
        async with TrackerClient(running.url, STRANGER) as client:
            assert _ticket_gateway(running, await client.routes(MODEL.fingerprint, k=1)) == ""
            signed = await client.routes(MODEL.fingerprint, k=1, sign=True)
            assert _ticket_gateway(running, signed) == public_key_hex(STRANGER)

    await _with_tracker(tmp_path, "", body)
