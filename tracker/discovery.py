"""Zeroconf adapter: advertise the tracker on the LAN, and find it from nodes and gateways.

zeroconf runs its own threads and event loop; this module is the only place
that touches it. The trio side only ever calls it through
``trio.to_thread.run_sync``. Multicast can be missing (containers, CI): then
advertising logs ``zeroconf_unavailable`` and the tracker keeps serving, and
discovery returns None after its timeout instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import time

import trio

from common.logs import event

SERVICE_TYPE = "_swarm-tracker._tcp.local."
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


class _Advertisement:
    """Owns one Zeroconf instance and one registered service (blocking calls; run in a thread)."""

    def __init__(self, port: int, tracker_id: str, host: str) -> None:
        from zeroconf import ServiceInfo, Zeroconf

        addresses = _local_ipv4_addresses(host) or ["127.0.0.1"]
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"swarm-tracker-{tracker_id[:16]}.{SERVICE_TYPE}",
            port=port,
            parsed_addresses=addresses,
            properties={"tracker_id": tracker_id, "scheme": "http"},
            server=f"swarm-tracker-{tracker_id[:16]}.local.",
        )
        self.zc = Zeroconf()
        try:
            self.zc.register_service(self.info, allow_name_change=True)
        except BaseException:
            self.zc.close()
            raise

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


async def advertise(
    port: int,
    tracker_id: str,
    host: str = "0.0.0.0",
    *,
    task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Advertise until cancelled.

    ``started(True)`` once registered, ``started(False)`` if multicast is unusable.
    """
    limiter = trio.CapacityLimiter(1)
    ad: _Advertisement | None = None
    with trio.move_on_after(10):
        try:
            ad = await trio.to_thread.run_sync(
                _Advertisement, port, tracker_id, host, limiter=limiter, abandon_on_cancel=True
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
        from zeroconf import ServiceBrowser, ServiceStateChange, Zeroconf

        zc = Zeroconf()
    except Exception as err:
        event(log, "zeroconf_unavailable", level=logging.WARNING, error=repr(err))
        return None
    names: queue.Queue[str] = queue.Queue(maxsize=256)

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            with contextlib.suppress(queue.Full):
                names.put_nowait(name)

    deadline = time.monotonic() + timeout_s
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    name = names.get(timeout=left)
                except queue.Empty:
                    return None
                info = zc.get_service_info(SERVICE_TYPE, name, timeout=max(100, int(left * 1000)))
                if info is None or not info.port:
                    continue
                if tracker_id is not None and info.properties.get(b"tracker_id") != tracker_id.encode():
                    continue
                addrs = info.parsed_addresses()
                v4 = [a for a in addrs if ":" not in a]
                if v4:
                    return f"http://{v4[0]}:{info.port}"
                if addrs:
                    return f"http://[{addrs[0]}]:{info.port}"
            return None
        finally:
            browser.cancel()
    finally:
        zc.close()


async def discover_tracker_async(timeout_s: float, tracker_id: str | None = None) -> str | None:
    """Trio wrapper around :func:`discover_tracker` (runs it in a worker thread)."""
    return await trio.to_thread.run_sync(discover_tracker, timeout_s, tracker_id)
