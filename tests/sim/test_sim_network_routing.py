"""The simulator with direct push and network coordinates: the coordinates it measures are
accurate, the push data plane conserves requests and is deterministic, and routing with
coordinates beats routing blind to distance on a world-wide swarm (simulated time, fixed seeds)."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from simcases import small_scenario

from sim.des.coords import SimCoordinates, gateway_key
from sim.des.geography import PRESETS, Geography
from sim.des.simulator import Simulation, run


def world(**overrides: object) -> dict:
    """~120 GPU volunteers on the world preset, a 64-layer model, two gateways, direct push."""
    base: dict = {
        "run": {"name": "world-test", "seed": 3, "duration_s": 600.0, "sample_interval_s": 20.0},
        "models": [
            {"name": "m", "n_layers": 64, "n_embd": 5120, "n_embd_kv": 1024, "params_per_layer_m": 500}
        ],
        "network": {
            "preset": "world",
            "access_latency_ms_min": 2.0,
            "access_latency_ms_max": 25.0,
            "gateway_regions": ["europe", "us-east"],
        },
        "nodes": {
            "initial": 120,
            "bootstrap_s": 30.0,
            "max_layers": 24,
            "heartbeat_interval_s": 10.0,
            "profiles": [{"profile": "gpu-8gb", "share": 0.6}, {"profile": "gpu-24gb", "share": 0.4}],
        },
        "workload": {
            "start_s": 150.0,
            "rate_per_s": 0.5,
            "prompt_tokens_median": 200.0,
            "output_tokens_median": 60.0,
        },
        "gateway": {"routes_k": 4, "data_plane": "push"},
    }
    for table, values in overrides.items():
        base.setdefault(table, {}).update(values)  # type: ignore[arg-type]
    return base


def test_simulated_coordinates_predict_the_geography() -> None:
    """The simulator's measurement loop and the tracker's refits: after a few minutes of
    heartbeats, predicted round trips between nodes (most never measured directly) and to
    the gateways are close to the geography's."""
    rng = random.Random(4)
    geo = Geography(PRESETS["world"], 2.0, 25.0, rng)
    gateways = [geo.place_in("europe"), geo.place_in("asia")]
    coords = SimCoordinates(geo, gateways, random.Random(5), probes_per_heartbeat=2, noise=0.1)
    where = {f"n{i:03d}": geo.place_node() for i in range(200)}
    pools = [sorted(where)[:10], sorted(where)[10:20]]
    for t in range(30):
        live = coords.sync(where)
        coords.heartbeat(10.0 * t, live, [], pools)
    errs = []
    ids = sorted(where)
    for i, a in enumerate(ids[::3]):
        for b in ids[i * 3 + 1 :: 7]:
            ca, cb = coords.coord(a), coords.coord(b)
            assert ca is not None and cb is not None
            truth = 2 * geo.one_way_ms(where[a], where[b])
            errs.append(abs(ca.rtt_ms(cb) - truth) / truth)
    assert statistics.median(errs) < 0.15
    gw = coords.coord(gateway_key(0))
    assert gw is not None
    to_gw = [
        abs(gw.rtt_ms(coords.coord(n)) - 2 * geo.one_way_ms(gateways[0], where[n]))
        / (2 * geo.one_way_ms(gateways[0], where[n]))
        for n in ids
    ]  # type: ignore[arg-type]
    assert statistics.median(to_gw) < 0.15
    # Membership follows the serving set: departed nodes are forgotten.
    coords.sync({k: v for k, v in where.items() if k != ids[0]})
    assert coords.coord(ids[0]) is None


def test_push_data_plane_conserves_and_is_deterministic() -> None:
    sc = small_scenario(
        gateway={"data_plane": "push"}, nodes={"initial": 9, "mean_uptime_s": 200.0, "join_rate_per_s": 0.05}
    )
    a, b = run(sc), run(sc)
    assert a["requests"]["conserved"] and a["requests"]["completed"] > 0
    assert a["data_plane"] == "push"
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k != "performance"}, sort_keys=True)  # noqa: E731
    assert strip(a) == strip(b)


def test_push_beats_relay_on_a_wide_area_swarm() -> None:
    """The same swarm and routes' policy: pushing between stages (and the decode ring) instead of
    relaying every hop through the gateway lowers the median time per token."""
    from sim.des.config import parse_scenario

    relay = run(parse_scenario(world(gateway={"data_plane": "relay"}, policy={"routing": "blind"})))
    push = run(parse_scenario(world(policy={"routing": "blind"})))
    assert push["metrics"]["per_token_latency_ms"]["p50"] < relay["metrics"]["per_token_latency_ms"]["p50"]


@pytest.mark.slow  # a long simulation
def test_coordinates_make_routes_regional_and_tokens_faster() -> None:
    """World-wide volunteers, gateways in Europe and US-East, direct push: the tracker's routing
    with the coordinates the simulation measured gives a lower median time per token than the
    same routing blind to distance, with every request served; its routes cross fewer
    regions."""
    from sim.des.config import parse_scenario

    ours_sim = Simulation(parse_scenario(world()))
    ours = ours_sim.run()
    blind = run(parse_scenario(world(policy={"routing": "blind"})))
    for r in (ours, blind):
        assert r["requests"]["conserved"]
        assert r["requests"]["failed"] == 0
    p50_ours = ours["metrics"]["per_token_latency_ms"]["p50"]
    p50_blind = blind["metrics"]["per_token_latency_ms"]["p50"]
    assert p50_ours * 2.0 < p50_blind, (p50_ours, p50_blind)
    assert ours_sim.coords is not None and ours_sim.coords.refits > 0
    assert ours["performance"]["coordinates_wall_s"] >= 0.0
