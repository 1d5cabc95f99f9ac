"""What the end-to-end tests share: the reference output and a few probes of a running swarm."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from proto.swarm.v1 import shard_service_pb2, shard_service_pb2_grpc
from sim.reference import NODE_ENGINE, Reference
from tests.node.loopback_client import node_channel

__all__ = ["NODE_ENGINE", "Reference", "live_nodes", "node_load", "wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """``predicate()``'s first truthy value, polled every ``interval_s``; AssertionError after
    ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def node_load(port: int) -> shard_service_pb2.NodeLoad:
    with node_channel(f"127.0.0.1:{port}") as channel:
        stub = shard_service_pb2_grpc.ShardServiceStub(channel)
        return stub.Info(shard_service_pb2.InfoRequest(), timeout=10).load


def live_nodes(tracker_url: str) -> list[dict]:
    resp = httpx.get(f"{tracker_url}/v1/swarm", timeout=10)
    resp.raise_for_status()
    return [n for n in resp.json()["nodes"] if n["state"] == "live"]
