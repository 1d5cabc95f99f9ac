"""What a model name resolves to (tracker/names.py, pure): registered names to their fingerprint only,
unregistered ones only by nodes that earned trust -- fresh keys move nothing (issue 27)."""

from __future__ import annotations

import pytest

from tracker.names import resolve_names
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot

REAL, HIJACK, OTHER = "a" * 64, "b" * 64, "c" * 64
NAME = "SmolLM2 135M"


def shard(node: int, fp: str, *, trusted: bool, start: int = 0, end: int = 30) -> ShardView:
    return ShardView(f"{node:064x}", fp, start, end, 10.0, 100.0, trusted=trusted)


def snap(shards: list[ShardView], registered: dict[str, str] | None = None) -> SwarmSnapshot:
    models = tuple(ModelInfo(fp, NAME, 30, 576) for fp in (REAL, HIJACK)) + (
        ModelInfo(OTHER, "other", 30, 576),
    )
    return SwarmSnapshot(models=models, shards=tuple(shards), registered_names=registered or {})


def test_fresh_keys_outnumbering_trusted_holders_move_nothing() -> None:
    shards = [shard(1, REAL, trusted=True, end=15), shard(2, REAL, trusted=True, start=15)]
    shards += [shard(10 + i, HIJACK, trusted=False) for i in range(4)]
    r = resolve_names(snap(shards))[NAME]
    assert (r.fingerprint, r.registered, r.trusted_shards, r.candidates) == (REAL, False, 2, 2)
    assert "trusted" in r.reason
    # The private-swarm rule counts every live shard: the four fresh keys would win there.
    assert resolve_names(snap(shards), "any")[NAME].fingerprint == HIJACK


def test_a_name_without_trusted_holders_resolves_to_nothing_and_says_why() -> None:
    shards = [shard(1, REAL, trusted=False), shard(2, HIJACK, trusted=False)]
    r = resolve_names(snap(shards))[NAME]
    assert r.fingerprint == "" and "no node that earned trust" in r.reason and "model add" in r.reason


def test_a_registered_name_resolves_to_its_fingerprint_whoever_holds_what() -> None:
    shards = [shard(10 + i, HIJACK, trusted=True) for i in range(4)]
    r = resolve_names(snap(shards, {NAME: REAL}))[NAME]
    assert (r.fingerprint, r.registered) == (REAL, True) and "registered" in r.reason


def test_ties_go_to_the_smaller_fingerprint_and_modes_are_checked() -> None:
    shards = [shard(1, HIJACK, trusted=True), shard(2, REAL, trusted=True)]
    assert resolve_names(snap(shards))[NAME].fingerprint == REAL
    assert resolve_names(snap(list(reversed(shards))))[NAME].fingerprint == REAL
    with pytest.raises(ValueError, match="mode"):
        resolve_names(snap(shards), "most")
