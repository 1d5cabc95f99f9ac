"""WAN profiles: regions, the one-way paths between them, and where each service sits.

A profile is a TOML file (standard-library ``tomllib``); bundled ones live in
``sim/wan/profiles/`` and are named by their file stem. Pure: no I/O beyond
reading the file, no processes, nothing of the network.

Model. Every emulated host sits in one region. A packet from host A to host B
travels A's uplink (rate-limited by A's region ``uplink_mbit``), then the path
from A's region to B's region (one-way ``delay_ms``, ``jitter_ms`` uniform in
[-jitter, +jitter], ``loss_pct``), then B's downlink (``downlink_mbit``). So
"10 ms per link" is one region whose path to itself has ``delay_ms = 10``:
every host-to-host hop takes 10 ms one way, 20 ms round trip.

Invariants checked here, so the emulator never guesses:
- every ordered pair of regions has exactly one path (a missing pair is an
  error, never a silent zero delay);
- units are in the key names (``_ms``, ``_pct``, ``_mbit``), every value is in
  range (delay 0-60 000 ms, jitter at most the delay, loss 0-100 %, rates 0 =
  unlimited or 0.01-100 000 Mbit/s, shaper queue 1-10 000 ms);
- an unknown key anywhere is an error (a typo cannot fall back to a default);
- the placement names only regions that exist.

File format::

    [profile]
    name = "three-regions"
    description = "..."

    [regions.eu]
    uplink_mbit = 500        # 0 or absent: unlimited
    downlink_mbit = 500
    queue_ms = 50            # how much the rate shaper buffers before it drops

    [[paths]]
    between = ["eu", "us"]   # both directions; or from = "eu", to = "us" for one
    delay_ms = 40
    jitter_ms = 1
    loss_pct = 0

    [placement]
    tracker = "eu"
    gateway = "eu"
    client = "eu"            # where the OpenAI client's traffic enters (see docs/wan.md)
    nodes = ["eu", "us", "asia"]   # node i goes to nodes[i % len(nodes)]
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sim.wan.errors import ProfileError

MAX_DELAY_MS = 60_000.0
MAX_RATE_MBIT = 100_000.0
MAX_HOSTS = 254  # host h owns 10.77.h.0/24, h = 1..254
HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
RESERVED_HOST_NAMES = frozenset({"router"})


@dataclass(frozen=True)
class LinkParams:
    """One direction of a path: what every packet from one host to another goes through."""

    delay_ms: float = 0.0  # one-way propagation delay
    jitter_ms: float = 0.0  # each packet's delay is uniform in [delay - jitter, delay + jitter]
    loss_pct: float = 0.0  # share of packets dropped, independently per packet

    def __post_init__(self) -> None:
        _check_range("delay_ms", self.delay_ms, 0.0, MAX_DELAY_MS)
        _check_range("jitter_ms", self.jitter_ms, 0.0, self.delay_ms)
        _check_range("loss_pct", self.loss_pct, 0.0, 100.0)


@dataclass(frozen=True)
class Region:
    """Where hosts sit: the access links of every host placed in it."""

    name: str
    uplink_mbit: float = 0.0  # each host's sending rate; 0 = unlimited
    downlink_mbit: float = 0.0  # each host's receiving rate; 0 = unlimited
    queue_ms: float = 50.0  # the rate shaper's buffer, in time at the link's rate

    def __post_init__(self) -> None:
        for key in ("uplink_mbit", "downlink_mbit"):
            value = getattr(self, key)
            if value != 0:
                _check_range(f"regions.{self.name}.{key}", value, 0.01, MAX_RATE_MBIT)
        _check_range(f"regions.{self.name}.queue_ms", self.queue_ms, 1.0, 10_000.0)


@dataclass(frozen=True)
class Placement:
    """The region of each service; node i sits in ``nodes[i % len(nodes)]``."""

    tracker: str
    gateway: str
    client: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class WanProfile:
    name: str
    description: str
    regions: Mapping[str, Region]
    paths: Mapping[tuple[str, str], LinkParams]  # (from region, to region), every ordered pair
    placement: Placement

    def path(self, src_region: str, dst_region: str) -> LinkParams:
        try:
            return self.paths[(src_region, dst_region)]
        except KeyError:
            raise ProfileError(
                f"profile {self.name!r} has no region pair {src_region!r} -> {dst_region!r}"
            ) from None

    def rtt_ms(self, region_a: str, region_b: str) -> float:
        """The configured round trip between hosts of two regions (delays only, no queueing)."""
        return self.path(region_a, region_b).delay_ms + self.path(region_b, region_a).delay_ms

    def place(self, n_nodes: int) -> dict[str, str]:
        """Host name -> region for tracker, gateway, client and ``node1..nodeN`` (in that order)."""
        if n_nodes < 0 or n_nodes + 3 > MAX_HOSTS:
            raise ProfileError(f"between 0 and {MAX_HOSTS - 3} nodes fit one emulation, not {n_nodes}")
        p = self.placement
        hosts = {"tracker": p.tracker, "gateway": p.gateway, "client": p.client}
        for i in range(n_nodes):
            hosts[f"node{i + 1}"] = p.nodes[i % len(p.nodes)]
        return hosts

    def check_hosts(self, hosts: Mapping[str, str]) -> None:
        """Raise :class:`ProfileError` unless ``hosts`` (name -> region) fits this profile."""
        if not hosts:
            raise ProfileError("an emulation needs at least one host")
        if len(hosts) > MAX_HOSTS:
            raise ProfileError(f"at most {MAX_HOSTS} hosts fit one emulation, not {len(hosts)}")
        for name, region in hosts.items():
            check_host_name(name)
            if region not in self.regions:
                raise ProfileError(
                    f"host {name!r}: unknown region {region!r} (profile has {sorted(self.regions)})"
                )


def check_host_name(name: str) -> None:
    if not isinstance(name, str) or not HOST_NAME.match(name) or name in RESERVED_HOST_NAMES:
        raise ProfileError(
            f"host name {name!r}: lowercase letter first, then up to 23 of a-z 0-9 '-'; 'router' is reserved"
        )


def _check_range(key: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ProfileError(f"{key} must be a number in [{low:g}, {high:g}], not {value!r}")


def _take(
    table: Mapping[str, Any], where: str, allowed: dict[str, type | tuple[type, ...]]
) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise ProfileError(f"{where} must be a table")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown} (known: {sorted(allowed)})")
    out = {}
    for key, value in table.items():
        kinds = allowed[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ProfileError(f"{where}.{key}: wrong type {type(value).__name__}")
        out[key] = float(value) if kinds == (int, float) else value  # type: ignore[arg-type]  # value: int | float here
    return out


_NUMBER = (int, float)


def parse_profile(data: Mapping[str, Any], *, default_name: str = "unnamed") -> WanProfile:
    """Build a :class:`WanProfile` from parsed TOML; every problem is a :class:`ProfileError`."""
    top = _take(data, "profile file", {"profile": dict, "regions": dict, "paths": list, "placement": dict})
    meta = _take(top.get("profile", {}), "[profile]", {"name": str, "description": str})
    name = meta.get("name", default_name)

    raw_regions = top.get("regions")
    if not raw_regions:
        raise ProfileError("[regions]: at least one region is needed")
    regions: dict[str, Region] = {}
    for rname, rtable in raw_regions.items():
        if not HOST_NAME.match(rname):
            raise ProfileError(f"region name {rname!r}: lowercase letter first, then a-z 0-9 '-'")
        fields = _take(
            rtable,
            f"[regions.{rname}]",
            {"uplink_mbit": _NUMBER, "downlink_mbit": _NUMBER, "queue_ms": _NUMBER},
        )
        regions[rname] = Region(name=rname, **fields)

    paths: dict[tuple[str, str], LinkParams] = {}
    for i, entry in enumerate(top.get("paths", [])):
        where = f"[[paths]] #{i + 1}"
        fields = _take(
            entry,
            where,
            {
                "between": list,
                "from": str,
                "to": str,
                "delay_ms": _NUMBER,
                "jitter_ms": _NUMBER,
                "loss_pct": _NUMBER,
            },
        )
        between = fields.pop("between", None)
        src, dst = fields.pop("from", None), fields.pop("to", None)
        if between is not None and (src is not None or dst is not None):
            raise ProfileError(f"{where}: give either between = [a, b] or from/to, not both")
        if between is not None:
            if len(between) != 2 or not all(isinstance(r, str) for r in between):
                raise ProfileError(f"{where}: between must name two regions")
            pairs = {(between[0], between[1]), (between[1], between[0])}
        elif src is not None and dst is not None:
            pairs = {(src, dst)}
        else:
            raise ProfileError(f"{where}: needs between = [a, b] or both from and to")
        try:
            link = LinkParams(**fields)
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None
        for pair in sorted(pairs):
            for region in pair:
                if region not in regions:
                    raise ProfileError(f"{where}: unknown region {region!r} (profile has {sorted(regions)})")
            if pair in paths:
                raise ProfileError(f"{where}: path {pair[0]} -> {pair[1]} is given twice")
            paths[pair] = link
    missing = [f"{a} -> {b}" for a in regions for b in regions if (a, b) not in paths]
    if missing:
        raise ProfileError(f"[[paths]]: no path for {', '.join(missing)} (every region pair needs one)")

    raw_place = _take(
        top.get("placement", {}),
        "[placement]",
        {"tracker": str, "gateway": str, "client": str, "nodes": list},
    )
    first = next(iter(regions))
    nodes = tuple(raw_place.get("nodes", [first]))
    if not nodes:
        raise ProfileError("[placement].nodes: at least one region")
    placement = Placement(
        tracker=raw_place.get("tracker", first),
        gateway=raw_place.get("gateway", first),
        client=raw_place.get("client", raw_place.get("gateway", first)),
        nodes=nodes,
    )
    for role in ("tracker", "gateway", "client"):
        if getattr(placement, role) not in regions:
            raise ProfileError(f"[placement].{role}: unknown region {getattr(placement, role)!r}")
    for region in nodes:
        if not isinstance(region, str) or region not in regions:
            raise ProfileError(f"[placement].nodes: unknown region {region!r}")
    return WanProfile(name, meta.get("description", ""), regions, paths, placement)


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped in ``sim/wan/profiles``."""
    folder = resources.files("sim.wan").joinpath("profiles")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> WanProfile:
    """A profile file, or a bundled profile by name (``three-regions``, ``link-10ms``, ...)."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as err:
            raise ProfileError(f"cannot read profile {path}: {err}") from err
        stem = path.stem
    else:
        res = resources.files("sim.wan").joinpath("profiles", f"{name_or_path}.toml")
        if not res.is_file():
            raise ProfileError(
                f"no profile {str(name_or_path)!r}: bundled ones are {', '.join(bundled_profiles())}"
            )
        text = res.read_text()
        stem = str(name_or_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"profile {stem}: not valid TOML: {err}") from err
    return parse_profile(data, default_name=stem)
