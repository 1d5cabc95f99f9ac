"""Make the repository root and this directory importable (helpers live next to the tests)."""

from __future__ import annotations

import sys
from pathlib import Path

for _path in (str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol_swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path):  # type: ignore[no-untyped-def]
    """One real two-stage SmolLM2 swarm for the client-facing e2e modules (started once per session)."""
    from openai_swarm import two_stage_swarm

    with two_stage_swarm(
        tmp_path_factory.mktemp("smol-swarm"),
        model_path,
        node_cache,
        15,
        30,
        gateway_args=[
            "--model-alias",
            "smol=smollm2-135m-8k-lc100k-mix1-ep2",
            "--cors-origins",
            "*",
            "--prefix-exact",  # warm turns bit-identical to cold ones, so texts can be compared
        ],
    ) as s:
        yield s
