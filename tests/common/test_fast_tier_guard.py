"""The fast tier's rule holds: a test outside ``slow`` that starts a process or loads model weights fails,
even when it catches the error; the same test marked ``slow`` passes; tokenizing (``vocab_only``) is
allowed. Runs the project's own conftest in a separate pytest (a child process, hence slow)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sim.procs import service_env

pytestmark = pytest.mark.slow  # runs an inner pytest

HERE = Path(__file__).resolve().parent
INNER_TESTS = """
import subprocess

import pytest

from common.llama import free_model, load_model
from node.testmodel import test_model_path


def test_spawns_and_catches():
    try:
        subprocess.run(["true"], check=True)
    except RuntimeError:
        pass


def test_loads_weights():
    free_model(load_model(test_model_path()))


def test_tokenizes():
    free_model(load_model(test_model_path(), vocab_only=True))


@pytest.mark.slow
def test_spawns_marked_slow():
    subprocess.run(["true"], check=True)
"""


def test_a_fast_test_that_spawns_or_loads_weights_fails_and_a_slow_one_passes(tmp_path: Path) -> None:
    shutil.copy(HERE.parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: multi-process\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
        cwd=tmp_path,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert "2 failed, 2 passed" in out, out
    failed = {line.split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {
        "FAILED test_inner.py::test_spawns_and_catches",
        "FAILED test_inner.py::test_loads_weights",
    }
    # caught by the test, failed all the same; and the weights load names the file
    assert 'subprocess true: the fast tier (pytest -m "not slow")' in out, out
    assert "NotInFastTier: loading model weights: " in out and "mark this test slow" in out, out
