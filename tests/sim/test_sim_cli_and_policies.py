"""The command line, and that the "tracker" policies call the tracker's real functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from simcases import small_scenario

import sim.des.policies as policies
from sim.cli import main, parse_policy
from sim.des.simulator import run

LAN = str(Path(__file__).resolve().parents[2] / "sim" / "scenarios" / "lan_small.toml")


@pytest.mark.slow  # a whole simulation and its plots
def test_run_writes_json_and_plots(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["run", LAN, "--duration-s", "40", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["requests"]["conserved"]
    assert data["performance"]["events_per_s"] > 0
    assert (tmp_path / "timeseries.png").stat().st_size > 0
    assert (tmp_path / "coverage.png").stat().st_size > 0
    assert "events/s" in res.output


def compare(out: Path, policy_b: str, *extra: str) -> tuple[str, dict]:
    """``swarm-sim compare`` of the LAN scenario for 40 s, ours against ``policy_b``: (output, JSON)."""
    argv = ["compare", LAN, "--policy-a", "ours", "--policy-b", policy_b, "--duration-s", "40"]
    res = CliRunner().invoke(main, [*argv, *extra, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return res.output, json.loads((out / "compare.json").read_text())


@pytest.mark.slow  # two whole simulations and their plots
def test_compare_writes_both_sides(tmp_path: Path) -> None:
    _, data = compare(tmp_path, "nearest-routing")
    assert set(data["key_figures"]) == {"ours", "nearest-routing"}
    assert data["policies"]["nearest-routing"] == {"placement": "tracker", "routing": "nearest"}
    assert (tmp_path / "compare.png").exists()


def test_compare_set_b_changes_only_side_b(tmp_path: Path) -> None:
    push, relay = "gateway.data_plane='push'", "gateway.data_plane='relay'"
    output, data = compare(tmp_path, "blind-routing", "--set", push, "--set-b", relay, "--no-plots")
    assert set(data["key_figures"]) == {"A:ours", "B:blind-routing"}
    assert data["overrides"] == {"both": [push], "b": [relay]}
    planes = {k: r["data_plane"] for k, r in data["results"].items()}
    assert planes == {"A:ours": "push", "B:blind-routing": "relay"}
    assert f"also ran with: {relay}" in output


def test_bad_scenario_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[run]\nnme = 'x'\n")
    res = CliRunner().invoke(main, ["run", str(p)])
    assert res.exit_code != 0
    assert "unknown key" in res.output


def test_parse_policy() -> None:
    assert parse_policy("ours") == ("tracker", "tracker")
    assert parse_policy("baseline") == ("random", "nearest")
    assert parse_policy("placement=random") == ("random", "tracker")
    assert parse_policy("routing=nearest,placement=tracker") == ("tracker", "nearest")


def test_ours_calls_the_tracker(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = {"select": 0, "place": 0}
    real_select, real_place = policies.select_routes, policies.recommend_span

    def select(*a, **kw):  # type: ignore[no-untyped-def]
        calls["select"] += 1
        return real_select(*a, **kw)

    def place(*a, **kw):  # type: ignore[no-untyped-def]
        calls["place"] += 1
        return real_place(*a, **kw)

    monkeypatch.setattr(policies, "select_routes", select)
    monkeypatch.setattr(policies, "recommend_span", place)
    assert real_select.__module__ == "tracker.routing" and real_place.__module__ == "tracker.placement"
    run(small_scenario(run={"duration_s": 30.0}))
    assert calls["place"] == 6 and calls["select"] > 0
    calls.update(select=0, place=0)
    run(small_scenario(run={"duration_s": 30.0}, policy={"placement": "random", "routing": "nearest"}))
    assert calls == {"select": 0, "place": 0}


def test_set_overrides_scenario_keys(tmp_path: Path) -> None:
    args = [
        "run",
        LAN,
        "--no-plots",
        "--out",
        str(tmp_path),
        "--set",
        "run.duration_s=30",
        "--set",
        "nodes.initial=3",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["duration_s"] == 30.0
    assert data["metrics"]["swarm"]["joins"] == 3
    res = CliRunner().invoke(
        main, ["run", LAN, "--no-plots", "--out", str(tmp_path), "--set", "nodes.inital=3"]
    )
    assert res.exit_code != 0 and "unknown key" in res.output


def test_route_latency_bound_holds_requests_back() -> None:
    free = run(small_scenario(run={"duration_s": 60.0}))
    # Routes of this swarm cost ~17 ms per token; a 1 ms bound admits none of them.
    bounded = run(small_scenario(run={"duration_s": 60.0}, gateway={"max_route_ms_per_token": 1.0}))
    assert free["requests"]["completed"] > 0
    assert bounded["requests"]["completed"] == 0
    assert bounded["requests"]["conserved"]
