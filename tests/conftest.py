"""Fixtures shared by every test tier."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node.testmodel import test_model_path
from sim.procs import LIVE_SUPERVISORS, problem_lines


@pytest.fixture(scope="session")
def model_path() -> Path:
    return test_model_path()


@pytest.fixture(scope="session")
def node_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One node cache (shards, fingerprints, compiled capture) for the whole run."""
    return tmp_path_factory.mktemp("node-cache")


@pytest.fixture(autouse=True, scope="session")
def _quiet_llama() -> None:
    logging.getLogger("llama.cpp").setLevel(logging.WARNING)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On a failure, the error and warning lines of every service the test's processes logged: a
    failure on a CI machine is then explained by its own report."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for sup in list(LIVE_SUPERVISORS):
        for svc in sup.services:
            lines = problem_lines(svc.log_text())
            if lines:
                report.sections.append((f"{svc.name} log problems ({svc.log_path})", "\n".join(lines)))
