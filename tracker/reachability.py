"""Can the swarm reach a node? ``GET /v1/reachability?port=N`` dials the *caller's own* address.

A node started with ``--relay URL --relay-auto`` asks this before it decides
between direct gRPC and the gateway's WebSocket relay (docs/nat-and-recovery.md).
The tracker opens a TCP connection to ``<address the request came from>:<port>``
and closes it at once. Only the caller's own address can be probed, so the
endpoint cannot be used to scan other hosts; probes run at most
:data:`MAX_CONCURRENT_PROBES` at a time and each for at most
:data:`PROBE_TIMEOUT_S`.

Behind NAT the request arrives from the router's public address: the probe
then succeeds only if the router forwards the port, which is exactly the
question. A node whose inbound connections are filtered fails it too.
"""

from __future__ import annotations

import trio

PROBE_TIMEOUT_S = 2.0
MAX_CONCURRENT_PROBES = 8


async def probe(host: str, port: int, limiter: trio.CapacityLimiter) -> bool:
    """True when a TCP connection to ``host:port`` opens within :data:`PROBE_TIMEOUT_S`."""
    async with limiter:
        with trio.move_on_after(PROBE_TIMEOUT_S):
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                return False
            await stream.aclose()
            return True
    return False
