"""A real two-stage swarm for client-facing tests: swarm-tracker, two swarm-node processes (one thread each)
and swarm-gateway on loopback, and the official openai client pointed at it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from swarm_fixtures import url, wait_until

from sim.procs import Service, Supervisor

SESSION_KV, BATCH = 1024, 256


@dataclass
class Swarm:
    supervisor: Supervisor
    tracker: Service
    nodes: list[Service]
    gateway: Service
    model: str  # the model's stable id (GET /v1/models)
    name: str  # the model's GGUF name

    @property
    def base(self) -> str:
        return url(self.gateway)

    def client(self, api_key: str = "test-key", **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)


@contextmanager
def two_stage_swarm(
    workdir: Path,
    model_path: Path,
    cache: Path,
    split: int,
    n_layers: int,
    *,
    max_sessions: int = 6,
    gateway_args: Sequence[str] = (),
) -> Iterator[Swarm]:
    sup = Supervisor(workdir)
    try:
        tracker = sup.start_tracker().ready(60)
        nodes = []
        for name, layers in (("a", f"0:{split}"), ("b", f"{split}:{n_layers}")):
            nodes.append(
                sup.start_node(
                    name,
                    model=model_path,
                    layers=layers,
                    tracker_url=url(tracker),
                    max_sessions=max_sessions,
                    session_kv_tokens=SESSION_KV,
                    cache_dir=cache,
                    admin=True,  # /metrics: tests read what each stage computed
                    # Sessions grow in each node's KV pool up to SESSION_KV positions: the context
                    # that the 413 and the conversations' compaction tests run into.
                    extra_args=[
                        *("--batch-tokens", str(BATCH), "--max-session-kv-tokens", str(SESSION_KV)),
                        "--no-benchmark",
                    ],
                )
            )
        nodes = [n.ready(120) for n in nodes]

        def routable() -> dict | None:
            models = httpx.get(url(tracker) + "/v1/models", timeout=10).json()["models"]
            return next((m for m in models if m.get("routable")), None)

        model = wait_until(routable, 60, "a complete route at the tracker", interval_s=0.25)
        gateway = sup.start_gateway(
            tracker_url=url(tracker), extra_args=["--max-sessions", "8", *gateway_args]
        ).ready(60)
        ids = httpx.get(url(gateway) + "/v1/models", timeout=10).json()["data"]
        yield Swarm(sup, tracker, nodes, gateway, str(ids[0]["id"]), str(model["name"]))
    finally:
        sup.stop_all()
