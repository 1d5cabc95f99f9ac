"""How should trio meet grpcio? Round-trip cost of one frame through each candidate design.

grpcio speaks only asyncio (``grpc.aio``); the services are written in trio. This
benchmark measures, side by side in one run, what a frame costs on one gRPC
bidirectional stream when the server hands every message to trio code and trio
answers it, for each way of joining the two runtimes:

``asyncio``
    the floor: the handler echoes on the asyncio loop, no trio at all.
``thread-bridge``
    the first design: grpc.aio in an asyncio loop on its own thread, trio in the
    main thread; a frame crosses with ``TrioToken.run_sync_soon`` and the reply
    with ``loop.call_soon_threadsafe`` (two thread wake-ups per frame).
``guest``
    trio runs as a guest of the asyncio loop that grpc.aio uses
    (``trio.lowlevel.start_guest_run``): one thread; the handler puts the frame
    in a trio memory channel and a trio task answers through an asyncio queue.
``trio-asyncio``
    the asyncio loop is trio-asyncio's, running inside ``trio.run``; the
    handler and trio share one scheduler.
``adapter``
    the same, through the project's adapter (``common.grpc_adapter``): a trio
    handler reading and writing a ``MessageStream`` with bounded buffers.

The client is the same for all of them (plain grpc.aio in this process). Every
server is a child process; rounds are interleaved so machine drift lands on
every candidate alike. Prints a table and writes JSON (``--out``).

    python -m sim.bench_bridge --frames 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from sim.procs import Supervisor

METHOD = "/bench.Echo/Session"
CANDIDATES = ("asyncio", "thread-bridge", "guest", "trio-asyncio", "adapter")
PAYLOAD_BYTES = 576 * 4 + 200  # one hidden-state row of the test model plus a frame header


# --------------------------------------------------------------------------------------- servers


def _handler(session: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Echo", {"Session": grpc.stream_stream_rpc_method_handler(session)}
    )


async def _start(session: Any, port_file: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(session),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    _write_port(port_file, port)
    return server


def _write_port(port_file: str, port: int) -> None:
    Path(port_file).write_text(str(port))


def serve_asyncio(port_file: str) -> None:
    async def session(requests: Any, context: Any) -> None:
        while (data := await context.read()) is not grpc.aio.EOF:
            await context.write(data)

    async def main() -> None:
        server = await _start(session, port_file)
        await server.wait_for_termination()

    asyncio.run(main())


def serve_thread_bridge(port_file: str) -> None:
    import threading

    import trio

    async def trio_main() -> None:
        token = trio.lowlevel.current_trio_token()

        def aio_thread() -> None:
            async def session(requests: Any, context: Any) -> None:
                loop = asyncio.get_running_loop()
                replies: asyncio.Queue[bytes] = asyncio.Queue()

                def on_trio(data: bytes) -> None:  # runs on the trio thread
                    loop.call_soon_threadsafe(replies.put_nowait, data)

                while (data := await context.read()) is not grpc.aio.EOF:
                    token.run_sync_soon(on_trio, data)
                    await context.write(await replies.get())

            async def main() -> None:
                server = await _start(session, port_file)
                await server.wait_for_termination()

            asyncio.run(main())

        threading.Thread(target=aio_thread, daemon=True).start()
        await trio.sleep_forever()

    trio.run(trio_main)


def serve_guest(port_file: str) -> None:
    import trio

    async def main() -> None:
        loop = asyncio.get_running_loop()
        send, receive = trio.open_memory_channel[tuple[bytes, asyncio.Queue[bytes]]](64)

        async def trio_side() -> None:
            async for data, replies in receive:
                replies.put_nowait(data)  # same thread: no crossing

        done = loop.create_future()
        trio.lowlevel.start_guest_run(
            trio_side,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=lambda outcome: done.set_result(outcome),
            host_uses_signal_set_wakeup_fd=True,
        )

        async def session(requests: Any, context: Any) -> None:
            replies: asyncio.Queue[bytes] = asyncio.Queue()
            while (data := await context.read()) is not grpc.aio.EOF:
                send.send_nowait((data, replies))
                await context.write(await replies.get())

        server = await _start(session, port_file)
        await server.wait_for_termination()

    asyncio.run(main())


def serve_trio_asyncio(port_file: str) -> None:
    import trio
    import trio_asyncio

    async def main() -> None:
        send, receive = trio.open_memory_channel[tuple[bytes, asyncio.Queue[bytes]]](64)

        async def trio_side() -> None:
            async for data, replies in receive:
                replies.put_nowait(data)

        async def session(requests: Any, context: Any) -> None:
            replies: asyncio.Queue[bytes] = asyncio.Queue()
            while (data := await context.read()) is not grpc.aio.EOF:
                send.send_nowait((data, replies))
                await context.write(await replies.get())

        async def aio_main() -> None:
            server = await _start(session, port_file)
            await server.wait_for_termination()

        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            nursery.start_soon(trio_side)
            await trio_asyncio.aio_as_trio(aio_main)()

    trio.run(main)


def serve_adapter(port_file: str) -> None:
    import trio

    from common.grpc_adapter import CallInfo, MessageStream, Service, StreamClosed, open_grpc

    async def echo(stream: MessageStream, info: CallInfo) -> None:
        while True:
            try:
                data = await stream.receive()
            except StreamClosed:
                return
            await stream.send(data)

    async def main() -> None:
        async with open_grpc() as rt, trio.open_nursery() as nursery:
            service = Service("bench.Echo", {"Session": echo}, {}, {})
            port = await nursery.start(rt.serve, "127.0.0.1", 0, [service])
            _write_port(port_file, port)

    trio.run(main)


SERVERS = {
    "adapter": serve_adapter,
    "asyncio": serve_asyncio,
    "thread-bridge": serve_thread_bridge,
    "guest": serve_guest,
    "trio-asyncio": serve_trio_asyncio,
}


# ---------------------------------------------------------------------------------------- client


async def _ping_pong(port: int, frames: int) -> list[float]:
    payload = os.urandom(PAYLOAD_BYTES)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD)()
        times = []
        for _ in range(50):  # warm-up
            await call.write(payload)
            await call.read()
        for _ in range(frames):
            t0 = time.perf_counter()
            await call.write(payload)
            await call.read()
            times.append(time.perf_counter() - t0)
        await call.done_writing()
        return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--out", default="bench-results/bridge.json")
    parser.add_argument("--serve", nargs=2, metavar=("CANDIDATE", "PORT_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        SERVERS[args.serve[0]](args.serve[1])
        return 0
    names = [c for c in args.candidates.split(",") if c]
    samples: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp, Supervisor(Path(tmp)) as sup:
        servers = [
            sup.spawn(
                name,
                [sys.executable, "-m", "sim.bench_bridge", "--serve", name, str(Path(tmp) / f"{name}.port")],
                port_file=Path(tmp) / f"{name}.port",
            )
            for name in names
        ]
        ports = {svc.name: svc.wait_port(30) for svc in servers}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                samples[name] += asyncio.run(_ping_pong(ports[name], args.frames))
    floor = statistics.median(samples["asyncio"]) if "asyncio" in samples else float("nan")
    rows: dict[str, dict[str, float]] = {}
    print(f"{'candidate':<14} {'p50 us':>8} {'mean us':>8} {'p90 us':>8} {'p50 - floor':>12}")
    for name in names:
        s = sorted(samples[name])
        p50, mean, p90 = s[len(s) // 2], statistics.fmean(s), s[int(len(s) * 0.9)]
        rows[name] = {"p50_us": p50 * 1e6, "mean_us": mean * 1e6, "p90_us": p90 * 1e6}
        rows[name]["p50_over_floor_us"] = (p50 - floor) * 1e6
        print(f"{name:<14} {p50 * 1e6:8.0f} {mean * 1e6:8.0f} {p90 * 1e6:8.0f} {(p50 - floor) * 1e6:12.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bridge",
                "frames": args.frames,
                "rounds": args.rounds,
                "payload_bytes": PAYLOAD_BYTES,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
