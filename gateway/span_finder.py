"""Finding a replacement for a failed stage: a live node with exactly the same layers (tracker look-up).

Used by :class:`gateway.recovery.RecoveryPolicy`. Asks the tracker for fresh
routes that avoid every node this session already lost (the tracker may not
have expired them yet), and takes the first hop with the failed stage's exact
span whose ``Info`` answers (asked afresh, within :data:`PROBE_S`) and
matches; the ticket of that hop's route names the node for those layers,
which is all the node checks.
"""

from __future__ import annotations

import trio

from gateway.errors import StageFailed
from gateway.recovery import NoSameSpan, Replacement, ReplacementFinder
from gateway.routes import NodeInfoCache, RouteCache

LOOKUPS = 3  # tracker look-ups per replacement (each drops candidates that did not answer)
PROBE_S = 3.0  # a candidate's Info must answer this fast (a live node answers in milliseconds)


def span_finder(routes: RouteCache, infos: NodeInfoCache, model: str, fingerprint: str) -> ReplacementFinder:
    async def find(start: int, end: int, exclude: frozenset[str]) -> Replacement:
        avoid = set(exclude)
        problems: list[str] = []
        for _lookup in range(LOOKUPS):
            fresh = await routes.fetch_excluding(model, frozenset(avoid))  # NoRoute names uncovered layers
            routes.invalidate(model)  # the cached routes may still list the failed node
            candidates = 0
            for route in fresh.routes:
                for hop in route.hops:
                    if (hop.start, hop.end) != (start, end) or hop.node_id in avoid:
                        continue
                    candidates += 1
                    # A fresh Info, briefly: a cached one says nothing about whether the node still
                    # answers, and a node that died a moment ago is still live at the tracker.
                    infos.forget(hop)
                    info = None
                    with trio.move_on_after(PROBE_S):
                        try:
                            info = await infos.get(hop, fingerprint)
                        except StageFailed as err:
                            problems.append(err.message)
                    if info is None:
                        # Dead (or too slow) but not yet expired at the tracker: ask again without it.
                        infos.forget(hop)
                        avoid.add(hop.node_id)
                        if not problems or hop.node_id[:8] not in problems[-1]:
                            problems.append(
                                f"node {hop.node_id[:8]} did not answer Info within {PROBE_S:g} s"
                            )
                        continue
                    return Replacement(hop=hop, info=info, ticket=route.ticket)
            if not candidates:
                spans = sorted({(h.start, h.end) for r in fresh.routes for h in r.hops})
                detail = f" ({'; '.join(problems)})" if problems else ""
                raise NoSameSpan(
                    f"no live node serves exactly layers [{start}, {end}) (live spans: {spans}){detail}"
                )
        raise NoSameSpan(f"no answering node for layers [{start}, {end}): {'; '.join(problems)}")

    return find
