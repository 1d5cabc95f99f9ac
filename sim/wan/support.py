"""Can this machine emulate a WAN? One probe per process, with the reason when not.

What is needed: root; ``ip`` and ``tc`` (iproute2); ``iptables`` with the
NFQUEUE target (nf_tables compat or legacy; package ``iptables``); a C
compiler and the kernel uapi headers (``linux-libc-dev``) for the delayer; and
a kernel with network namespaces, veth, nfnetlink_queue and the ``tbf``
qdisc. ``sch_netem`` is *not* needed. The probe builds a scratch namespace
(``swwan-<pid>-0-probe``) with a veth pair, an NFQUEUE rule and a tbf qdisc,
then deletes it.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from sim.wan import netns
from sim.wan.delayer import compile_delayer
from sim.wan.errors import WanSetupError, WanUnavailable


@dataclass(frozen=True)
class Support:
    iptables: str  # the iptables binary whose NFQUEUE target works here
    delayer: Path  # the compiled delayer


_lock = threading.Lock()
_cached: Support | WanUnavailable | None = None


def check_support() -> Support:
    """Probe once per process; raise :class:`WanUnavailable` (with the reason) if anything is missing."""
    global _cached
    with _lock:
        if _cached is None:
            try:
                _cached = _probe()
            except WanUnavailable as err:
                _cached = err
        if isinstance(_cached, WanUnavailable):
            raise _cached
        return _cached


def unavailable_reason() -> str | None:
    """None when a WAN can be emulated here, else why not (for ``pytest.skip``)."""
    try:
        check_support()
    except WanUnavailable as err:
        return err.reason
    return None


def _probe() -> Support:
    if os.geteuid() != 0:
        raise WanUnavailable("needs root (network namespaces, veth links, iptables)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if not shutil.which(tool):
            raise WanUnavailable(f"no `{tool}` on PATH (package {package})")
    candidates = [c for c in ("iptables", "iptables-legacy") if shutil.which(c)]
    if not candidates:
        raise WanUnavailable("no `iptables` on PATH (package iptables)")
    if not Path("/usr/include/linux/netfilter/nfnetlink_queue.h").exists() and not os.environ.get("CC"):
        raise WanUnavailable("no kernel headers for nfnetlink_queue (package linux-libc-dev)")
    delayer = compile_delayer()
    name = netns.ns_name(os.getpid(), 0, "probe")
    peer = netns.ns_name(os.getpid(), 0, "probe-peer")
    try:
        for ns in (name, peer):
            if (netns.NETNS_DIR / ns).exists():
                netns.delete_namespace(ns)
        try:
            netns.run(["ip", "netns", "add", name])
            netns.run(["ip", "netns", "add", peer])
        except WanSetupError as err:
            raise WanUnavailable(f"cannot create network namespaces: {err}") from err
        try:
            netns.run(
                ["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1", "netns", peer]
            )
            netns.run(["ip", "-n", name, "link", "set", "p0", "up"])
        except WanSetupError as err:
            raise WanUnavailable(f"no veth links: {err}") from err
        try:
            netns.run(["tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit",
                       "burst", "32kb", "latency", "50ms"])  # fmt: skip
        except WanSetupError as err:
            raise WanUnavailable(f"no tbf qdisc for rate limits: {err}") from err
        errors = []
        for iptables in candidates:
            try:
                netns.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        name,
                        iptables,
                        "-A",
                        "FORWARD",
                        "-j",
                        "NFQUEUE",
                        "--queue-num",
                        "0",
                    ]
                )
                return Support(iptables=iptables, delayer=delayer)
            except WanSetupError as err:
                errors.append(str(err))
        raise WanUnavailable("no iptables NFQUEUE target: " + "; ".join(errors))
    finally:
        for ns in (name, peer):
            if (netns.NETNS_DIR / ns).exists():
                netns.delete_namespace(ns)
