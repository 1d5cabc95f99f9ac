"""The JSON log lines, and hypercorn's teardown race turned into one warning line (common/logs.py).

The race itself (a client gone while the app sends its last WebSocket message) depends on timing and
cannot be forced through a real server reliably; here trio raises the real ``BusyResourceError`` (two
tasks sending on one lockstep stream) and hypercorn's own logger reports it, as it does in the race."""

from __future__ import annotations

import json
import logging

import hypercorn.config
import hypercorn.logging
import pytest
import trio
import trio.testing

from common import logs


async def _busy_error() -> trio.BusyResourceError:
    """A real BusyResourceError: a second sender on a stream whose first send is still blocked."""
    left, _right = trio.testing.lockstep_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(left.send_all, b"first")  # blocks: nobody reads the other end
        await trio.testing.wait_all_tasks_blocked()
        try:
            await left.send_all(b"second")
        except trio.BusyResourceError as err:
            nursery.cancel_scope.cancel()
            return err
    raise AssertionError("trio let two tasks send at once")


async def _hypercorn_reports(exc: BaseException) -> None:
    """What hypercorn's task group does when the app raised ``exc``."""
    config = hypercorn.config.Config()
    config.errorlog = logging.getLogger("hypercorn.error")
    log = hypercorn.logging.Logger(config)
    try:
        raise exc
    except BaseException:
        await log.exception("Error in ASGI Framework")


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("grouped", [False, True])
def test_the_teardown_race_is_one_warning_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], grouped: bool
) -> None:
    logs.configure("info")

    async def main() -> None:
        err: BaseException = await _busy_error()
        if grouped:  # as it leaves a task group
            err = BaseExceptionGroup("unhandled errors in a TaskGroup", [err])
        await _hypercorn_reports(err)

    trio.run(main)
    lines = _lines(capsys.readouterr().err)
    assert [(line["level"], line["event"]) for line in lines] == [("warning", "socket_closed_while_sending")]
    assert "exception" not in lines[0] and "another task" in str(lines[0]["error"])


def test_other_framework_errors_keep_their_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info")

    async def main() -> None:
        mixed = BaseExceptionGroup("unhandled", [await _busy_error(), ValueError("a real bug")])
        await _hypercorn_reports(ValueError("a real bug"))
        await _hypercorn_reports(mixed)

    trio.run(main)
    lines = _lines(capsys.readouterr().err)
    assert [(line["level"], line["event"]) for line in lines] == [("error", "Error in ASGI Framework")] * 2
    assert all(
        "Traceback" in str(line["exception"]) and "a real bug" in str(line["exception"]) for line in lines
    )


def test_configure_twice_installs_the_filter_once() -> None:
    logs.configure("info")
    logs.configure("warning")
    installed = [
        f for f in logging.getLogger("hypercorn.error").filters if isinstance(f, logs.SocketTeardownRace)
    ]
    assert len(installed) == 1
    logs.configure("info")
