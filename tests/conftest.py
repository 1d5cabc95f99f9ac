"""Fixtures shared by every test tier."""

from __future__ import annotations

import _posixsubprocess
import functools
import logging
import os
import subprocess
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import llama_cpp
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


# -- The two tiers ---------------------------------------------------------------------------------
# The fast tier, ``pytest -m "not slow"``, is pure and in-process tests: it starts no child process and
# loads no model weights into llama.cpp (a vocabulary, ``vocab_only``, is fine). A test that does either
# (a service, a helper script, the capture helper's compiler, a real engine) is marked ``slow``; one
# that is not fails here, whatever the code under test did with the error, so the fast tier stays fast
# by construction rather than by convention.

FAST_TIER_RULE = (
    'the fast tier (pytest -m "not slow") starts no child process and loads no model weights: '
    "mark this test slow"
)


class NotInFastTier(RuntimeError):
    """Raised by the functions that start processes or load weights while a test outside the ``slow``
    tier runs."""


_fast_item: list[pytest.Item] = []  # the fast-tier test now running (at most one)
_refused: dict[str, list[str]] = {}  # nodeid -> what it tried to do


def _refuse(what: str, wrapped: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(wrapped)
    def guard(*args: Any, **kwargs: Any) -> Any:
        if _fast_item:
            detail = f"{what}{_describe(args)}"
            _refused.setdefault(_fast_item[0].nodeid, []).append(detail)
            raise NotInFastTier(f"{detail}: {FAST_TIER_RULE}")
        return wrapped(*args, **kwargs)

    return guard


def _describe(args: tuple[Any, ...]) -> str:
    for arg in args:
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], (str, bytes, os.PathLike)):
            return " " + " ".join(os.fsdecode(a) for a in arg)[:200]
        if isinstance(arg, (str, bytes)):
            return " " + os.fsdecode(arg)[:200]
    return ""


def _install_spawn_guards() -> None:
    # subprocess (and trio.open_process, asyncio's subprocesses, os.popen) go through
    # Popen._execute_child; multiprocessing through _posixsubprocess.fork_exec or os.fork.
    subprocess.Popen._execute_child = _refuse(  # type: ignore[method-assign]
        "subprocess", subprocess.Popen._execute_child
    )
    _posixsubprocess.fork_exec = _refuse("fork_exec", _posixsubprocess.fork_exec)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        setattr(os, name, _refuse(f"os.{name}", getattr(os, name)))
    # Every model load (common.llama, llama_cpp.Llama) goes through this one function.
    load = llama_cpp.llama_model_load_from_file
    refused = _refuse("loading model weights:", load)

    @functools.wraps(load)
    def load_model(path: bytes, params: Any) -> Any:
        return load(path, params) if params.vocab_only else refused(path, params)

    llama_cpp.llama_model_load_from_file = load_model


_install_spawn_guards()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    if item.get_closest_marker("slow") is not None:
        return (yield)
    _fast_item.append(item)
    try:
        return (yield)
    finally:
        _fast_item.clear()


def _checked_phase(item: pytest.Item) -> Generator[None, Any, Any]:
    try:
        result = yield
    except BaseException:
        _refused.pop(item.nodeid, None)  # the phase failed already (with the guard's error, if it was that)
        raise
    tried = _refused.pop(item.nodeid, None)
    if tried:  # refused, but the test caught the error: it fails all the same
        pytest.fail(f"{'; '.join(tried)}: {FAST_TIER_RULE}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    return (yield from _checked_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    return (yield from _checked_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    return (yield from _checked_phase(item))
