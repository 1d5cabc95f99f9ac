"""Pure modules import no event loop, no grpc, no web framework."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = [
    "gateway.protocol",
    "gateway.textstream",
    "gateway.admission",
    "gateway.errors",
    "gateway.metrics",
    "gateway.config",
    "gateway.chat_template",
]
FORBIDDEN = ["trio", "grpc", "quart", "quart_trio", "hypercorn", "httpx", "llama_cpp"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports(module: str) -> None:
    code = (
        f"import sys, {module}; bad = [m for m in {FORBIDDEN!r} if m in sys.modules]; "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{module} pulls in {result.stdout.strip()} {result.stderr[-500:]}"


def test_no_gateway_module_imports_grpc() -> None:
    """grpcio is reached only through common.grpc_adapter."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "gateway"
    users = sorted(p.name for p in root.glob("*.py") if "import grpc" in p.read_text())
    assert users == []
