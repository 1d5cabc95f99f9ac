"""Routes by free KV at the gateway: each hop's announced free KV, and which routes can hold a request."""

from __future__ import annotations

from gateway.admission import fits_kv, kv_room
from gateway.routes import parse_routes


def _answer(*free: object) -> dict:
    hops = [
        {"node_id": f"n{i}", "start": 15 * i, "end": 15 * i + 15, "address": f"h:{i}", "kv_free_tokens": f}
        for i, f in enumerate(free)
    ]
    route = {"hops": hops, "ticket": {"payload": "x"}, "expires_at": 1e10, "expected_ms_per_token": 1.0}
    return {"model": {"fingerprint": "ab" * 32, "name": "m", "n_layers": 30}, "routes": [route]}


def test_hops_carry_the_free_kv_the_tracker_saw() -> None:
    hops = parse_routes(_answer(4096, None), 0.0).routes[0].hops
    assert [h.kv_free_tokens for h in hops] == [4096, None]
    # Nonsense is "not known", never a number the gateway would trust.
    for bad in (-5, "many", True, 1.5):
        assert parse_routes(_answer(bad, 1), 0.0).routes[0].hops[0].kv_free_tokens is None
    old = _answer(1, 2)
    for hop in old["routes"][0]["hops"]:
        del hop["kv_free_tokens"]  # a tracker from before the field
    assert [h.kv_free_tokens for h in parse_routes(old, 0.0).routes[0].hops] == [None, None]


def test_the_tightest_stage_decides_and_unknown_stages_are_trusted() -> None:
    assert kv_room([8192, 2048]) == 2048
    assert kv_room([None, 3000]) == 3000
    assert kv_room([None, None]) is None and kv_room([]) is None
    assert fits_kv([8192, 6016], 6000) and not fits_kv([8192, 5999], 6000)
    assert fits_kv([None, None], 10**6)  # nothing announced: the nodes decide
    assert not fits_kv([None, 100], 101)
