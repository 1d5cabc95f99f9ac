"""The committed generated code is what ``python -m proto.generate`` produces, and it imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proto import generate


@pytest.mark.slow  # runs the protobuf compiler
def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate.generate(out_dir=tmp_path)
    committed = generate.generated_files(generate.REPO_ROOT)
    assert fresh == committed, "generated file set differs: run `python -m proto.generate`"
    stale = [
        path.as_posix()
        for path in fresh
        if (tmp_path / path).read_bytes() != (generate.REPO_ROOT / path).read_bytes()
    ]
    assert not stale, f"stale generated code, run `python -m proto.generate`: {stale}"


@pytest.mark.slow  # a fresh interpreter
def test_generated_modules_import_from_repo_root_without_warnings() -> None:
    code = (
        "from proto.swarm.v1 import frame_pb2, status_pb2, shard_service_pb2, shard_service_pb2_grpc\n"
        "assert set(shard_service_pb2.DESCRIPTOR.services_by_name['ShardService'].methods_by_name) == "
        "{'Session', 'Info', 'Health', 'GetVocab', 'GetManifest', 'GetTensorBytes'}\n"
        "assert frame_pb2.DESCRIPTOR.package == 'swarm.v1'\n"
    )
    completed = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=generate.REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr


@pytest.mark.slow  # a fresh interpreter
def test_pure_modules_import_no_event_loop_or_grpc() -> None:
    code = (
        "import sys\n"
        "import proto.codec, proto.errors, proto.tensor_codec, proto.vocab, proto.recipe\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'grpc', 'trio', 'asyncio'})\n"
        "assert not bad, bad\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=generate.REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert completed.returncode == 0, completed.stderr
