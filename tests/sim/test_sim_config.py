"""Scenario files: strict parsing, and every bundled scenario is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.des.config import ScenarioError, load_scenario, parse_scenario

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "sim" / "scenarios").glob("*.toml"))


def test_bundled_scenarios_parse() -> None:
    assert len(SCENARIOS) >= 4
    for path in SCENARIOS:
        sc = load_scenario(path)
        assert sc.run.duration_s > 0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"run": {"seeed": 1}}, "unknown key"),
        ({"bogus": {}}, "unknown key"),
        ({"nodes": {"profiles": [{"profile": "cpu-1t", "shares": 1}]}}, "unknown key"),
        ({"run": {"duration_s": "long"}}, "expected a number"),
        ({"nodes": {"initial": 2.5}}, "expected an integer"),
        ({"nodes": {"profiles": [{"profile": "quantum"}]}}, "unknown hardware profile"),
        ({"policy": {"routing": "psychic"}}, "policy.routing"),
        ({"network": {"preset": "mars"}}, "network.preset"),
    ],
)
def test_bad_scenarios_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(data)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    p = tmp_path / "s.toml"
    p.write_text('[run]\nname = "x"\n[workload]\nrate = 3\n')
    with pytest.raises(ScenarioError, match="rate"):
        load_scenario(p)
