"""Which shards may share a route: one runtime recipe per route (pure).

The stages of a route must run one runtime recipe (proto/recipe.py: the llama.cpp build, the ggml
backend, the KV type, flash attention): a node refuses a session whose frames carry another
recipe's fingerprint, so a mixed route would fail at OPEN after the tracker handed it out. The
CPU features are *not* part of that fingerprint: nodes of one build on other CPUs compose a
correct route, and the gateway's checks compare them with the calibrated tolerance
(gateway/checks.py ``Tolerance``) instead of bit for bit.

The tracker learns a node's recipe from its join challenge (the node's Info,
``ShardView.recipe_fingerprint``); a node it could not dial (relayed) or has not challenged yet
has none known and may join a route of any recipe, as before.

:func:`recipe_exclusions` splits a model's shards by recipe: for each recipe, the nodes of the
other recipes. routing.select_routes searches once per recipe with those nodes excluded and keeps
the cheapest routes of all; with one recipe (every swarm of one build) nothing changes and the
split costs one look-up in the snapshot's memo.
"""

from __future__ import annotations

from tracker.snapshot import SwarmSnapshot


def recipe_exclusions(snapshot: SwarmSnapshot, model_fingerprint: str) -> tuple[frozenset[str], ...]:
    """For each known recipe of the model's shards (sorted by fingerprint), the node ids serving
    the model under another known recipe; () when the shards know at most one recipe. Kept in the
    snapshot's memo: computed once per snapshot and model."""
    key = ("recipes.exclusions", model_fingerprint)
    found = snapshot.memo.get(key)
    if isinstance(found, tuple):
        return found
    by_recipe: dict[str, set[str]] = {}
    for shard in snapshot.shards:
        if shard.model_fingerprint == model_fingerprint and shard.recipe_fingerprint:
            by_recipe.setdefault(shard.recipe_fingerprint, set()).add(shard.node_id)
    result: tuple[frozenset[str], ...] = ()
    if len(by_recipe) > 1:
        result = tuple(
            frozenset(n for other, nodes in by_recipe.items() if other != recipe for n in nodes)
            for recipe in sorted(by_recipe)
        )
    snapshot.memo[key] = result
    return result
