"""Round-trip samples for the tracker's network coordinates (docs/tracker.md, Network coordinates).

Nodes measure the peers they push to and the peers the tracker asks them to
measure; gateways measure the nodes of their routes. Both report what they
measured in their next heartbeat or statistics report
(``proto.announce.RttSample``).

:class:`RttBook` (pure) keeps, per peer, the last ``window`` round trips and
reports the *minimum* of them: queueing and a busy event loop only ever add
delay, so the minimum is the best estimate of the path itself. A peer is
reported once per new sample (the tracker keeps the claim until it ages out),
freshest first, at most ``MAX_RTT_SAMPLES`` per report; at most ``max_peers``
peers are remembered (the least recently measured go first).

:class:`RttSampler` (trio) measures every ``interval_s``: the targets the
caller supplies (``targets()``: e.g. the push targets now) come first, then the
latest hints (``hint()``: e.g. the tracker's probe list), at most
``max_targets`` per round, ``concurrency`` at once, each ping bounded by
``timeout_s``. A ping is whatever the caller passes (the node and the gateway
pass a gRPC ``Health`` call through ``common.grpc_adapter``). The first ping
to an address is repeated and only the second counts: the first one pays for
the TCP and HTTP/2 set-up. A failed or late ping gives no sample.

Warm-up: a new sampler does not wait ``interval_s`` between its first rounds but
``warmup_s``, then twice that each round (1, 2, 4, 8 s, then ``interval_s``), so
a newcomer's first reports already carry claims and the tracker places it
within a few reports (docs/tracker.md, Network coordinates). The warm-up
restarts when more than half of a round's targets were never measured (e.g.
the tracker's first probe list arrived), at most once per
``WARMUP_RESTART_MIN_S_FACTOR * interval_s``: a big swarm whose random probe
lists are always new costs at most one extra warm-up (four rounds) per four
intervals.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import trio

from common.logs import event
from proto.announce import MAX_RTT_MS, MAX_RTT_SAMPLES, MIN_RTT_MS, PayloadError, RttSample, check_address

log = logging.getLogger("swarm.rtt")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

Target = tuple[str, str]  # (peer id, gRPC address)
WARMUP_RESTART_MIN_S_FACTOR = 4.0  # warm-ups start at most once per this many intervals


@dataclass(frozen=True)
class RttSettings:
    interval_s: float = 15.0  # one round of pings this often
    timeout_s: float = 2.0  # a ping slower than this gives no sample
    max_targets: int = 16  # peers pinged per round
    concurrency: int = 4  # pings in flight at once
    window: int = 3  # round trips kept per peer (the report is their minimum)
    max_peers: int = 256  # peers remembered
    max_hints: int = 16  # hinted targets kept (the latest hints replace the previous ones)
    # While new (and after its targets changed a lot) the sampler measures sooner: this long after
    # the first round, then twice as long each round up to ``interval_s`` (0: no warm-up).
    warmup_s: float = 1.0

    def validate(self) -> RttSettings:
        if not (self.interval_s > 0 and self.timeout_s > 0):
            raise ValueError("interval_s and timeout_s must be > 0")
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ValueError("warmup_s must be >= 0 (0: no warm-up)")
        if min(self.max_targets, self.concurrency, self.window, self.max_peers) < 1 or self.max_hints < 0:
            raise ValueError("max_targets, concurrency, window and max_peers must be >= 1, max_hints >= 0")
        return self


class RttBook:
    """Per-peer round trips (pure, bounded); see the module docstring."""

    def __init__(self, *, window: int = 3, max_peers: int = 256) -> None:
        self._window = window
        self._max_peers = max_peers
        self._peers: OrderedDict[str, deque[float]] = OrderedDict()  # least recently measured first
        self._fresh: set[str] = set()  # peers measured since the last report

    def record(self, peer_id: str, rtt_ms: float) -> None:
        if not (math.isfinite(rtt_ms) and MIN_RTT_MS <= rtt_ms <= MAX_RTT_MS):
            return
        samples = self._peers.pop(peer_id, None)
        if samples is None:
            samples = deque(maxlen=self._window)
        samples.append(rtt_ms)
        self._peers[peer_id] = samples
        self._fresh.add(peer_id)
        while len(self._peers) > self._max_peers:
            gone, _ = self._peers.popitem(last=False)
            self._fresh.discard(gone)

    def best(self, peer_id: str) -> float | None:
        samples = self._peers.get(peer_id)
        return min(samples) if samples else None

    def take_report(self, exclude: str = "") -> tuple[RttSample, ...]:
        """The peers measured since the last report (freshest first, at most ``MAX_RTT_SAMPLES``),
        each with the minimum of its window; they count as reported."""
        out: list[RttSample] = []
        for peer_id in reversed(self._peers):  # most recently measured first
            if len(out) >= MAX_RTT_SAMPLES:
                break
            if peer_id in self._fresh and peer_id != exclude:
                out.append(RttSample(peer_id, round(min(self._peers[peer_id]), 3)))
                self._fresh.discard(peer_id)
        return tuple(out)

    def __len__(self) -> int:
        return len(self._peers)


def parse_hints(raw: object, limit: int = 16) -> list[Target]:
    """A tracker's ``probe`` list (``[{"node_id", "address"}]``) -> valid targets, at most ``limit``;
    malformed entries are skipped (a tracker of another version must not stop heartbeats)."""
    out: list[Target] = []
    if not isinstance(raw, list):
        return out
    for item in raw[: 4 * limit]:
        if len(out) >= limit:
            break
        if not isinstance(item, dict):
            continue
        node_id, address = item.get("node_id"), item.get("address")
        if not isinstance(node_id, str) or not _HEX64.match(node_id) or not isinstance(address, str):
            continue
        try:
            out.append((node_id, check_address(address)))
        except PayloadError:
            continue
    return out


@dataclass(frozen=True)
class RttStatistics:
    rounds: int
    pings: int
    failures: int
    peers: int


class RttSampler:
    def __init__(
        self,
        ping: Callable[[str], Awaitable[object]],
        targets: Callable[[], Iterable[Target]],
        settings: RttSettings = RttSettings(),
        *,
        own_id: str = "",
    ) -> None:
        self._ping = ping
        self._targets = targets
        self.settings = settings.validate()
        self._own_id = own_id
        self.book = RttBook(window=settings.window, max_peers=settings.max_peers)
        self._hints: list[Target] = []
        self._seen: OrderedDict[str, None] = OrderedDict()  # addresses pinged before (bounded)
        self._rounds = self._pings = self._failures = 0
        self._fresh_targets = 0  # targets of the last round never measured before it
        self._last_targets = 0
        self._pause = self.settings.warmup_s or self.settings.interval_s  # the next sleep
        self._warmup_at: float | None = None  # when the last warm-up started (None: not yet)

    def hint(self, targets: Iterable[Target]) -> None:
        """Replace the hinted targets (e.g. the tracker's latest probe list)."""
        self._hints = [t for t in targets if t[0] != self._own_id][: self.settings.max_hints]

    def take_samples(self) -> tuple[RttSample, ...]:
        """What to put in the next report (see :meth:`RttBook.take_report`)."""
        return self.book.take_report(exclude=self._own_id)

    def statistics(self) -> RttStatistics:
        return RttStatistics(self._rounds, self._pings, self._failures, len(self.book))

    def round_targets(self) -> list[Target]:
        out: dict[str, str] = {}
        try:
            supplied = list(self._targets())
        except Exception as err:  # a target source must not stop the sampler
            event(log, "rtt_targets_failed", level=logging.WARNING, error=repr(err))
            supplied = []
        for peer_id, address in [*supplied, *self._hints]:
            if len(out) >= self.settings.max_targets:
                break
            if peer_id and address and peer_id != self._own_id and peer_id not in out:
                out[peer_id] = address
        return list(out.items())

    async def measure_once(self) -> None:
        """One round: ping this round's targets (bounded concurrency) and record what answered."""
        limiter = trio.CapacityLimiter(self.settings.concurrency)
        targets = self.round_targets()
        self._last_targets = len(targets)
        self._fresh_targets = sum(1 for peer_id, _a in targets if self.book.best(peer_id) is None)
        async with trio.open_nursery() as nursery:
            for peer_id, address in targets:
                nursery.start_soon(self._measure, peer_id, address, limiter)
        self._rounds += 1

    def next_pause(self, now: float) -> float:
        """How long to wait after the round just measured (at ``now``): the warm-up's doubling
        pauses (restarted when more than half of the round's targets were new, at most once per
        ``WARMUP_RESTART_MIN_S_FACTOR * interval_s``), else ``interval_s``."""
        s = self.settings
        if s.warmup_s <= 0 or s.warmup_s >= s.interval_s:
            return s.interval_s
        if self._warmup_at is None:
            self._warmup_at = now  # the first round starts the first warm-up
            self._pause = s.warmup_s
            return self._pause
        many_new = 2 * self._fresh_targets > self._last_targets
        if many_new and now - self._warmup_at >= WARMUP_RESTART_MIN_S_FACTOR * s.interval_s:
            self._warmup_at = now
            self._pause = s.warmup_s
        else:
            self._pause = min(s.interval_s, 2.0 * self._pause)
        return self._pause

    async def _measure(self, peer_id: str, address: str, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            first = address not in self._seen
            rtt = await self._timed(address)
            if first and rtt is not None:
                self._seen[address] = None
                while len(self._seen) > 4 * self.settings.max_peers:
                    self._seen.popitem(last=False)
                rtt = await self._timed(address)  # the first paid for the connection set-up
            if rtt is not None:
                self.book.record(peer_id, rtt)

    async def _timed(self, address: str) -> float | None:
        self._pings += 1
        t0 = trio.current_time()
        try:
            with trio.fail_after(self.settings.timeout_s):
                await self._ping(address)
        except Exception:  # unreachable, refused, too slow: no sample
            self._failures += 1
            return None
        return (trio.current_time() - t0) * 1000.0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Measure every ``interval_s`` (sooner while warming up: :meth:`next_pause`) until cancelled."""
        task_status.started()
        while True:
            await self.measure_once()
            await trio.sleep(self.next_pause(trio.current_time()))


__all__ = [
    "WARMUP_RESTART_MIN_S_FACTOR",
    "RttBook",
    "RttSampler",
    "RttSettings",
    "RttStatistics",
    "Target",
    "parse_hints",
]
