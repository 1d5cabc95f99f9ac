"""Zeroconf adapter: advertise the tracker on the LAN, and find it from nodes and gateways.

zeroconf speaks asyncio; this module is the only place that touches it. Each
zeroconf instance runs on a private asyncio loop in a thread of its own
(:class:`_PrivateLoop`); the trio side only ever calls in through
``trio.to_thread.run_sync``. Multicast can be missing (containers, CI): then
advertising logs ``zeroconf_unavailable`` and the tracker keeps serving, and
discovery returns None after its timeout instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import trio

from common.logs import event

SERVICE_TYPE = "_swarm-tracker._tcp.local."
T = TypeVar("T")
log = logging.getLogger("swarm.tracker")


def _local_ipv4_addresses(host: str) -> list[str]:
    if host not in ("", "0.0.0.0", "::"):
        try:
            return [socket.gethostbyname(host)]
        except OSError:
            return []
    import psutil  # declared dependency; only needed to enumerate interfaces

    addrs = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET and entry.address not in addrs:
                addrs.append(entry.address)
    # Non-loopback first: remote peers cannot use 127.0.0.1.
    return sorted(addrs, key=lambda a: a.startswith("127."))


class _PrivateLoop:
    """A plain asyncio loop on a thread of its own, for zeroconf's asyncio API.

    zeroconf otherwise starts its loop with ``asyncio.new_event_loop()``, which in a
    process that imported trio-asyncio (every node and gateway: common/grpc_adapter.py)
    makes a trio-asyncio loop that cannot be closed from another thread. The loop
    here is built directly, so it is asyncio's own. One thread per loop; its calls
    are bounded by ``timeout_s``.
    """

    def __init__(self) -> None:
        self.loop = asyncio.SelectorEventLoop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="zeroconf-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class _Advertisement:
    """One zeroconf instance and one registered service on a private loop (blocking; call from a thread)."""

    def __init__(self, port: int, tracker_id: str, host: str, scheme: str = "http") -> None:
        from zeroconf import ServiceInfo

        addresses = _local_ipv4_addresses(host) or ["127.0.0.1"]
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"swarm-tracker-{tracker_id[:16]}.{SERVICE_TYPE}",
            port=port,
            parsed_addresses=addresses,
            properties={"tracker_id": tracker_id, "scheme": scheme},
            server=f"swarm-tracker-{tracker_id[:16]}.local.",
        )
        self.private = _PrivateLoop()
        try:
            self.azc = self.private.run(self._register(), 10)
        except BaseException:
            self.private.close()
            raise

    async def _register(self) -> Any:
        from zeroconf.asyncio import AsyncZeroconf

        azc = AsyncZeroconf()
        try:
            await (await azc.async_register_service(self.info, allow_name_change=True))
        except BaseException:
            await azc.async_close()
            raise
        return azc

    async def _unregister(self) -> None:
        try:
            await (await self.azc.async_unregister_service(self.info))
        finally:
            await self.azc.async_close()

    def close(self) -> None:
        try:
            self.private.run(self._unregister(), 5)
        finally:
            self.private.close()


async def advertise(
    port: int,
    tracker_id: str,
    host: str = "0.0.0.0",
    scheme: str = "http",
    *,
    task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Advertise until cancelled (``scheme``: "https" for a tracker serving TLS).

    ``started(True)`` once registered, ``started(False)`` if multicast is unusable.
    """
    limiter = trio.CapacityLimiter(1)
    ad: _Advertisement | None = None
    with trio.move_on_after(10):
        try:
            ad = await trio.to_thread.run_sync(
                _Advertisement, port, tracker_id, host, scheme, limiter=limiter, abandon_on_cancel=True
            )
        except Exception as err:  # zeroconf raises OSError and its own errors when multicast is missing
            event(log, "zeroconf_unavailable", level=logging.WARNING, error=repr(err))
    if ad is None:
        task_status.started(False)
        return
    event(log, "zeroconf_advertised", service=ad.info.name, port=port, addresses=ad.info.parsed_addresses())
    task_status.started(True)
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await trio.to_thread.run_sync(ad.close, limiter=limiter, abandon_on_cancel=True)


def discover_tracker(timeout_s: float, tracker_id: str | None = None) -> str | None:
    """Blocking: the URL (``http://host:port``) of the first tracker seen on the LAN within ``timeout_s``.

    With ``tracker_id``, only a tracker advertising that id (hex public key) counts.
    """
    try:
        private = _PrivateLoop()
    except OSError as err:
        event(log, "zeroconf_unavailable", level=logging.WARNING, error=repr(err))
        return None
    try:
        return private.run(_discover(timeout_s, tracker_id), timeout_s + 5)
    except Exception as err:  # zeroconf raises OSError and its own errors when multicast is missing
        event(log, "zeroconf_unavailable", level=logging.WARNING, error=repr(err))
        return None
    finally:
        private.close()


async def _discover(timeout_s: float, tracker_id: str | None) -> str | None:
    from zeroconf import ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

    names: asyncio.Queue[str] = asyncio.Queue(maxsize=256)

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            with contextlib.suppress(asyncio.QueueFull):
                names.put_nowait(name)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    azc = AsyncZeroconf()
    try:
        browser = AsyncServiceBrowser(azc.zeroconf, SERVICE_TYPE, handlers=[on_change])
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    name = await asyncio.wait_for(names.get(), left)
                except TimeoutError:
                    return None
                left = deadline - loop.time()
                info = await azc.async_get_service_info(
                    SERVICE_TYPE, name, timeout=max(100, int(left * 1000))
                )
                if info is None or not info.port:
                    continue
                if tracker_id is not None and info.properties.get(b"tracker_id") != tracker_id.encode():
                    continue
                addrs = info.parsed_addresses()
                v4 = [a for a in addrs if ":" not in a]
                scheme = "https" if info.properties.get(b"scheme") == b"https" else "http"
                if v4:
                    return f"{scheme}://{v4[0]}:{info.port}"
                if addrs:
                    return f"{scheme}://[{addrs[0]}]:{info.port}"
            return None
        finally:
            await browser.async_cancel()
    finally:
        await azc.async_close()


async def discover_tracker_async(timeout_s: float, tracker_id: str | None = None) -> str | None:
    """Trio wrapper around :func:`discover_tracker` (runs it in a worker thread).

    Abandoned on cancel (Ctrl-C while a node waits for its tracker): the thread
    ends by itself within its timeout."""
    return await trio.to_thread.run_sync(discover_tracker, timeout_s, tracker_id, abandon_on_cancel=True)
