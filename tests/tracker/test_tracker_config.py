"""Config layering: defaults < file < environment < flags; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tracker.cli import main
from tracker.config import ConfigError, TrackerConfig, load_config


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "tracker.toml"
    f.write_text('port = 7000\nheartbeat_timeout_s = 40\nhost = "10.0.0.1"\nzeroconf = false\n')
    env = {"SWARM_TRACKER_PORT": "7100", "SWARM_TRACKER_HEARTBEAT_TIMEOUT_S": "50", "OTHER": "x"}
    cfg = load_config(file=f, env=env, flags={"port": 7200, "host": None})
    assert cfg.port == 7200  # flag beats env beats file
    assert cfg.heartbeat_timeout_s == 50.0  # env beats file
    assert cfg.host == "10.0.0.1"  # file beats default; a None flag means "not given"
    assert cfg.zeroconf is False
    assert load_config(env={}) == TrackerConfig()
    tbl = tmp_path / "t2.toml"
    tbl.write_text("[tracker]\nport = 1234\n")
    assert load_config(file=tbl, env={}).port == 1234
    assert load_config(env={"SWARM_TRACKER_CONFIG": str(tbl)}).port == 1234


@pytest.mark.parametrize(
    "file_text, env, flags, match",
    [
        ("prot = 1\n", {}, {}, "unknown key 'prot'"),
        ("", {"SWARM_TRACKER_PROT": "1"}, {}, "unknown environment variable SWARM_TRACKER_PROT"),
        ("port = 'x'\n", {}, {}, "port must be a int"),
        ("", {"SWARM_TRACKER_ZEROCONF": "maybe"}, {}, "zeroconf must be a bool"),
        ("", {}, {"port": 70000}, "port must be in"),
        ("", {}, {"heartbeat_timeout_s": 1.0, "heartbeat_interval_s": 5.0}, "at least heartbeat_interval_s"),
    ],
)
def test_errors(
    tmp_path: Path, file_text: str, env: dict[str, str], flags: dict[str, object], match: str
) -> None:
    f = tmp_path / "c.toml"
    f.write_text(file_text)
    with pytest.raises(ConfigError, match=match):
        load_config(file=f, env=env, flags=flags)


def test_resolved_defaults(tmp_path: Path) -> None:
    cfg = load_config(env={}, flags={"data_dir": str(tmp_path)})
    assert cfg.resolved_db_url() == f"sqlite:///{tmp_path / 'tracker.sqlite3'}"
    assert cfg.resolved_db_threads() == 1
    assert load_config(env={}, flags={"db_url": "postgresql+psycopg://x/y"}).resolved_db_threads() == 4


def test_keygen_and_id(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["id", "--data-dir", str(tmp_path / "k")], env={})
    assert missing.exit_code == 1
    made = runner.invoke(main, ["keygen", "--data-dir", str(tmp_path / "k")], env={})
    assert made.exit_code == 0 and len(made.output.strip()) == 64
    again = runner.invoke(main, ["id", "--data-dir", str(tmp_path / "k")], env={})
    assert again.output == made.output
    assert (tmp_path / "k" / "tracker.key").stat().st_mode & 0o777 == 0o600
    (tmp_path / "k" / "tracker.key").chmod(0o644)
    loose = runner.invoke(main, ["id", "--data-dir", str(tmp_path / "k")], env={})
    assert loose.exit_code != 0 and "chmod 600" in loose.output
    bad = runner.invoke(main, ["serve", "--port", "99999"], env={})
    assert bad.exit_code == 2 and "port must be in" in bad.output
