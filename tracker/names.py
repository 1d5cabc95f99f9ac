"""Which model a name means (pure): only the operator or nodes that earned trust can move a name.

A client asks for a model by fingerprint (its identity: the digest of its
manifest) or by name. Names are claims anyone can announce, so a name resolves:

1. *registered* -- the operator bound it (``swarm-tracker model add``): to that
   fingerprint only, whatever else is announced under it;
2. *unregistered* -- to the fingerprint that the most **trusted** live shards
   announce under it (a node is trusted once it passed the tracker's join
   challenge against trusted nodes' answers, passed ``probation_checks`` spot
   checks, or the operator runs every node unchecked: ``probation_checks`` 0;
   see :attr:`tracker.snapshot.ShardView.trusted`). Fresh keys count for
   nothing: four of them announcing another model under a real model's name
   move nothing. When no trusted node serves any model of that name, the name
   does not resolve (the models stay reachable by fingerprint);
3. with ``mode = "any"`` (a private swarm or a test harness, where every key is
   the operator's), an unregistered name resolves to the fingerprint with the
   most live shards, trusted or not.

Ties go to the smaller fingerprint, so every replica resolves alike.
Standard library only (plus ``tracker.snapshot``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tracker.snapshot import SwarmSnapshot

MODES = ("trusted", "any")


@dataclass(frozen=True)
class Resolution:
    """What ``name`` means now: ``fingerprint`` ("" when it resolves to nothing) and why."""

    name: str
    fingerprint: str
    reason: str
    registered: bool = False
    trusted_shards: int = 0  # of the winner (unregistered names)
    candidates: int = 1  # fingerprints announced under the name


def resolve_names(snap: SwarmSnapshot, mode: str = "trusted") -> dict[str, Resolution]:
    """Every name of ``snap``'s models (registered or announced) and what it resolves to."""
    if mode not in MODES:
        raise ValueError(f"name resolution mode must be one of {MODES}, not {mode!r}")
    by_name: dict[str, list[str]] = {}
    for m in snap.models:
        if m.name:
            by_name.setdefault(m.name, []).append(m.fingerprint)
    live: dict[str, int] = {}
    trusted: dict[str, int] = {}
    for s in snap.shards:
        live[s.model_fingerprint] = live.get(s.model_fingerprint, 0) + 1
        if s.trusted:
            trusted[s.model_fingerprint] = trusted.get(s.model_fingerprint, 0) + 1
    out: dict[str, Resolution] = {}
    for name, fps in by_name.items():
        bound = snap.registered_names.get(name)
        if bound is not None:
            out[name] = Resolution(
                name, bound, "registered by the operator", registered=True, candidates=len(fps)
            )
            continue
        if mode == "any":
            best = max(fps, key=lambda fp: (live.get(fp, 0), _smaller_first(fp)))
            out[name] = Resolution(
                name,
                best,
                f"not registered: the most live shards ({live.get(best, 0)}), trusted or not (mode any)",
                trusted_shards=trusted.get(best, 0),
                candidates=len(fps),
            )
            continue
        scored = [fp for fp in fps if trusted.get(fp, 0) > 0]
        if not scored:
            out[name] = Resolution(
                name,
                "",
                "not registered, and no node that earned trust serves a model of this name: ask by "
                "fingerprint, or register the name (swarm-tracker model add)",
                candidates=len(fps),
            )
            continue
        best = max(scored, key=lambda fp: (trusted[fp], _smaller_first(fp)))
        out[name] = Resolution(
            name,
            best,
            f"not registered: the most shards of trusted nodes ({trusted[best]})",
            trusted_shards=trusted[best],
            candidates=len(fps),
        )
    return out


def _smaller_first(fingerprint: str) -> tuple[int, ...]:
    """A key under which ``max`` prefers the smaller fingerprint among equals."""
    return tuple(-ord(c) for c in fingerprint)
