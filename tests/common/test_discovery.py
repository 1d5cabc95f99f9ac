"""Zeroconf adapter: advertise and discover on this host, bounded in time.

Multicast is often missing in containers and CI: then advertising reports
``started(False)`` or discovery finds nothing within its timeout, and the test
skips instead of hanging.
"""

from __future__ import annotations

import contextlib

import pytest
import trio

from common.discovery import advertise, discover_tracker_async

pytestmark = pytest.mark.slow  # zeroconf: ifaddr runs ldconfig to find libc


@pytest.mark.parametrize("loop", ["trio", "trio-asyncio"])
async def test_advertise_then_discover(loop: str) -> None:
    """Also inside trio-asyncio's loop, where nodes and gateways run grpc.aio (common/grpc_adapter.py):
    zeroconf must keep an asyncio loop of its own there."""
    import trio_asyncio

    with trio.fail_after(20):
        async with contextlib.AsyncExitStack() as stack:
            if loop == "trio-asyncio":
                await stack.enter_async_context(trio_asyncio.open_loop())
            url = await _advertise_and_discover()
    if url is None:
        pytest.skip("multicast unavailable: advertisement not seen on this host")
    assert url.endswith(":45678")


async def _advertise_and_discover() -> str | None:
    async with trio.open_nursery() as nursery:
        ok = await nursery.start(advertise, 45678, "ab" * 32, "127.0.0.1")
        if not ok:
            nursery.cancel_scope.cancel()
            pytest.skip("multicast unavailable: zeroconf could not advertise")
        url = await discover_tracker_async(3.0, tracker_id="ab" * 32)
        nursery.cancel_scope.cancel()
    return url


async def test_discover_gives_up_after_its_timeout() -> None:
    with trio.fail_after(10):
        assert await discover_tracker_async(0.3, tracker_id="00" * 32) is None
