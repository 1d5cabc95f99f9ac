"""The challenge runner against addresses that do not answer (issue 17): a tarpit is given up on after
``challenge_info_timeout_s``, and the pause before a retry holds no worker, so the next node in the
queue is dialled at once. The gRPC runtime is a stand-in that records who was dialled when."""

from __future__ import annotations

import random
import secrets
from pathlib import Path

import trio
from tracker_helpers import announce_for, key, signed, test_config

from common.grpc_adapter import RpcError
from proto.signing import public_key_hex
from tracker.challenger import Challenger
from tracker.service import Registry
from tracker.store import Store, make_engine

TARPIT, DEAD = 9001, 9002


class NoAnswer:
    """``unary`` on the tarpit port never returns; on the dead port it fails at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.pins: list[str | None] = []

    async def unary(
        self, address: str, method: str, request: bytes, *, max_message_bytes: int = 0, pin: str | None = None
    ) -> bytes:
        self.calls.append((address, trio.current_time()))
        self.pins.append(pin)
        if address.endswith(f":{TARPIT}"):
            await trio.sleep_forever()
        raise RpcError("connection refused", "UNAVAILABLE")


async def test_a_tarpit_waiting_for_its_retry_does_not_hold_the_only_worker(tmp_path: Path) -> None:
    config = test_config(
        tmp_path,
        challenge_nodes=True,
        challenge_concurrency=1,
        challenge_attempts=2,
        challenge_info_timeout_s=0.2,
        heartbeat_timeout_s=60.0,
    )
    store = Store(make_engine(config.resolved_db_url()))
    registry = Registry(store, config, key(99), rng=random.Random(0))
    await registry.start()
    grpc = NoAnswer()
    registry.challenger = Challenger(registry, grpc)  # type: ignore[arg-type]  # the stand-in
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(registry.challenger.run)
                tarpit, dead = key(1), key(2)
                # Each announces a TLS certificate fingerprint, as any node the challenger dials must.
                pins = {TARPIT: secrets.token_hex(32), DEAD: secrets.token_hex(32)}
                for k, port in ((tarpit, TARPIT), (dead, DEAD)):  # the tarpit is first in the queue
                    announce = announce_for(k, port=port, tls_fingerprint=pins[port])
                    answer = await registry.announce(
                        signed(k, "announce", announce.to_json(), registry.clock())
                    )
                    assert answer["state"] == "challenging"
                for _ in range(500):  # both finished: failed (the fail_after above bounds the wait)
                    if registry.challenger.completed >= 2:
                        break
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        dialled = [(a.rsplit(":", 1)[1], t) for a, t in grpc.calls]
        assert [port for port, _ in dialled].count(str(TARPIT)) == 2
        assert all(pin == pins[int(port)] for (port, _), pin in zip(dialled, grpc.pins, strict=True))
        first_dead = next(t for port, t in dialled if port == str(DEAD))
        second_tarpit = [t for port, t in dialled if port == str(TARPIT)][1]
        # The dead node is dialled while the tarpit waits out its pause (1 s) before attempt 2.
        assert first_dead < second_tarpit
        states = {n["node_id"]: n["state"] for n in (await registry.swarm_state())["nodes"]}
        assert states == {
            public_key_hex(tarpit): "challenge_failed",
            public_key_hex(dead): "challenge_failed",
        }
    finally:
        store.close()
