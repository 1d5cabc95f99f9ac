"""Did spot checks ever accuse an honest node? Reads every gateway log under a directory.

    SWARM_TEST_CHECK_FRACTION=1 .venv/bin/python -m pytest tests/e2e -p no:randomly --basetemp=DIR
    .venv/bin/python -m sim.check_audit DIR [--out FILE.json]

Counts, over all gateway logs (``*/logs/gateway*.log``), the spot-check verdicts
(``spot_check_verdict``, one per disagreement between two runs) and which nodes
they named (none: the judge agreed with neither run). A verdict naming a node that
was not started as a liar (test-only failpoints) is a false accusation. Liars are
recognised by their service name (``liar-*``, the names ``sim/liars.py`` gives
them) and the node id their log prints at start (``node_identity``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NODE_ID = re.compile(r'"node_id":"([0-9a-f]{64})"')


def liar_ids(root: Path) -> set[str]:
    """Node ids printed by the logs of services named liar-*."""
    ids: set[str] = set()
    for log in root.rglob("logs/liar-*.log"):
        for line in log.read_text(errors="replace").splitlines()[:200]:
            m = NODE_ID.search(line) if '"node_identity"' in line else None
            if m:
                ids.add(m.group(1))
                break
    return ids


def audit(root: Path) -> dict:
    liars = liar_ids(root)
    verdicts = 0
    accused: dict[str, int] = {}
    # Only swarms of real node processes: tests with scripted in-process nodes (tests/gateway) name
    # their liars by construction and assert them themselves.
    logs = [
        g
        for g in sorted(root.rglob("logs/gateway*.log"))
        if any(p.name != g.name and p.name != "tracker.log" for p in g.parent.glob("*.log"))
    ]
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if '"spot_check_verdict"' not in line:
                continue
            verdicts += 1
            try:
                liar = json.loads(line).get("liar") or ""
            except ValueError:
                continue
            accused[liar] = accused.get(liar, 0) + 1
    false = {k: v for k, v in accused.items() if k and k not in liars}
    undecided = accused.pop("", 0)
    return {
        "gateway_logs": len(logs),
        "verdicts": verdicts,
        "liars_started": len(liars),
        "accused": accused,
        "undecided": undecided,
        "false_accusations": false,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = audit(args.root)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["false_accusations"] else 0


if __name__ == "__main__":
    sys.exit(main())
