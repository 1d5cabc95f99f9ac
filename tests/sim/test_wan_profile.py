"""WAN profiles (pure): the bundled ones, every rejection, placement, and a round-trip property."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.wan.profile import (
    MAX_HOSTS,
    LinkParams,
    ProfileError,
    bundled_profiles,
    check_host_name,
    load_profile,
    parse_profile,
)

BASE: dict[str, Any] = {
    "profile": {"name": "t", "description": "two regions"},
    "regions": {"eu": {"uplink_mbit": 100}, "us": {}},
    "paths": [
        {"between": ["eu", "eu"], "delay_ms": 5},
        {"between": ["us", "us"], "delay_ms": 6},
        {"between": ["eu", "us"], "delay_ms": 40, "jitter_ms": 1, "loss_pct": 0.5},
    ],
    "placement": {"tracker": "eu", "gateway": "eu", "client": "us", "nodes": ["eu", "us"]},
}


def _with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return data


_DELETE = object()


def test_bundled_profiles_load_and_match_what_their_names_promise() -> None:
    assert {"three-regions", "link-10ms", "link-25ms", "link-20mbit"} <= set(bundled_profiles())
    for name in bundled_profiles():
        assert load_profile(name).name == name
    for name, delay in (("link-10ms", 10.0), ("link-25ms", 25.0)):
        p = load_profile(name)
        assert [(link.delay_ms, link.jitter_ms, link.loss_pct) for link in p.paths.values()] == [
            (delay, 0, 0)
        ]
        assert all(r.uplink_mbit == 0 and r.downlink_mbit == 0 for r in p.regions.values())
    slow = load_profile("link-20mbit")
    assert [(r.uplink_mbit, r.downlink_mbit) for r in slow.regions.values()] == [(20.0, 20.0)]


def test_three_regions_spans_10_to_150_ms_rtt_and_20_to_500_mbit() -> None:
    p = load_profile("three-regions")
    rtts = {(a, b): p.rtt_ms(a, b) for a in p.regions for b in p.regions}
    assert min(rtts.values()) == 10 and max(rtts.values()) == 150
    assert all(rtts[(a, b)] == rtts[(b, a)] for a, b in rtts)
    ups = [r.uplink_mbit for r in p.regions.values()]
    assert min(ups) == 20 and max(ups) == 500
    hosts = p.place(5)
    assert list(hosts) == ["tracker", "gateway", "client", "node1", "node2", "node3", "node4", "node5"]
    assert [hosts[f"node{i}"] for i in range(1, 6)] == ["eu", "us", "asia", "eu", "us"]


def test_between_is_symmetric_and_from_to_is_one_way() -> None:
    p = parse_profile(BASE)
    assert p.path("eu", "us") == p.path("us", "eu") == LinkParams(40, 1, 0.5)
    data = _with(
        paths=[
            *BASE["paths"][:2],
            {"from": "eu", "to": "us", "delay_ms": 30},
            {"from": "us", "to": "eu", "delay_ms": 50},
        ]
    )
    p = parse_profile(data)
    assert (p.path("eu", "us").delay_ms, p.path("us", "eu").delay_ms, p.rtt_ms("eu", "us")) == (30, 50, 80)


def test_defaults_when_sections_are_left_out() -> None:
    data = {"regions": {"lan": {}}, "paths": [{"between": ["lan", "lan"], "delay_ms": 1}]}
    p = parse_profile(data, default_name="file-stem")
    assert p.name == "file-stem"
    assert p.place(1) == {"tracker": "lan", "gateway": "lan", "client": "lan", "node1": "lan"}
    assert p.regions["lan"].queue_ms == 50


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_with(extra={}), "unknown key"),
        (_with(regions__eu__uplink_mbps=5), "unknown key"),
        (_with(paths__0__delay=5), "unknown key"),
        (_with(placement__relay="eu"), "unknown key"),
        (_with(paths=BASE["paths"][:2]), "no path for eu -> us, us -> eu"),
        (_with(paths=[*BASE["paths"], {"between": ["us", "eu"], "delay_ms": 1}]), "given twice"),
        (_with(paths__2__jitter_ms=41), "jitter_ms"),
        (_with(paths__2__delay_ms=-1), "delay_ms"),
        (_with(paths__2__delay_ms=60_001), "delay_ms"),
        (_with(paths__2__loss_pct=101), "loss_pct"),
        (_with(paths__2__delay_ms="40"), "wrong type"),
        (_with(paths__2__delay_ms=True), "wrong type"),
        (_with(regions__eu__uplink_mbit=0.001), "uplink_mbit"),
        (_with(regions__eu__queue_ms=0), "queue_ms"),
        (_with(regions={}), "at least one region"),
        (_with(regions__EU={}), "region name"),
        (_with(paths__0__between=["eu", "mars"]), "unknown region 'mars'"),
        (_with(paths__0__between=["eu"]), "two regions"),
        (_with(paths__0__from="eu"), "not both"),
        (_with(paths__0__between=_DELETE), "needs between"),
        (_with(placement__gateway="mars"), "unknown region 'mars'"),
        (_with(placement__nodes=["eu", "mars"]), "unknown region 'mars'"),
        (_with(placement__nodes=[]), "at least one region"),
        (_with(regions=[1]), "wrong type"),
    ],
)
def test_malformed_profiles_are_rejected_with_the_reason(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        parse_profile(data)


def test_files_unknown_names_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="bundled ones are .*three-regions"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.toml"
    bad.write_text("[regions\n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.toml")
    good = tmp_path / "mine.toml"
    good.write_text('[regions.x]\n[[paths]]\nbetween = ["x", "x"]\ndelay_ms = 3\n')
    assert load_profile(good).name == "mine" and load_profile(str(good)).path("x", "x").delay_ms == 3


def test_host_names_and_counts() -> None:
    p = parse_profile(BASE)
    for bad in ("Node1", "1node", "router", "", "a" * 25, "a_b"):
        with pytest.raises(ProfileError, match="host name"):
            check_host_name(bad)
    check_host_name("node-1")
    with pytest.raises(ProfileError, match="unknown region"):
        p.check_hosts({"a": "mars"})
    with pytest.raises(ProfileError, match="at least one host"):
        p.check_hosts({})
    with pytest.raises(ProfileError, match=f"at most {MAX_HOSTS}"):
        p.check_hosts({f"h{i}": "eu" for i in range(MAX_HOSTS + 1)})
    with pytest.raises(ProfileError, match="nodes fit"):
        p.place(MAX_HOSTS)
    p.check_hosts(p.place(MAX_HOSTS - 3))


_delays = st.floats(min_value=0, max_value=1000, allow_nan=False)


@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True).flatmap(
        lambda regions: st.tuples(
            st.just(regions),
            st.fixed_dictionaries({(x, y): _delays for x in regions for y in regions}),
        )
    )
)
def test_any_complete_one_way_matrix_parses_back_exactly(case: tuple[list[str], dict]) -> None:
    regions, matrix = case
    data = {
        "regions": {r: {} for r in regions},
        "paths": [{"from": x, "to": y, "delay_ms": d} for (x, y), d in matrix.items()],
    }
    p = parse_profile(data)
    assert {pair: link.delay_ms for pair, link in p.paths.items()} == matrix
    for x in regions:
        for y in regions:
            assert p.rtt_ms(x, y) == matrix[(x, y)] + matrix[(y, x)]
