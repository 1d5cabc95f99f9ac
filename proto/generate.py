"""Regenerate the Python modules of the ``.proto`` files: ``python -m proto.generate``.

The one way the committed ``proto/swarm/v1/*_pb2*.py*`` files are produced.
protoc runs from the repository root with ``-I .`` so that generated modules
import each other as ``proto.swarm.v1.xxx_pb2``, which is how the rest of the
project imports them. ``tests/proto/test_proto_generated.py`` regenerates into
a temporary directory and fails if the committed copy differs.

The compiler is the one bundled with grpcio-tools (pinned in pyproject.toml);
its output requires a protobuf runtime of the same major version, no older than
the gencode version written in each ``_pb2.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("proto") / "swarm" / "v1"  # relative to REPO_ROOT
# Files that declare a gRPC service; only these get a ``_pb2_grpc.py``.
SERVICE_FILES = frozenset({"shard_service.proto"})


def proto_sources(root: Path = REPO_ROOT) -> list[Path]:
    """The ``.proto`` files, relative to ``root``, sorted for a stable order."""
    return sorted(p.relative_to(root) for p in (root / PROTO_DIR).glob("*.proto"))


def _run_protoc(args: list[str], root: Path) -> None:
    command = [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", *args]
    completed = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"protoc failed ({completed.returncode}): {completed.stderr.strip()}")


def generate(out_dir: Path = REPO_ROOT, root: Path = REPO_ROOT) -> list[Path]:
    """Compile every ``.proto`` under ``root`` into ``out_dir``; return the written files.

    ``out_dir`` receives the same relative layout (``proto/swarm/v1/...``).
    """
    out_dir = out_dir.resolve()
    sources = proto_sources(root)
    if not sources:
        raise RuntimeError(f"no .proto files under {root / PROTO_DIR}")
    (out_dir / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    names = [s.as_posix() for s in sources]
    _run_protoc([f"--python_out={out_dir}", f"--pyi_out={out_dir}", *names], root)
    services = [s.as_posix() for s in sources if s.name in SERVICE_FILES]
    if services:
        _run_protoc([f"--grpc_python_out={out_dir}", *services], root)
    return generated_files(out_dir)


def generated_files(base: Path) -> list[Path]:
    """The generated files under ``base`` (relative to it), sorted."""
    directory = base / PROTO_DIR
    found = [
        *directory.glob("*_pb2.py"),
        *directory.glob("*_pb2.pyi"),
        *directory.glob("*_pb2_grpc.py"),
    ]
    return sorted(p.relative_to(base) for p in found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="directory that receives proto/swarm/v1/... (default: the repository root)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.as_posix())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
