"""``swarm-gateway serve`` refuses bad configuration with one clear line and exit status 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gateway.testing import console_script


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--max-sessions", "0"], {}, "max_sessions must be >= 1"),
        (["--tracker", "localhost:7460"], {}, "http://"),
        ([], {"SWARM_GATEWAY_MAX_SESIONS": "3"}, "unknown environment variable SWARM_GATEWAY_MAX_SESIONS"),
    ],
)
def test_bad_configuration_exits_2(tmp_path: Path, args: list[str], env: dict[str, str], needle: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GATEWAY_")}
    done = subprocess.run(
        [*console_script("swarm-gateway"), "serve", "--data-dir", str(tmp_path), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr
