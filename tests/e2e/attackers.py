"""Attackers as a real volunteer could write them: keys made on the spot, signed announcements and
heartbeats of shards they do not hold, and a tarpit (an address that accepts TCP and never answers).

Shared by the attack tests (tests/e2e/test_attacks_*_e2e.py)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import nacl.signing

from proto.announce import Announce, Hardware, Heartbeat, ModelSpec
from proto.signing import make_payload, public_key_hex, sign_envelope

HARDWARE = Hardware(cpu_cores=4, ram_bytes=8 << 30, gpus=(), backends=("cpu",), free_disk_bytes=50 << 30)


def client(source: str = "127.0.0.1", timeout_s: float = 30.0) -> httpx.Client:
    """An HTTP client sending from ``source`` (a loopback address of its own: another host to the tracker)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=timeout_s)


def announce(
    key: nacl.signing.SigningKey,
    model: ModelSpec,
    *,
    address: str | None,
    start: int = 0,
    end: int | None = None,
    tls_fingerprint: str = "",
    relay_via: str | None = None,
) -> dict[str, str]:
    """A signed announce of ``[start, end)`` at ``address`` (None: relayed through ``relay_via``)."""
    a = Announce(
        node_id=public_key_hex(key),
        addresses=(address,) if address else (),
        relay=address is None,
        relay_via=None if address else (relay_via or "ab" * 32),
        hardware=HARDWARE,
        software_version="attacker",
        model=model,
        shard_start=start,
        shard_end=model.n_layers if end is None else end,
        decode_ms_per_token=0.01,  # as attractive as can be
        prefill_tokens_per_s=1e6,
        max_sessions=64,
        tls_fingerprint=tls_fingerprint,
    )
    return sign_envelope(key, make_payload("announce", "node_id", key, time.time(), a.to_json()))


def heartbeat(key: nacl.signing.SigningKey) -> dict[str, str]:
    h = Heartbeat(
        node_id=public_key_hex(key), active_sessions=0, queue_depth=0, kv_free_tokens=4096, tokens_served=0
    )
    return sign_envelope(key, make_payload("heartbeat", "node_id", key, time.time(), h.to_json()))


class KeepAlive:
    """Heartbeats ``keys`` every second from ``source`` until closed, as a real attacker would."""

    def __init__(self, tracker_url: str, keys: list[nacl.signing.SigningKey], source: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(tracker_url, keys, source))
        self._thread.start()

    def _run(self, tracker_url: str, keys: list[nacl.signing.SigningKey], source: str) -> None:
        with client(source) as http:
            while not self._stop.wait(1.0):
                for key in keys:
                    try:
                        http.post(tracker_url + "/v1/heartbeat", json=heartbeat(key))
                    except httpx.HTTPError:
                        pass  # the tracker may be stopping; the attacker keeps trying

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Tarpit:
    """Accepts TCP connections and never answers (holds them until closed)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=False)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.held.append(conn)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()
