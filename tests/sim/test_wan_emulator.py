"""The emulated WAN with real namespaces, real kernel TCP/UDP and the real delayer (needs root).

Timing assertions are bounds a loaded 2-core CI machine keeps: a delay is at
least the configured one (less 0.1 ms per hop: the delayer may release up to
50 us early when its timer wake-ups run late) and not absurdly more. The
precise accuracy is measured by ``python -m sim.wan.bench``, not asserted here.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from sim.cli import main as sim_cli
from sim.wan import netns, probes
from sim.wan.emulator import WanEmulator
from sim.wan.errors import WanError
from sim.wan.profile import ProfileError, parse_profile
from sim.wan.support import check_support, unavailable_reason

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.slow,  # network namespaces, ip/tc/iptables commands and the delayer process
    pytest.mark.skipif(REASON is not None, reason=f"emulated WAN unavailable: {REASON}"),
]

ROOT = Path(__file__).resolve().parents[2]
EARLY_MS = 0.1  # per hop: the delayer's early-release allowance (50 us) with margin
ABSURD_MS = 40.0  # a loaded CI machine may add this much; more means the emulator is broken


def profile(delay_ms: float = 10.0, *, uplink_mbit: float = 0, downlink_mbit: float = 0):  # noqa: ANN201
    return parse_profile(
        {
            "profile": {"name": "test"},
            "regions": {"lan": {"uplink_mbit": uplink_mbit, "downlink_mbit": downlink_mbit}},
            "paths": [{"between": ["lan", "lan"], "delay_ms": delay_ms}],
        }
    )


@pytest.fixture
def wan() -> Iterator[WanEmulator]:
    with WanEmulator(profile(10.0), {"a": "lan", "b": "lan"}) as emulator:
        yield emulator


def _root_state() -> dict[str, str]:
    """What the root namespace looks like (read only: no traffic is sent anywhere)."""
    return {
        "links": netns.run(["ip", "-o", "link", "show"]),
        "addresses": netns.run(["ip", "-o", "-4", "addr", "show"]),
        "routes": netns.run(["ip", "route", "show", "table", "all"]),
        "iptables": "\n".join(
            line
            for line in netns.run([f"{check_support().iptables}-save"]).splitlines()
            if not line.startswith("#") and not line.startswith(":")  # comments and chain counters
        ),
    }


def test_round_trip_is_at_least_the_configured_delay_and_not_absurdly_more(wan: WanEmulator) -> None:
    rtts = probes.tcp_rtts_ms(wan, "a", "b", 30)
    assert min(rtts) >= 20.0 - 2 * EARLY_MS
    assert statistics.median(rtts) < 20.0 + ABSURD_MS
    stats = wan.delayer_stats()
    assert stats.packets >= 60 and stats.lost == 0 and stats.overflow == 0


def test_one_way_delay_per_direction_and_live_changes(wan: WanEmulator) -> None:
    result = probes.udp_one_way(wan, "a", "b", 40, 0.005)
    assert result.received == 40
    assert min(result.one_way_ms) >= 10.0 - EARLY_MS and statistics.median(result.one_way_ms) < 10 + ABSURD_MS
    # Only a -> b gets slower: the round trip becomes 35 + 10.
    wan.set_link("a", "b", delay_ms=35, both_ways=False)
    assert wan.link("a", "b").delay_ms == 35 and wan.link("b", "a").delay_ms == 10
    rtts = probes.tcp_rtts_ms(wan, "a", "b", 10)
    assert min(rtts) >= 45.0 - 2 * EARLY_MS and statistics.median(rtts) < 45 + ABSURD_MS
    # A node that moves away: every path to and from it.
    wan.set_host_delay("b", 50)
    rtts = probes.tcp_rtts_ms(wan, "a", "b", 5)
    assert min(rtts) >= 100.0 - 2 * EARLY_MS and statistics.median(rtts) < 100 + ABSURD_MS


def test_loss_is_observable_and_zero_when_not_configured(wan: WanEmulator) -> None:
    clean = probes.udp_one_way(wan, "a", "b", 500, 0.0005)
    assert clean.loss_pct < 5  # a starved receiver thread could drop a few; the delayer drops none
    assert wan.delayer_stats().lost == 0
    wan.set_link("a", "b", loss_pct=30)
    lossy = probes.udp_one_way(wan, "a", "b", 1000, 0.0005)
    # Binomial sigma is 1.45 %: 20..40 % is about 7 sigma either way.
    assert 20 <= lossy.loss_pct <= 40
    assert wan.delayer_stats().lost >= 200


@pytest.mark.parametrize("direction", ["uplink", "downlink"])
def test_rate_limit_is_observable(direction: str) -> None:
    with WanEmulator(profile(2.0), {"a": "lan", "b": "lan"}) as wan:
        free = probes.tcp_bulk(wan, "a", "b", 1.0, warmup_s=0.3)
        if direction == "uplink":
            wan.set_rate("a", uplink_mbit=8)
        else:
            wan.set_rate("b", downlink_mbit=8)
        assert wan.host("a" if direction == "uplink" else "b").__getattribute__(f"{direction}_mbit") == 8
        limited = probes.tcp_bulk(wan, "a", "b", 1.5, warmup_s=0.5)
    assert limited.mbit_s <= 8 * 1.05  # goodput never exceeds the shaper's rate
    assert limited.mbit_s >= 8 * 0.3  # and a loaded machine still gets a fair share of it
    assert free.mbit_s > 3 * limited.mbit_s


def test_profile_rates_are_applied_at_start() -> None:
    with WanEmulator(profile(1.0, uplink_mbit=5), {"a": "lan", "b": "lan"}) as wan:
        limited = probes.tcp_bulk(wan, "a", "b", 1.5, warmup_s=0.5)
    assert 5 * 0.3 <= limited.mbit_s <= 5 * 1.05


def test_teardown_leaves_nothing_and_the_root_namespace_is_never_touched() -> None:
    before = _root_state()
    with WanEmulator(profile(5.0), {"a": "lan", "b": "lan", "c": "lan"}) as wan:
        names = wan.namespaces()
        assert set(names) <= set(netns.list_namespaces())
        assert _root_state() == before  # no veth, address, route or rule in the root namespace
        assert all(h.address.startswith("10.77.") for h in wan.hosts.values())
        delayer_pid = wan._delayer.proc.pid  # type: ignore[union-attr]
        sleeper = wan.spawn("c", ["sleep", "600"])
        addr = netns.run(["ip", "-n", wan.host("c").netns, "-o", "-4", "addr", "show", "dev", "eth0"])
        assert "10.77.3.2/24" in addr
        rules = netns.run(["ip", "netns", "exec", wan.router_netns, f"{check_support().iptables}-save"])
        assert "-A FORWARD -j NFQUEUE --queue-num 0" in rules
        record = netns.STATE_DIR / f"{os.getpid()}-{names[0].split('-')[2]}.json"
        assert record.exists()
    assert not set(names) & set(netns.list_namespaces())
    assert sleeper.wait(5) == -signal.SIGKILL or sleeper.returncode == -signal.SIGTERM
    assert not Path(f"/proc/{delayer_pid}").exists()
    assert not record.exists()
    assert _root_state() == before


def test_two_emulators_at_once_do_not_collide() -> None:
    with (
        WanEmulator(profile(5.0), {"a": "lan", "b": "lan"}) as one,
        WanEmulator(profile(15.0), {"a": "lan", "b": "lan"}) as two,
    ):
        assert not set(one.namespaces()) & set(two.namespaces())
        assert one.address("a") == two.address("a")  # the same addresses, in separate namespaces
        fast = statistics.median(probes.tcp_rtts_ms(one, "a", "b", 5))
        slow = statistics.median(probes.tcp_rtts_ms(two, "a", "b", 5))
    assert 10 - 2 * EARLY_MS <= fast < slow and slow >= 30 - 2 * EARLY_MS


def test_forwarder_reaches_a_service_across_the_wan_from_the_root_namespace() -> None:
    with WanEmulator(profile(10.0), {"client": "lan", "web": "lan"}) as wan:
        server = wan.spawn(
            "web",
            [sys.executable, "-m", "http.server", "0", "--bind", wan.address("web")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert server.stdout is not None
        line = server.stdout.readline().decode()  # "Serving HTTP on 10.77.2.2 port NNNN ..."
        assert " port " in line, line
        port = int(line.split(" port ")[1].split()[0])
        local = wan.forward("web", port)  # enters at "client"
        t0 = time.monotonic()
        resp = httpx.get(f"http://127.0.0.1:{local}/", timeout=10)
        elapsed_ms = (time.monotonic() - t0) * 1e3
        assert resp.status_code == 200
        # TCP handshake plus request and response: at least two round trips of 20 ms.
        assert elapsed_ms >= 40 - 4 * EARLY_MS
        assert wan.statistics().forwarders == 1


def test_crashed_owner_leftovers_are_removed_by_the_cleanup_command(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, os, signal, subprocess
        from sim.wan.emulator import WanEmulator
        from sim.wan.profile import load_profile
        wan = WanEmulator(load_profile("link-10ms"), {"a": "lan", "b": "lan"})
        wan.start()
        sleeper = wan.spawn("a", ["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(json.dumps({"namespaces": wan.namespaces(), "delayer": wan._delayer.proc.pid,
                          "sleeper": sleeper.pid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no teardown runs
        """
    )
    crash = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    left = json.loads(crash.stdout)
    assert set(left["namespaces"]) <= set(netns.list_namespaces())
    # The delayer follows its owner (its stdin closed); the service it left behind is still there.
    deadline = time.monotonic() + 10
    while Path(f"/proc/{left['delayer']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{left['delayer']}").exists()
    assert Path(f"/proc/{left['sleeper']}").exists()
    result = CliRunner().invoke(sim_cli, ["wan", "cleanup"])
    assert result.exit_code == 0, result.output
    for name in left["namespaces"]:
        assert f"removed {name}" in result.output
    assert not set(left["namespaces"]) & set(netns.list_namespaces())
    deadline = time.monotonic() + 5
    while _running(left["sleeper"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(left["sleeper"])


def _running(pid: int) -> bool:
    """Alive and not a zombie (the crashed owner's children are reaped by init eventually)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_cleanup_spares_live_runs(wan: WanEmulator) -> None:
    result = CliRunner().invoke(sim_cli, ["wan", "cleanup"])
    assert result.exit_code == 0, result.output
    assert set(wan.namespaces()) <= set(netns.list_namespaces())
    assert statistics.median(probes.tcp_rtts_ms(wan, "a", "b", 3)) >= 20 - 2 * EARLY_MS


def test_misuse_is_a_clear_error(wan: WanEmulator) -> None:
    with pytest.raises(WanError, match="no host 'zz'"):
        wan.set_link("a", "zz", delay_ms=1)
    with pytest.raises(WanError, match="itself"):
        wan.set_link("a", "a", delay_ms=1)
    with pytest.raises(ProfileError, match="jitter_ms"):
        wan.set_link("a", "b", jitter_ms=50)
    with pytest.raises(ProfileError, match="rate"):
        wan.set_rate("a", uplink_mbit=-1)
    with pytest.raises(ProfileError, match="unknown region"):
        WanEmulator(profile(), {"a": "mars"})
    idle = WanEmulator(profile(), {"a": "lan"})
    with pytest.raises(WanError, match="not running"):
        idle.spawn("a", ["true"])
    wan.close()
    with pytest.raises(WanError, match="not running"):
        wan.set_link("a", "b", delay_ms=1)
    wan.close()  # twice is fine
