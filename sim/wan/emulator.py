"""The emulated WAN: one network namespace per host, joined through a router namespace.

Topology. Host ``h`` (1..254, in the order given) gets namespace
``swwan-<pid>-<seq>-<name>`` with one interface ``eth0`` = 10.77.h.2/24 and a
default route to the router namespace, whose interface ``hN`` is 10.77.h.1.
The router forwards between hosts; one iptables rule there (FORWARD ->
NFQUEUE 0) hands every forwarded packet to the delayer, which holds it for the
path's one-way delay (plus jitter, minus loss) and releases it at its due time.
Rate limits are ``tbf`` qdiscs: the uplink on the host's ``eth0``, the downlink
on the router's ``hN``. So a packet goes: sender's uplink shaper -> path
delay -> receiver's downlink shaper, as on the internet.

Isolation. Nothing is added to the root namespace: no interface, address,
route or firewall rule. Processes run inside a host's namespace via
``ip netns exec``; code in this process reaches a host through
:meth:`WanEmulator.call` (a thread that entered the namespace) or a
forwarder (:meth:`WanEmulator.forward`, a loopback port in the root namespace
that connects from inside a host).

Lifetime. ``with WanEmulator(profile, hosts) as wan:`` builds everything and
removes everything on exit: processes left in the namespaces are killed, the
namespaces deleted (veths, rules and qdiscs go with them). If the owner
crashes, the delayer and forwarders exit with their stdin pipes; the
namespaces stay until :func:`sim.wan.netns.cleanup_leftovers` runs, which
every new emulator does first (``swarm-sim wan cleanup`` too).

Thread safety. Every method may be called from any thread (a lock guards the
state and the delayer's pipe); all block for at most a few seconds (every
command has a time limit). From trio, call them via ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from sim.wan import netns
from sim.wan.delayer import Delayer, DelayerStats
from sim.wan.errors import WanError, WanSetupError
from sim.wan.profile import LinkParams, ProfileError, WanProfile
from sim.wan.support import check_support

T = TypeVar("T")
_seq = itertools.count(1)

ROUTER = "router"
MAX_FORWARDERS = 64


def host_address(index: int) -> str:
    return f"10.77.{index}.2"


@dataclass(frozen=True)
class Host:
    name: str
    region: str
    index: int  # 1..254: the third octet of its addresses
    address: str  # 10.77.index.2, reachable from every other host
    netns: str  # the namespace's name (``ip netns exec NETNS ...``)
    uplink_mbit: float  # 0 = unlimited
    downlink_mbit: float


@dataclass(frozen=True)
class WanStatistics:
    hosts: int
    links: int  # ordered host pairs programmed into the delayer
    forwarders: int
    delayer: DelayerStats


class WanEmulator:
    """An emulated WAN on this machine; see the module docstring. Needs root."""

    def __init__(
        self,
        profile: WanProfile,
        hosts: Mapping[str, str] | None = None,
        *,
        n_nodes: int = 0,
        seed: int = 1,
        rt_priority: int = 50,
        max_packets: int = 65536,
    ) -> None:
        """``hosts``: host name -> region; default ``profile.place(n_nodes)`` (tracker, gateway,
        client, node1..nodeN). ``max_packets`` bounds what the delayer holds at once (beyond it
        packets drop, like a full router buffer)."""
        placed = dict(hosts) if hosts is not None else profile.place(n_nodes)
        profile.check_hosts(placed)
        if not 16 <= max_packets <= 1 << 22:
            raise ProfileError("max_packets must be 16..4194304")
        if not 0 <= rt_priority <= 99:
            raise ProfileError("rt_priority must be 0 (none) .. 99")
        self.profile = profile
        self._placement = placed
        self._seed = seed
        self._rt_priority = rt_priority
        self._max_packets = max_packets
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._seq = next(_seq)
        self.hosts: dict[str, Host] = {}
        self._links: dict[tuple[str, str], LinkParams] = {}
        self._delayer: Delayer | None = None
        self._forwarders: list[tuple[subprocess.Popen, socket.socket]] = []
        self._record: Path | None = None
        self._started = False
        self._closed = False

    # ---- lifetime ----

    def __enter__(self) -> WanEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def router_netns(self) -> str:
        return netns.ns_name(self._pid, self._seq, ROUTER)

    def start(self) -> None:
        with self._lock:
            if self._started:
                raise WanSetupError("this emulator was started already")
            self._started = True
            support = check_support()
            self._iptables = support.iptables
            netns.cleanup_leftovers(exclude_pid=self._pid)
            self._record = netns.write_run_record(self._pid, self._seq)
            try:
                self._build(support.delayer)
            except BaseException:
                self.close()
                raise

    def _build(self, delayer_exe: Path) -> None:
        router = self.router_netns
        self._add_namespace(router)
        netns.run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for index, (name, region_name) in enumerate(self._placement.items(), start=1):
            region = self.profile.regions[region_name]
            host = Host(
                name=name,
                region=region_name,
                index=index,
                address=host_address(index),
                netns=netns.ns_name(self._pid, self._seq, name),
                uplink_mbit=region.uplink_mbit,
                downlink_mbit=region.downlink_mbit,
            )
            self._add_namespace(host.netns)
            dev = f"h{index}"
            netns.run(["ip", "-n", router, "link", "add", dev, "type", "veth", "peer", "name", "eth0",
                       "netns", host.netns])  # fmt: skip
            netns.run(["ip", "-n", router, "addr", "add", f"10.77.{index}.1/24", "dev", dev])
            netns.run(["ip", "-n", router, "link", "set", dev, "up"])
            netns.run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            netns.run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
            netns.run(["ip", "-n", host.netns, "route", "add", "default", "via", f"10.77.{index}.1"])
            self._shape(host.netns, "eth0", region.uplink_mbit, region.queue_ms)
            self._shape(router, dev, region.downlink_mbit, region.queue_ms)
            self.hosts[name] = host
        for a, b in itertools.permutations(self.hosts.values(), 2):
            self._links[(a.name, b.name)] = self.profile.path(a.region, b.region)
        prefix = ["ip", "netns", "exec", router]
        self._delayer = Delayer(
            prefix, delayer_exe, max_packets=self._max_packets, rt_priority=self._rt_priority, seed=self._seed
        )
        self._program(self._links)
        # Only now do packets go to the queue: before, nobody would have been there to release them.
        netns.run([*prefix, self._iptables, "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", "0"])

    def _add_namespace(self, name: str) -> None:
        netns.run(["ip", "netns", "add", name])
        netns.run(["ip", "-n", name, "link", "set", "lo", "up"])
        # IPv6 off: no router solicitations or DAD chatter on the emulated links.
        netns.run(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])

    @staticmethod
    def _shape(ns: str, dev: str, rate_mbit: float, queue_ms: float) -> None:
        base = ["tc", "-n", ns, "qdisc"]
        if rate_mbit <= 0:
            netns.run([*base, "del", "dev", dev, "root"], check=False)
            return
        rate_bytes_s = rate_mbit * 1e6 / 8
        # The bucket holds 4 ms at the link's rate, at least two 16 KiB segments: smaller
        # buckets make tbf split GSO packets into many tiny bursts and undershoot the rate.
        burst = max(32768, int(rate_bytes_s * 0.004))
        netns.run([*base, "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit * 1000:.0f}kbit",
                   "burst", str(burst), "latency", f"{queue_ms:g}ms"])  # fmt: skip

    def _program(self, links: Mapping[tuple[str, str], LinkParams]) -> None:
        assert self._delayer is not None
        self._delayer.set_links(
            {(self.hosts[a].index, self.hosts[b].index): p for (a, b), p in links.items()}
        )

    def close(self) -> None:
        """Remove everything this emulator made. Safe to call twice; errors are collected and raised last."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors: list[str] = []
            for proc, sock in self._forwarders:
                sock.close()
                _end(proc)
            self._forwarders.clear()
            names = [h.netns for h in self.hosts.values()]
            names += [netns.ns_name(self._pid, self._seq, n) for n in self._placement if n not in self.hosts]
            for name in names:
                try:
                    netns.delete_namespace(name)
                except WanError as err:
                    errors.append(str(err))
            if self._delayer is not None:
                self._delayer.close()
            try:
                netns.delete_namespace(self.router_netns)
            except WanError as err:
                errors.append(str(err))
            if self._record is not None:
                self._record.unlink(missing_ok=True)
            if errors:
                raise WanSetupError("teardown incomplete: " + "; ".join(errors))

    # ---- hosts and processes ----

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise WanError(f"no host {name!r} (hosts: {', '.join(self.hosts)})") from None

    def address(self, name: str) -> str:
        return self.host(name).address

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``name`` (the process keeps the pid ``ip`` had)."""
        return ["ip", "netns", "exec", self.host(name).netns, *argv]

    def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen:
        """Start a process inside host ``name``; stop it by its pid (whatever is left at close is killed)."""
        self._check_open()
        return subprocess.Popen(self.argv(name, argv), env=dict(env) if env is not None else None, **popen)

    def call(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in this process from inside host ``name`` (its sockets live there)."""
        self._check_open()
        return netns.call_in_namespace(self.host(name).netns, fn, *args, **kwargs)

    def forward(self, name: str, port: int, *, via: str | None = None, listen_port: int = 0) -> int:
        """A loopback port of the root namespace that reaches ``name``'s ``port`` across the WAN.

        Connections enter the WAN at host ``via`` (default: ``client`` if there is one, else
        ``name`` itself, i.e. without WAN delay). Returns the local port (``listen_port`` 0: any)."""
        with self._lock:
            self._check_open()
            if len(self._forwarders) >= MAX_FORWARDERS:
                raise WanError(f"at most {MAX_FORWARDERS} forwarders per emulation")
            entry = via or ("client" if "client" in self.hosts else name)
            target = f"{self.address(name)}:{port}"
            self.host(entry)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", listen_port))
                except OSError as err:
                    raise WanError(
                        f"cannot listen on 127.0.0.1:{listen_port} for the forwarder: {err}"
                    ) from err
                sock.listen(128)
                fd = sock.fileno()
                argv = [sys.executable, "-m", "sim.wan.forward", "--listen-fd", str(fd), "--to", target]
                proc = subprocess.Popen(
                    self.argv(entry, argv), stdin=subprocess.PIPE, pass_fds=(fd,), cwd=_package_root()
                )
            except BaseException:
                sock.close()
                raise
            self._forwarders.append((proc, sock))
            return sock.getsockname()[1]

    # ---- live changes ----

    def link(self, src: str, dst: str) -> LinkParams:
        with self._lock:
            return self._links[(self.host(src).name, self.host(dst).name)]

    def set_link(
        self,
        src: str,
        dst: str,
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        loss_pct: float | None = None,
        both_ways: bool = True,
    ) -> None:
        """Change the path between two hosts now (packets already held keep their due time)."""
        with self._lock:
            self._check_open()
            if self.host(src) == self.host(dst):
                raise WanError("a host's traffic to itself never crosses the WAN")
            pairs = [(src, dst), (dst, src)] if both_ways else [(src, dst)]
            changed = {}
            for pair in pairs:
                old = self._links[pair]
                changed[pair] = LinkParams(
                    delay_ms=old.delay_ms if delay_ms is None else delay_ms,
                    jitter_ms=old.jitter_ms if jitter_ms is None else jitter_ms,
                    loss_pct=old.loss_pct if loss_pct is None else loss_pct,
                )
            self._program(changed)
            self._links.update(changed)

    def set_host_delay(self, name: str, delay_ms: float, *, jitter_ms: float | None = None) -> None:
        """Every path to and from host ``name`` gets this one-way delay (a node that moved far away)."""
        with self._lock:
            for other in self.hosts:
                if other != name:
                    self.set_link(name, other, delay_ms=delay_ms, jitter_ms=jitter_ms)

    def set_rate(
        self, name: str, *, uplink_mbit: float | None = None, downlink_mbit: float | None = None
    ) -> None:
        """Change a host's access rates now (0 = unlimited)."""
        with self._lock:
            self._check_open()
            host = self.host(name)
            region = self.profile.regions[host.region]
            up = host.uplink_mbit if uplink_mbit is None else uplink_mbit
            down = host.downlink_mbit if downlink_mbit is None else downlink_mbit
            for value in (up, down):
                if value < 0 or (0 < value < 0.01) or value > 100_000:
                    raise ProfileError(f"rate {value} Mbit/s: 0 (unlimited) or 0.01..100000")
            self._shape(host.netns, "eth0", up, region.queue_ms)
            self._shape(self.router_netns, f"h{host.index}", down, region.queue_ms)
            self.hosts[name] = replace(host, uplink_mbit=up, downlink_mbit=down)

    # ---- observation ----

    def delayer_stats(self) -> DelayerStats:
        self._check_open()
        assert self._delayer is not None
        return self._delayer.stats()

    def reset_stats(self) -> None:
        self._check_open()
        assert self._delayer is not None
        self._delayer.reset()

    def statistics(self) -> WanStatistics:
        with self._lock:
            return WanStatistics(
                hosts=len(self.hosts),
                links=len(self._links),
                forwarders=len(self._forwarders),
                delayer=self.delayer_stats(),
            )

    def namespaces(self) -> list[str]:
        return [self.router_netns, *(h.netns for h in self.hosts.values())]

    def _check_open(self) -> None:
        if not self._started or self._closed or self._delayer is None:
            raise WanError("the emulator is not running (use it inside `with WanEmulator(...)`)")


def _package_root() -> str:
    """The directory that holds the ``sim`` package (the forwarder runs as ``-m sim.wan.forward``)."""
    return str(Path(__file__).resolve().parents[2])


def _end(proc: subprocess.Popen) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(3)
