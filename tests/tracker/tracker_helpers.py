"""Builders shared by the tracker's in-process and HTTP tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import nacl.signing

from proto.announce import Announce, Hardware, Heartbeat, ModelSpec
from proto.signing import make_payload, public_key_hex, sign_envelope
from tracker.config import TrackerConfig

MODEL = ModelSpec(
    fingerprint="ab" * 32, name="smollm2-135m-q4_1", architecture="llama", n_layers=30, n_embd=576
)
HARDWARE = Hardware(cpu_cores=4, ram_bytes=8 << 30, gpus=(), backends=("cpu",), free_disk_bytes=50 << 30)


class FakeClock:
    def __init__(self, now_s: float = 1_800_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


def key(seed: int) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(bytes([seed]) * 32)


def announce_for(
    k: nacl.signing.SigningKey,
    start: int = 0,
    end: int = 30,
    *,
    port: int = 9000,
    ms: float = 10.0,
    model: ModelSpec = MODEL,
    max_sessions: int = 4,
    tls_fingerprint: str = "",
) -> Announce:
    return Announce(
        node_id=public_key_hex(k),
        addresses=(f"127.0.0.1:{port}",),
        relay=False,
        relay_via=None,
        hardware=HARDWARE,
        software_version="0.1.0",
        model=model,
        shard_start=start,
        shard_end=end,
        decode_ms_per_token=ms,
        prefill_tokens_per_s=200.0,
        max_sessions=max_sessions,
        tls_fingerprint=tls_fingerprint,
    )


def heartbeat_for(k: nacl.signing.SigningKey, active: int = 0, tokens: int = 0) -> Heartbeat:
    return Heartbeat(
        node_id=public_key_hex(k),
        active_sessions=active,
        queue_depth=0,
        kv_free_tokens=4096,
        tokens_served=tokens,
    )


def signed(k: nacl.signing.SigningKey, kind: str, body: dict, now_s: float, signer: str = "node_id") -> dict:
    return sign_envelope(k, make_payload(kind, signer, k, now_s, body))


def test_config(tmp_path: Path, **overrides: object) -> TrackerConfig:
    base = TrackerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "data"),
        db_url=f"sqlite:///{tmp_path / 'tracker.sqlite3'}",
        zeroconf=False,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=3.0,
        expiry_check_interval_s=0.1,
        snapshot_ttl_s=0.0,
        # The trust machinery has tests of its own (test_tracker_trust.py): elsewhere nodes are
        # trusted at once and fake nodes (no gRPC server behind their addresses) are not challenged.
        probation_checks=0,
        challenge_nodes=False,
    )
    return replace(base, **overrides).validate()  # type: ignore[arg-type]


test_config.__test__ = False  # type: ignore[attr-defined]  # a builder, not a test
