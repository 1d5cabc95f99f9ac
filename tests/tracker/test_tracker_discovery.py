"""Zeroconf adapter: advertise and discover on this host, bounded in time.

Multicast is often missing in containers and CI: then advertising reports
``started(False)`` or discovery finds nothing within its timeout, and the test
skips instead of hanging.
"""

from __future__ import annotations

import pytest
import trio

from tracker.discovery import advertise, discover_tracker_async


async def test_advertise_then_discover() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ok = await nursery.start(advertise, 45678, "ab" * 32, "127.0.0.1")
            if not ok:
                nursery.cancel_scope.cancel()
                pytest.skip("multicast unavailable: zeroconf could not advertise")
            url = await discover_tracker_async(3.0, tracker_id="ab" * 32)
            nursery.cancel_scope.cancel()
    if url is None:
        pytest.skip("multicast unavailable: advertisement not seen on this host")
    assert url.endswith(":45678")


async def test_discover_gives_up_after_its_timeout() -> None:
    with trio.fail_after(10):
        assert await discover_tracker_async(0.3, tracker_id="00" * 32) is None
