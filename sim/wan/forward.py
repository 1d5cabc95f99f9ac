"""A TCP forwarder from the root namespace into the emulated WAN.

The emulator never adds addresses or routes to the root namespace, so a test
or a benchmark running there reaches a service inside the WAN through this
process: the owner creates a listening socket on 127.0.0.1 (in the root
namespace) and starts this module inside one emulated host's namespace (by
default the profile's ``client`` host) with the socket as an inherited fd.
Each accepted connection is joined to a new connection, made from inside that
host, to the target address. So the client's traffic crosses the emulated WAN
from the client's region, exactly as a remote client's would.

Bounds: at most ``--max-connections`` connections at once (more wait in the
listen backlog); each direction copies through one 64 KiB buffer; the outgoing
connect must succeed within 10 s. The process exits when its stdin closes
(the owner exited or crashed) or on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import trio

CHUNK_BYTES = 65536
CONNECT_TIMEOUT_S = 10.0


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        while data := await src.receive_some(CHUNK_BYTES):
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def _handle(client: trio.SocketStream, host: str, port: int, limiter: trio.CapacityLimiter) -> None:
    async with limiter, client:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                upstream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError):
            return
        async with upstream:
            for stream in (client, upstream):
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, upstream)
                nursery.start_soon(_pump, upstream, client)


async def _watch_stdin(cancel: trio.CancelScope) -> None:
    stream = trio.lowlevel.FdStream(os.dup(0))
    async with stream:
        while await stream.receive_some(1024):
            pass
    cancel.cancel()


async def serve(listen_fd: int, host: str, port: int, max_connections: int) -> None:
    sock = socket.socket(fileno=listen_fd)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    limiter = trio.CapacityLimiter(max_connections)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_stdin, nursery.cancel_scope)
        async with listener:
            while True:
                client = await listener.accept()
                nursery.start_soon(_handle, client, host, port, limiter)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen-fd", type=int, required=True, help="inherited listening socket")
    parser.add_argument("--to", required=True, help="HOST:PORT inside the emulated WAN")
    parser.add_argument("--max-connections", type=int, default=256)
    args = parser.parse_args(argv)
    host, _, port = args.to.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        parser.error(f"--to {args.to!r}: expected HOST:PORT")
    if not 1 <= args.max_connections <= 65536:
        parser.error("--max-connections must be 1..65536")
    try:
        trio.run(serve, args.listen_fd, host, int(port), args.max_connections)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
