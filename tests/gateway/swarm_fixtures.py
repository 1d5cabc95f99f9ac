"""Shared builders for the gateway tests: a tracker process, announced nodes, a gateway process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nacl.signing
import trio
from fake_node import TLS_CERTS, FakeNode

from common.tracker_client import TrackerClient
from common.vocab import Vocabulary
from proto.announce import Announce, Hardware, ModelSpec
from proto.signing import public_key_hex
from sim import procs
from sim.procs import Service

HARDWARE = Hardware(cpu_cores=2, ram_bytes=8 << 30, gpus=(), backends=("cpu",), free_disk_bytes=10 << 30)


def announce(
    tracker_url: str,
    key: nacl.signing.SigningKey,
    model: ModelSpec,
    start: int,
    end: int,
    port: int,
    max_sessions: int = 8,
    decode_ms_per_token: float = 10.0,
    uplink_mbit_s: float | None = None,
) -> None:
    async def run() -> None:
        async with TrackerClient(tracker_url, key) as client:
            with trio.fail_after(10):
                await client.announce(
                    Announce(
                        node_id=public_key_hex(key),
                        addresses=(f"127.0.0.1:{port}",),
                        relay=False,
                        relay_via=None,
                        hardware=HARDWARE,
                        software_version="test",
                        model=model,
                        shard_start=start,
                        shard_end=end,
                        decode_ms_per_token=decode_ms_per_token,
                        prefill_tokens_per_s=500.0,
                        max_sessions=max_sessions,
                        tls_fingerprint=tls.fingerprint
                        if (tls := TLS_CERTS.get(public_key_hex(key)))
                        else "",
                        uplink_mbit_s=uplink_mbit_s,
                    )
                )

    trio.run(run)


def url(proc: Service) -> str:
    return f"http://127.0.0.1:{proc.port}"


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    """``sim.procs.wait_until``, polling faster: these swarms are in-process fakes."""
    return procs.wait_until(predicate, timeout_s, what, interval_s)


def metric_lines(base_url: str, name: str) -> list[str]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(name)]


def vocab_bytes(model_path: Path, cache: Path) -> bytes:
    from node.shard import extract_vocab

    return extract_vocab(model_path, cache).read_bytes()


def recovered(gateway_url: str) -> bool:
    """Some recovery happened: a stage replaced in place, or the request moved to another route."""
    lines = metric_lines(gateway_url, "swarm_gateway_")
    moved = any('outcome="recovered"' in line for line in lines if "route_sessions_total" in line)
    replaced = any(
        "recoveries_total" in line and 'outcome="ok"' in line and float(line.split()[-1]) > 0
        for line in lines
    )
    return moved or replaced


@dataclass
class ScriptedNodes:
    nodes: list[FakeNode]
    script: list[int]  # the token ids the last stages "sample", in order
    eos: int
    expected: str  # the script as text


def scripted_nodes(
    model_path: Path,
    cache: Path,
    text: str,
    fingerprint: str,
    spans: list[tuple[int, int]],
    *,
    first_seed: int,
    **options: Any,
) -> ScriptedNodes:
    """Fake nodes (one per span, of a 30-layer model) that serve the test model's vocabulary and
    generate ``text``; ``options`` go to every :class:`FakeNode`."""
    with Vocabulary(model_path) as vocab:
        script = vocab.tokenize(text)
        eos = vocab.eos
        expected = vocab.detokenize(script)
    data = vocab_bytes(model_path, cache)
    nodes = [
        FakeNode(
            seed=first_seed + i,
            fingerprint=fingerprint,
            start=a,
            end=b,
            n_layers=30,
            vocab=data,
            script=script,
            eos=eos,
            **options,
        )
        for i, (a, b) in enumerate(spans)
    ]
    return ScriptedNodes(nodes, script, eos, expected)
