"""What the end-to-end tests share: the reference output and a few probes of a running swarm."""

from __future__ import annotations

import httpx

from proto.swarm.v1 import shard_service_pb2, shard_service_pb2_grpc
from sim.procs import wait_until
from sim.reference import NODE_ENGINE, Reference
from tests.node.loopback_client import node_channel

__all__ = ["NODE_ENGINE", "Reference", "live_nodes", "node_load", "wait_until"]


def node_load(port: int) -> shard_service_pb2.NodeLoad:
    with node_channel(f"127.0.0.1:{port}") as channel:
        stub = shard_service_pb2_grpc.ShardServiceStub(channel)
        return stub.Info(shard_service_pb2.InfoRequest(), timeout=10).load


def live_nodes(tracker_url: str) -> list[dict]:
    resp = httpx.get(f"{tracker_url}/v1/swarm", timeout=10)
    resp.raise_for_status()
    return [n for n in resp.json()["nodes"] if n["state"] == "live"]
