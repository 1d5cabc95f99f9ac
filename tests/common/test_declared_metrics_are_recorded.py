"""No declared-but-dead metric: every metric a service declares (``<service>/metrics.py`` ``SPECS``) is
named somewhere in that service's code besides its declaration -- pushed (``inc``/``observe``/``set``)
or returned by a scrape-time source (``gauges()``, statistics read at scrape time).

A static check (the AST of every module of the package): it cannot prove a recording line runs, which
the services' own tests do for the histograms (e.g. tests/gateway/test_gateway_fake_swarm.py), but it
fails the day a metric is declared and nothing refers to it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _uses(package: str) -> dict[str, int]:
    """String constants of the package's modules, counted; the keys of ``SPECS = {...}`` excluded."""
    counts: dict[str, int] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        declared: set[int] = set()
        for node in ast.walk(tree):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "SPECS" and isinstance(node.value, ast.Dict):  # type: ignore[union-attr]
                declared.update(id(k) for k in node.value.keys if k is not None)  # type: ignore[union-attr]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in declared:
                counts[node.value] = counts.get(node.value, 0) + 1
    return counts


@pytest.mark.parametrize("package", ["gateway", "node", "tracker"])
def test_every_declared_metric_is_recorded_somewhere(package: str) -> None:
    specs = importlib.import_module(f"{package}.metrics").SPECS
    assert specs, package
    uses = _uses(package)
    dead = sorted(name for name in specs if not uses.get(name))
    assert not dead, f"{package} declares metrics nothing records: {dead}"
