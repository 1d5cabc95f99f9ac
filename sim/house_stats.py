"""The house in figures: lines per package, the largest classes, config keys per service.

    python -m sim.house_stats [--root DIR] [--out FILE.json] [--top 10]

Reads the Python files git tracks under ``--root`` (default: this checkout; point it at a
``git worktree`` of an older commit to compare), generated protobuf modules excluded. Lines are
physical lines of the file; a class's size is the span of its definition (decorators to last
line). Config keys are the fields of each service's config dataclass (``NodeConfig``,
``GatewayConfig``, ``TrackerConfig``): the keys a config file, the environment and the command
line may set. Pure reading: nothing is imported from the tree it measures.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("common", "proto", "node", "tracker", "gateway", "sim", "migrations", "tests")
CONFIGS = {"node": "NodeConfig", "gateway": "GatewayConfig", "tracker": "TrackerConfig"}


def tracked_python(root: Path) -> list[Path]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "*.py"], check=True, capture_output=True, text=True
    ).stdout
    return [root / name for name in out.split() if not name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def measure(root: Path, top: int) -> dict[str, Any]:
    lines: dict[str, int] = dict.fromkeys(PACKAGES, 0)
    classes: list[tuple[int, str]] = []
    config_keys: dict[str, int] = {}
    for path in tracked_python(root):
        rel = path.relative_to(root)
        package = rel.parts[0]
        text = path.read_text(encoding="utf-8")
        if package in lines:
            lines[package] += text.count("\n")
        if package not in PACKAGES or package in ("tests", "migrations"):
            continue
        tree = ast.parse(text, filename=str(rel))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or node.end_lineno is None:
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            classes.append((node.end_lineno - first + 1, f"{rel}:{node.name}"))
            service = rel.parts[0]
            if rel.name == "config.py" and CONFIGS.get(service) == node.name:
                config_keys[service] = sum(
                    1
                    for stmt in node.body
                    if isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and "ClassVar" not in ast.unparse(stmt.annotation)
                )
    classes.sort(reverse=True)
    return {
        "root": str(root),
        "commit": subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "lines_per_package": lines,
        "product_lines": sum(v for k, v in lines.items() if k not in ("tests", "sim")),
        "largest_classes": [{"class": name, "lines": n} for n, name in classes[:top]],
        "config_keys": config_keys,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest classes")
    args = parser.parse_args(argv)
    figures = measure(args.root.resolve(), args.top)
    text = json.dumps(figures, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
