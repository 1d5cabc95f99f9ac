"""Traffic probes for measuring an emulated WAN (used by the tests and ``python -m sim.wan.bench``).

A socket belongs to the network namespace it was created in, whichever thread
uses it later. So each probe creates its sockets inside a host
(``wan.call(host, ...)``) and then runs in an ordinary thread: a server's
socket is listening before the client's first packet, with no sleeps.

Bounds: every socket has a timeout; every loop has a count or a deadline.
Timestamps: one-way delays use the receiving kernel's arrival stamp
(``SO_TIMESTAMPNS``, CLOCK_REALTIME) against the sender's CLOCK_REALTIME just
before ``sendto`` -- all namespaces share the machine's clocks.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sim.wan.emulator import WanEmulator

T = TypeVar("T")
SOCKET_TIMEOUT_S = 10.0
_UDP_HEADER = struct.Struct("!IQ")  # sequence number, send time (ns, CLOCK_REALTIME)
# Linux's SO_TIMESTAMPNS (socket.h: SO_TIMESTAMPNS_OLD = 35, also the cmsg type); Python < 3.14 lacks it.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def _background(fn: Callable[..., T], *args: Any) -> Future[T]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(4)
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def _connect(address: str, port: int) -> socket.socket:
    sock = socket.create_connection((address, port), timeout=SOCKET_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def tcp_rtts_ms(wan: WanEmulator, client: str, server: str, count: int, size: int = 64) -> list[float]:
    """``count`` TCP ping-pongs of ``size`` bytes from ``client`` to ``server``; each round trip in ms.

    The connection is set up (and one warm-up exchange made) before timing starts."""
    lsock = wan.call(server, _listener, wan.address(server))
    port = lsock.getsockname()[1]

    def echo() -> None:
        with lsock:
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(SOCKET_TIMEOUT_S * 10)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(65536):
                    conn.sendall(data)

    done = _background(echo)
    sock = wan.call(client, _connect, wan.address(server), port)
    rtts = []
    payload = b"x" * size
    with sock:
        sock.settimeout(SOCKET_TIMEOUT_S * 10)
        for i in range(count + 1):
            t0 = time.perf_counter()
            sock.sendall(payload)
            _recv_exact(sock, size)
            if i:  # the first exchange warms up (slow start, caches)
                rtts.append((time.perf_counter() - t0) * 1e3)
    done.result(SOCKET_TIMEOUT_S)
    return rtts


@dataclass(frozen=True)
class UdpResult:
    sent: int
    one_way_ms: list[float]  # per received datagram, in arrival order

    @property
    def received(self) -> int:
        return len(self.one_way_ms)

    @property
    def loss_pct(self) -> float:
        return 100.0 * (self.sent - self.received) / max(1, self.sent)


def _udp_receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((address, 0))
    return sock


def _udp_sender() -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def udp_one_way(
    wan: WanEmulator, sender: str, receiver: str, count: int, interval_s: float, size: int = 64
) -> UdpResult:
    """Send ``count`` datagrams ``interval_s`` apart; the one-way delay of each that arrived (ms)."""
    rsock = wan.call(receiver, _udp_receiver, wan.address(receiver))
    ssock = wan.call(sender, _udp_sender)
    target = (wan.address(receiver), rsock.getsockname()[1])
    size = max(size, _UDP_HEADER.size)
    stop = threading.Event()

    def receive() -> list[float]:
        delays: list[float] = []
        rsock.settimeout(0.2)
        cmsg_space = socket.CMSG_SPACE(16)
        while True:
            try:
                data, ancdata, _, _ = rsock.recvmsg(2048, cmsg_space)
            except TimeoutError:
                if stop.is_set():
                    return delays
                continue
            stamp = None
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", cdata[:16])
                    stamp = sec * 1_000_000_000 + nsec
            _, sent_ns = _UDP_HEADER.unpack_from(data)
            arrived = stamp if stamp is not None else time.time_ns()
            delays.append((arrived - sent_ns) / 1e6)

    with rsock, ssock:
        future = _background(receive)
        filler = b"\0" * (size - _UDP_HEADER.size)
        start = time.perf_counter()
        for seq in range(count):
            pause = start + seq * interval_s - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            ssock.sendto(_UDP_HEADER.pack(seq, time.time_ns()) + filler, target)
        # Everything still in flight arrives within the path's delay; then stop listening.
        delay = wan.link(sender, receiver)
        time.sleep((delay.delay_ms + delay.jitter_ms) / 1e3 + 0.3)
        stop.set()
        delays = future.result(SOCKET_TIMEOUT_S)
    return UdpResult(sent=count, one_way_ms=delays)


@dataclass(frozen=True)
class BulkResult:
    bytes: int
    seconds: float

    @property
    def mbit_s(self) -> float:
        return self.bytes * 8 / self.seconds / 1e6


def tcp_bulk(
    wan: WanEmulator, sender: str, receiver: str, seconds: float, warmup_s: float = 0.5
) -> BulkResult:
    """Send as fast as TCP can for ``warmup_s + seconds``; the receiver counts goodput after warm-up."""
    lsock = wan.call(receiver, _listener, wan.address(receiver))
    port = lsock.getsockname()[1]
    result: dict[str, float] = {}

    def sink() -> None:
        with lsock:
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(SOCKET_TIMEOUT_S)
                begin = time.perf_counter()
                counted = 0
                t_start = None
                while chunk := conn.recv(1 << 20):
                    now = time.perf_counter()
                    if t_start is None and now - begin >= warmup_s:
                        t_start = now
                    elif t_start is not None:
                        counted += len(chunk)
                        result["end"] = now
                result["bytes"] = counted
                result["start"] = t_start or begin

    done = _background(sink)
    sock = wan.call(sender, _connect, wan.address(receiver), port)
    block = b"\0" * (256 << 10)
    with sock:
        deadline = time.perf_counter() + warmup_s + seconds
        while time.perf_counter() < deadline:
            sock.sendall(block)
    done.result(SOCKET_TIMEOUT_S * 3)
    return BulkResult(
        bytes=int(result["bytes"]), seconds=result.get("end", result["start"]) - result["start"]
    )
