"""Route Sessions on nodes given by address, without a tracker: the gateway's own session code.

For benchmarks and tests that drive nodes directly (``swarm-node start
--insecure-no-tickets``, no tracker): :func:`route_on` asks each node for its
Info and builds the route; :func:`generate` runs one greedy request through
``gateway.route_session`` exactly as the gateway does (direct push or relay,
pipelined prefill, the decode ring) and returns the tokens with the time each
one arrived.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from gateway.grpc_bridge import NodeChannels
from gateway.route_session import DataPlane, open_route_session
from gateway.routes import Hop, Route, StageInfo
from proto import codec


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    arrivals_s: list[float]  # perf_counter of each token's arrival
    started_s: float  # perf_counter when the request was sent

    @property
    def ttft_s(self) -> float:
        return self.arrivals_s[0] - self.started_s

    def intervals_s(self) -> list[float]:
        """Time between consecutive tokens (decode time per token)."""
        return [b - a for a, b in zip(self.arrivals_s, self.arrivals_s[1:], strict=False)]


async def route_on(
    channels: NodeChannels, addresses: Sequence[str], pins: Sequence[str] | None = None
) -> tuple[Route, list[StageInfo]]:
    """The route through these nodes, in order (each node's Info gives its layers and recipe).

    ``pins``: each node's TLS certificate fingerprint ("" or None: plaintext)."""
    tls = list(pins) if pins is not None else [""] * len(addresses)
    infos = [await channels.info(a, pin) for a, pin in zip(addresses, tls, strict=True)]
    hops = tuple(
        Hop(i.node_id, i.shard.start, i.shard.end, a, tls_fingerprint=pin)
        for i, a, pin in zip(infos, addresses, tls, strict=True)
    )
    route = Route(
        route_id=">".join(f"{h.node_id[:8]}[{h.start}:{h.end})" for h in hops),
        model_fingerprint=infos[0].model.fingerprint,
        model_name=infos[0].model.name,
        n_layers=infos[0].model.n_layers,
        hops=hops,
        ticket=b"{}",  # nodes started with --insecure-no-tickets accept any ticket
        expires_at_s=time.time() + 3600,
        expected_ms_per_token=0.0,
    )
    stages = [
        StageInfo(
            node_id=i.node_id,
            address=a,
            recipe_fingerprint=i.recipe.fingerprint,
            n_embd=i.model.n_embd,
            n_layers=i.model.n_layers,
            n_ctx_train=i.model.n_ctx_train,
            is_last=i.is_last,
            serves_vocab=i.serves_vocab,
            max_frame_bytes=i.limits.max_frame_bytes,
            max_step_tokens=i.limits.max_step_tokens,
            max_kv_tokens_per_session=i.limits.max_kv_tokens_per_session,
            fetched_at_s=time.time(),
        )
        for i, a in zip(infos, addresses, strict=True)
    ]
    return route, stages


async def generate(
    channels: NodeChannels,
    route: Route,
    stages: Sequence[StageInfo],
    prompt: Sequence[int],
    n_new: int,
    *,
    plane: DataPlane,
    step_tokens: int = 256,
    sampling: codec.SamplingSettings | None = None,
    max_drafts: int = 0,
) -> Generation:
    """One request: ``n_new`` tokens after ``prompt`` (greedy unless ``sampling`` says otherwise);
    ``max_drafts`` > 0: speculative decoding (RouteConfig.max_drafts)."""
    tokens: list[int] = []
    arrivals: list[float] = []
    started = time.perf_counter()
    async with open_route_session(
        channels,
        route,
        stages,
        session_id=secrets.token_hex(16),
        request_id="bench",
        sampling=sampling or codec.SamplingSettings(temperature=0.0),
        kv_budget_tokens=len(prompt) + n_new - 1,
        step_tokens=step_tokens,
        max_frame_bytes=4 * 1024 * 1024,
        plane=plane,
        max_drafts=max_drafts,
    ) as session:
        started = time.perf_counter()
        await session.begin(prompt)
        while len(tokens) < n_new:
            with trio.fail_after(300):
                sampled = await session.next_token()
            arrivals.append(time.perf_counter())
            tokens.append(sampled.token_id)
            if sampled.end_of_generation:
                break
        session.finished = True
    return Generation(tokens, arrivals, started)
