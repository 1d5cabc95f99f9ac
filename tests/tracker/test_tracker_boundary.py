"""The functional core imports no event loop, database, web framework or zeroconf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE = [
    "tracker.routing",
    "tracker.placement",
    "tracker.snapshot",
    "tracker.errors",
    "tracker.metrics",
    "proto.signing",
    "proto.announce",
]
FORBIDDEN = [
    "trio",
    "sqlalchemy",
    "quart",
    "quart_trio",
    "hypercorn",
    "zeroconf",
    "httpx",
    "alembic",
    "anyio",
]


def test_pure_modules_import_no_runtime() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE)
        + f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
