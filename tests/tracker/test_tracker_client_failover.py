"""common/tracker_client.py: one call tries every replica once, even while concurrent calls fail over.

The transport is scripted (in-process): replica B refuses connections, and the first call's refusal
is held until a second call has failed over to A. The first call must then go on to A, not back
to B (CI once saw a gateway refuse requests this way right after a tracker replica died)."""

from __future__ import annotations

import httpx
import nacl.signing
import trio

from common.tracker_client import TrackerClient

A, B = "http://127.0.0.1:1", "http://127.0.0.2:1"


class Replicas(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.release_first_refusal = trio.Event()
        self.refusals = 0
        self.seen: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        self.seen.append(host)
        if host == B:
            self.refusals += 1
            if self.refusals == 1:
                await self.release_first_refusal.wait()
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"status": "ok", "tracker_id": "t"})


async def test_a_call_goes_on_to_the_other_replica_while_another_call_fails_over() -> None:
    transport = Replicas()
    client = TrackerClient(f"{B},{A}", nacl.signing.SigningKey(b"\x01" * 32), transport=transport)
    answers: list[dict] = []

    async def call() -> None:
        answers.append(await client.healthz())

    async with client, trio.open_nursery() as nursery:
        nursery.start_soon(call)  # held at B
        await trio.testing.wait_all_tasks_blocked()
        await call()  # B refuses at once: fails over to A
        assert client.url == A and client.failovers == 1
        transport.release_first_refusal.set()
    assert len(answers) == 2
    assert transport.seen == [B, B, A, A]  # the first call: B, then A (not B twice)
