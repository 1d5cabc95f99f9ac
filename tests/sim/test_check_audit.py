"""sim/check_audit.py on synthetic logs: a liar's verdict is not an accusation of an honest node."""

from __future__ import annotations

import json
from pathlib import Path

from sim.check_audit import audit, main

LIAR = "a" * 64
HONEST = "b" * 64


def _write(path: Path, events: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))


def test_verdicts_against_started_liars_are_not_false_accusations(tmp_path: Path) -> None:
    _write(tmp_path / "swarm0/logs/liar-swap_sampler-1.log", [{"event": "node_identity", "node_id": LIAR}])
    _write(
        tmp_path / "swarm0/logs/gateway.log",
        [{"event": "spot_check_verdict", "liar": LIAR}, {"event": "spot_check_verdict", "liar": None}],
    )
    result = audit(tmp_path)
    assert result["verdicts"] == 2 and result["undecided"] == 1
    assert result["accused"] == {LIAR: 1} and result["false_accusations"] == {}
    assert main([str(tmp_path)]) == 0


def test_a_verdict_against_a_node_not_started_as_a_liar_fails_the_audit(tmp_path: Path) -> None:
    _write(tmp_path / "other0/logs/node1.log", [{"event": "node_identity", "node_id": HONEST}])
    _write(tmp_path / "other0/logs/gateway.log", [{"event": "spot_check_verdict", "liar": HONEST}])
    # A swarm of scripted in-process nodes (no node logs) names its liars itself: not audited.
    _write(tmp_path / "fake0/logs/gateway.log", [{"event": "spot_check_verdict", "liar": HONEST}])
    assert audit(tmp_path)["false_accusations"] == {HONEST: 1}
    assert main([str(tmp_path), "--out", str(tmp_path / "audit.json")]) == 1
    assert json.loads((tmp_path / "audit.json").read_text())["false_accusations"] == {HONEST: 1}
