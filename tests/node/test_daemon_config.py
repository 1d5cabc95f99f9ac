"""Node configuration layering, identity files, keygen/id CLI, route-ticket checks, admin rendering."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import nacl.signing
import pytest
import trio

from common.keyfile import KeyFileError, load_key_file
from node.admin import AdminServer
from node.config import ConfigError, NodeConfig, load_config
from node.identity import load_or_create_key, node_id
from node.session_machine import OpenClaim
from node.tickets import TicketVerifier
from proto.errors import TicketInvalidError
from proto.signing import RouteTicket, TicketHop, canonical_json, public_key_hex, sign_route_ticket

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- config


def test_layers_defaults_file_env_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text('[node]\nmax_sessions = 3\nport = 9000\nlayers = "0:10"\n')
    cfg = load_config(
        file=cfg_file,
        env={"SWARM_NODE_PORT": "9001", "SWARM_NODE_BENCHMARK": "false"},
        flags={"port": 9002, "threads": None},
    )
    assert (cfg.max_sessions, cfg.port, cfg.layers, cfg.benchmark, cfg.threads) == (3, 9002, "0:10", False, 0)
    assert load_config(env={}).port == NodeConfig().port
    with pytest.raises(dataclasses_frozen_error()):
        cfg.port = 1  # type: ignore[misc]


def test_kept_session_bounds_reach_the_session_machine_from_the_command_line() -> None:
    from click.testing import CliRunner

    from node.cli import main

    help_text = CliRunner().invoke(main, ["start", "--help"]).output
    for flag in ("--max-kept-sessions", "--max-kept-kv-tokens", "--max-keep-s"):
        assert flag in help_text
    cfg = load_config(env={}, flags={"max_kept_sessions": 0, "max_kept_kv_tokens": 100, "max_keep_s": 5.0})
    assert (cfg.max_kept_sessions, cfg.max_kept_kv_tokens, cfg.max_keep_s) == (0, 100, 5.0)


def test_one_address_may_open_a_stream_per_session_slot_before_its_opens_are_read() -> None:
    # A gateway bursting a request per session opens that many streams within milliseconds; a bound
    # below max_sessions closed the first ones before the node read their OPENs (502s under a burst).
    assert load_config(env={}).resolved_idle_streams_per_address() == 16  # 8 sessions: the floor
    assert load_config(env={}, flags={"max_sessions": 32}).resolved_idle_streams_per_address() == 64
    explicit = load_config(env={}, flags={"max_sessions": 32, "max_idle_streams_per_address": 5})
    assert explicit.resolved_idle_streams_per_address() == 5


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    ("file_text", "env", "message"),
    [
        ("max_sesions = 3\n", {}, "unknown key 'max_sesions'"),
        ("", {"SWARM_NODE_PORTT": "1"}, "unknown environment variable SWARM_NODE_PORTT"),
        ("port = 'x'\n", {}, "port must be a int"),
        ("port = 70000\n", {}, "port must be in 0..65535"),
        ("no_tracker = true\nlayers = '0:5'\n", {}, "no_tracker needs"),
        ("tracker_id = 'abc'\n", {}, "tracker_id must be 64"),
        ("max_kept_sessions = -1\n", {}, "max_kept_sessions, max_kept_kv_tokens and max_keep_s"),
        ("batch_tokens = 32\n", {}, "batch_tokens must be >= 64"),  # an isolated slice is one ubatch
        ("kv_pool_tokens = 100\n", {}, "kv_pool_tokens must be 0 \\(no pool\\), -1 \\(auto\\) or >= 256"),
        ("max_session_kv_tokens = 8\n", {}, "max_session_kv_tokens must be 0"),
        ("max_idle_streams_per_address = -1\n", {}, "max_idle_streams_per_address must be >= 0"),
    ],
)
def test_config_errors(tmp_path: Path, file_text: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(file_text)
    with pytest.raises(ConfigError, match=message):
        load_config(file=path, env=env)


def test_every_field_is_documented() -> None:
    docs = NodeConfig.describe()
    assert all(docs.values()) and "session_kv_tokens" in docs


# --------------------------------------------------------------------------- identity


def test_key_created_once_with_mode_0600(tmp_path: Path) -> None:
    key, created = load_or_create_key(tmp_path / "d")
    assert created
    path = tmp_path / "d" / "node.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created2 = load_or_create_key(tmp_path / "d")
    assert not created2 and node_id(again) == node_id(key) == public_key_hex(key)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_key_file(path)


@pytest.mark.slow  # runs the swarm-node CLI
def test_keygen_and_id_cli(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "node.cli", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )

    missing = run("id", "--data-dir", str(tmp_path))
    assert missing.returncode != 0 and "keygen" in missing.stderr
    made = run("keygen", "--data-dir", str(tmp_path))
    assert made.returncode == 0 and len(made.stdout.strip()) == 64
    shown = run("id", "--data-dir", str(tmp_path))
    assert shown.stdout.strip() == made.stdout.strip()


# --------------------------------------------------------------------------- tickets


def _ticket(
    key: nacl.signing.SigningKey,
    node: str,
    *,
    start: int = 0,
    end: int = 15,
    model: str = "f" * 64,
    expires_in: float = 300.0,
) -> bytes:
    now = time.time()
    hop = TicketHop(node, start, end, "127.0.0.1:1")
    return canonical_json(
        sign_route_ticket(key, RouteTicket("x", "s" * 32, model, (hop,), now, now + expires_in))
    )


NO_PROOF = OpenClaim(route_epoch=1, step_id=1, gateway_proof=b"")


def test_ticket_verifier() -> None:
    tracker = nacl.signing.SigningKey.generate()
    me = "1" * 64
    v = TicketVerifier(node_id=me, model_fingerprint="f" * 64, shard=(0, 15), tracker_public_key=None)
    with pytest.raises(TicketInvalidError, match="does not know its tracker"):
        v(_ticket(tracker, me), "s", NO_PROOF)
    v.trust(public_key_hex(tracker))
    v(_ticket(tracker, me), "s", NO_PROOF)
    cases = {
        "untrusted_key": _ticket(nacl.signing.SigningKey.generate(), me),
        "expired": _ticket(tracker, me, expires_in=-60),
        "not a hop": _ticket(tracker, "2" * 64),
        "another model": _ticket(tracker, me, model="e" * 64),
        "serves": _ticket(tracker, me, start=0, end=10),
        "not a JSON": b"\xff",
    }
    for reason, ticket in cases.items():
        with pytest.raises(TicketInvalidError, match=reason):
            v(ticket, "s", NO_PROOF)
    assert v.accepted == 1 and v.refused == len(cases) + 1
    # trust() never replaces a pinned/learned key
    v.trust("0" * 64)
    assert v.tracker_public_key == public_key_hex(tracker)


# --------------------------------------------------------------------------- admin


async def test_admin_server_routes() -> None:
    server = AdminServer(
        "127.0.0.1",
        0,
        health=lambda: (200, {"status": "serving"}),
        metrics=lambda: "m 1\n",
        status=lambda: {"node_id": "n"},
    )
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)

        async def get(path: str, method: str = "GET") -> tuple[int, bytes]:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(f"{method} {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
            await stream.aclose()
            head, _, body = data.partition(b"\r\n\r\n")
            return int(head.split()[1]), body

        assert await get("/healthz") == (200, b'{"status": "serving"}')
        assert await get("/metrics") == (200, b"m 1\n")
        assert (await get("/status"))[0] == 200
        assert (await get("/nope"))[0] == 404
        assert (await get("/status", "POST"))[0] == 405
        nursery.cancel_scope.cancel()
