"""gateway/routes.NodeInfoCache (issue 26): a node that moved to another model or span (live
rebalancing: same node id, same address) is asked for its Info again instead of being served the
cached Info of what it held before (its layer count, limits and recipe would be the old model's)."""

from __future__ import annotations

import trio

from gateway.routes import Hop, NodeInfoCache
from proto.recipe import Recipe
from proto.swarm.v1 import frame_pb2, shard_service_pb2

NODE = "ab" * 32
A, B = "a" * 64, "b" * 64


class Channels:
    """Answers Info with what the node serves now; counts the calls."""

    def __init__(self) -> None:
        self.serving = (A, 0, 30, 30, 576)
        self.calls = 0

    async def info(self, address: str, tls_fingerprint: str = "") -> shard_service_pb2.NodeInfo:
        self.calls += 1
        fp, start, end, n_layers, n_embd = self.serving
        out = shard_service_pb2.NodeInfo(node_id=NODE, is_last=end == n_layers)
        out.model.fingerprint, out.model.n_layers, out.model.n_embd = fp, n_layers, n_embd
        out.model.n_ctx_train = 8192
        out.shard.CopyFrom(frame_pb2.LayerRange(start=start, end=end))
        out.recipe.CopyFrom(Recipe("b1", fp, "f16", False).to_wire())
        out.limits.max_kv_tokens_per_session = 2048
        return out


def test_a_node_that_moved_is_asked_again() -> None:
    async def main() -> None:
        channels = Channels()
        cache = NodeInfoCache(channels, ttl_s=30.0, timeout_s=5.0, clock=lambda: 100.0)  # type: ignore[arg-type]
        on_a = Hop(NODE, 0, 30, "10.0.0.1:7000")
        first = await cache.get(on_a, A)
        assert (first.n_layers, first.n_embd, channels.calls) == (30, 576, 1)
        assert await cache.get(on_a, A) is first and channels.calls == 1  # cached
        channels.serving = (B, 0, 18, 18, 640)  # it moved: Gemma 3, all 18 layers, same id and address
        moved = await cache.get(Hop(NODE, 0, 18, "10.0.0.1:7000"), B)
        assert (moved.n_layers, moved.n_embd, channels.calls) == (18, 640, 2)
        cache.forget(on_a)  # forgets every entry of that node at that address
        await cache.get(Hop(NODE, 0, 18, "10.0.0.1:7000"), B)
        assert channels.calls == 3

    trio.run(main)
