"""Scripted nodes: the real node stack (session machine, hub, scheduler, pushes, gRPC service) with a
scripted engine instead of llama.cpp.

Every :class:`FakeNode` speaks the protocol with the node's own code, so direct
push, the decode ring, replays and refusals behave as on a real node; only
the compute is scripted: stages before the last pass zeros on, and a last
stage "samples" the next token of a fixed script (the one after the part of
the script the session's token history ends with, so a session replayed on
another route continues the same text). All fake nodes of a test process run
in one background thread with one ``trio.run`` (one grpc runtime per process:
``common.grpc_adapter``). Used by the gateway's in-process tests: HTTP API,
SSE, errors, admission, disconnects and recovery without llama.cpp. Tests that
check the numbers use real ``swarm-node`` processes instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import nacl.signing
import numpy as np
import trio

from common.grpc_adapter import Grpc, open_grpc
from common.tls import ServerCert, generate_self_signed
from node.backend import SliceResult
from node.batching import Slice
from node.grpc_server import GrpcSettings, ShardService
from node.hub import Hub
from node.push import PushLinks
from node.sampling import SamplingParams
from node.scheduler import Scheduler
from node.session_machine import FrameServer, ServingSpec
from proto import codec
from proto.codec import Sampled
from proto.recipe import Recipe
from proto.signing import public_key_hex
from proto.swarm.v1 import frame_pb2, shard_service_pb2

N_EMBD = 576
# Scripted failures shared by every fake node of a test: the next ``left`` decode steps that find a session
# past ``after`` generated tokens get INTERNAL on the last stage.
FAILURES: dict[str, int] = {"left": 0, "after": 0}
# Scripted preemptions, the same way: the next ``left`` decode steps on the last stage that find a session
# past ``after`` generated tokens free its KV and answer STATUS_PREEMPTED (a node whose KV pool ran out and
# freed this session for an older one), or with ``refuse`` 1 keep it and answer RESOURCE_EXHAUSTED (no room
# for the step and nobody to preempt). ``done`` counts them.
PREEMPTIONS: dict[str, int] = {"left": 0, "after": 0, "done": 0, "refuse": 0}


@dataclass
class FakeState:
    """Counters the tests read (from the test thread: plain ints and a dict, updated under the GIL)."""

    node: FakeNode

    @property
    def sessions(self) -> dict[str, int]:
        machine = self.node.machine
        return {} if machine is None else {sid: s.kv_len for sid, s in machine._sessions.items()}

    @property
    def opened(self) -> int:
        return self.node.backend.opened

    @property
    def released(self) -> int:
        return self.node.count("released")

    @property
    def cancelled(self) -> int:
        return self.node.count("cancelled")


class ScriptedBackend:
    """The engine of a fake node: KV lengths per session, scripted tokens on the last stage."""

    n_batch = 512

    def __init__(self, node: FakeNode) -> None:
        self.node = node
        self.kv: dict[str, int] = {}
        self.history: dict[str, list[int]] = {}
        self.opened = 0
        self.slices = {"isolated": 0, "shared": 0}  # slices computed, by OpenSession.isolated

    def open(
        self,
        session_id: str,
        budget: int,
        sampling: SamplingParams,
        source: str = "",
        positions: int = 0,
        move: bool = False,
    ) -> None:
        self.kv[session_id] = positions if source else 0
        self.history[session_id] = list(self.history.get(source, []))[:positions] if source else []
        if source and move:
            self.free(source)
        self.opened += 1

    def truncate(self, session_id: str, position: int) -> None:
        self.kv[session_id] = position
        del self.history[session_id][position:]

    def free(self, session_id: str) -> None:
        self.kv.pop(session_id, None)
        self.history.pop(session_id, None)

    def kv_len(self, session_id: str) -> int:
        return self.kv[session_id]

    def has_session(self, session_id: str) -> bool:
        return session_id in self.kv

    def run(self, slices: list[Slice]) -> list[SliceResult]:
        node = self.node
        if node.step_delay_s:
            time.sleep(node.step_delay_s)  # on the scheduler's engine thread, like real compute
        out = []
        if any(s.pending.job.isolated for s in slices) and len(slices) > 1:
            raise AssertionError("an isolated job shared a batch")  # node.batching never does this
        for s in slices:
            job = s.pending.job
            self.slices["isolated" if job.isolated else "shared"] += 1
            sid = job.session_id
            if sid not in self.kv:
                out.append(SliceResult(0, error_status="UNKNOWN_SESSION", error_message="gone"))
                continue
            ids = job.token_ids if job.token_ids is not None and len(job.token_ids) else None
            if (
                node.is_last
                and job.is_decode
                and FAILURES["left"] > 0
                and node.generated(self.history[sid]) >= FAILURES["after"]
            ):
                FAILURES["left"] -= 1
                out.append(
                    SliceResult(self.kv[sid], error_status="INTERNAL", error_message="scripted failure")
                )
                continue
            if (
                node.is_last
                and job.is_decode
                and PREEMPTIONS["left"] > 0
                and node.generated(self.history[sid]) >= PREEMPTIONS["after"]
            ):
                PREEMPTIONS["left"] -= 1
                PREEMPTIONS["done"] += 1
                if PREEMPTIONS["refuse"]:
                    out.append(
                        SliceResult(
                            self.kv[sid], error_status="RESOURCE_EXHAUSTED", error_message="KV pool full"
                        )
                    )
                    continue
                self.free(sid)  # the pool's blocks go to the older session
                out.append(
                    SliceResult(
                        0, error_status="PREEMPTED", error_message="KV pool full: freed for an older one"
                    )
                )
                continue
            self.kv[sid] += s.count
            if ids is not None:
                self.history[sid].extend(int(t) for t in ids[s.offset : s.offset + s.count])
            if not node.is_last:
                hidden = np.zeros((s.count, N_EMBD), np.float32)
                if node.lie == "perturb":
                    hidden[0, 0] = np.nextafter(np.float32(0), np.float32(1))  # one ulp
                out.append(SliceResult(self.kv[sid], hidden=hidden))
                continue

            def draw(history: list[int]) -> Sampled:
                k = node.generated(history)
                token = node.script[k] if k < len(node.script) else node.eos
                if node.lie == "swap":
                    token = (token + 1) % 49152
                return Sampled(
                    token_id=token,
                    logprob=-0.25,
                    top_logprobs=((token, -0.25), (node.eos, -3.0)),
                    end_of_generation=token == node.eos,
                )

            if job.drafts:  # a speculative window: the draw after each of this slice's positions
                end = self.kv[sid]
                hist = self.history[sid]
                window = tuple(draw(hist[: p + 1]) for p in range(end - s.count, end))
                out.append(SliceResult(end, window=window))
                continue
            sampled = draw(self.history[sid]) if job.sample and s.last else None
            out.append(SliceResult(self.kv[sid], sampled=sampled))
        return out


# node id -> its TLS certificate (one per key, so a restarted fake node keeps its pin).
TLS_CERTS: dict[str, ServerCert] = {}


class FakeNode:
    def __init__(
        self,
        *,
        seed: int,
        fingerprint: str,
        start: int,
        end: int,
        n_layers: int,
        vocab: bytes,
        script: list[int],
        eos: int,
        step_delay_s: float = 0.0,
        kv_per_session: int = 512,
        lie: str | None = None,
    ) -> None:
        self.lie = lie  # "swap" (last stage: another token) or "perturb" (one ulp of one output value)
        self.key = nacl.signing.SigningKey(bytes([seed]) * 32)
        self.node_id = public_key_hex(self.key)
        # Fake nodes serve TLS like real ones; swarm_fixtures.announce announces the pin.
        self.tls = TLS_CERTS.setdefault(self.node_id, generate_self_signed())
        self.fingerprint, self.start, self.end, self.n_layers = fingerprint, start, end, n_layers
        self.recipe = Recipe("fake", fingerprint, "f16", True)
        self.vocab, self.script, self.eos = vocab, script, eos
        self.step_delay_s = step_delay_s
        self.kv_per_session = kv_per_session
        self.is_last = end == n_layers
        self.backend = ScriptedBackend(self)
        self.state = FakeState(self)
        self.machine: FrameServer | None = None
        self.port = 0
        self._scope: trio.CancelScope | None = None
        self._runner: FakeRunner | None = None
        self.port = runner().start(self)

    def generated(self, history: list[int]) -> int:
        """How much of the script the history already ends with: a "model" that is the same on every route."""
        for k in range(min(len(self.script), len(history)), 0, -1):
            if history[-k:] == self.script[:k]:
                return k
        return 0

    def count(self, reason: str) -> int:
        machine = self.machine
        if machine is None:
            return 0
        return sum(1 for c in list(machine._closed.values()) if c.reason == reason)

    def info(self) -> shard_service_pb2.NodeInfo:
        return shard_service_pb2.NodeInfo(
            node_id=self.node_id,
            model=shard_service_pb2.ModelInfo(
                fingerprint=self.fingerprint,
                name="fake",
                architecture="llama",
                n_layers=self.n_layers,
                n_embd=N_EMBD,
                n_vocab=49152,
                n_ctx_train=8192,
            ),
            shard=frame_pb2.LayerRange(start=self.start, end=self.end),
            recipe=self.recipe.to_wire(),
            limits=shard_service_pb2.NodeLimits(
                max_frame_bytes=4 << 20,
                max_step_tokens=512,
                max_sessions=8,
                max_kv_tokens_per_session=self.kv_per_session,
            ),
            is_last=self.is_last,
            tls_fingerprint=self.tls.fingerprint,
            serves_vocab=self.is_last,
        )

    async def serve(
        self, grpc_rt: Grpc, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        spec = ServingSpec(
            node_id=self.node_id,
            model_fingerprint=self.fingerprint,
            recipe_fingerprint=self.recipe.fingerprint(),
            shard_start=self.start,
            shard_end=self.end,
            n_embd=N_EMBD,
            n_vocab=49152,
            is_first=self.start == 0,
            is_last=self.is_last,
            max_sessions=8,
            session_kv_tokens=self.kv_per_session,
            n_ctx_train=8192,
            reattach_window_s=10.0,
        )
        self.machine = FrameServer(spec, lambda *_: None)
        hub = Hub(self.machine)
        scheduler = Scheduler(
            self.backend, hub.on_outcome, max_batch_tokens=512, prefill_chunk_tokens=512, inline_max_ms=0
        )
        pushes = PushLinks(
            lambda address, pin: grpc_rt.open_stream(
                address, codec.SESSION_METHOD, max_message_bytes=8 << 20, pin=pin
            ),
            hub.on_push_failed,
        )
        hub.attach(scheduler, pushes)
        service = ShardService(
            hub,
            GrpcSettings(
                "127.0.0.1", self.port, 4 << 20, lambda: self.vocab, self.fingerprint, 0.5, tls=self.tls
            ),
            self.info,
            lambda: shard_service_pb2.HealthResponse(status=shard_service_pb2.SERVING_STATUS_SERVING),
        )
        with trio.CancelScope() as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                await nursery.start(pushes.run)
                await nursery.start(scheduler.run)
                await nursery.start(hub.run_leases, 0.5)
                self.port = await nursery.start(service.serve, grpc_rt)
                task_status.started(self.port)
                await trio.sleep_forever()

    def stop(self) -> None:
        """Stop serving: the gRPC server goes away with every stream (like a node that died)."""
        runner = self._runner
        if runner is not None and self._scope is not None:
            runner.call(self._scope.cancel)
            runner.release(self)


class FakeRunner:
    """One background thread, one trio.run and one grpc runtime for every fake node of the process.

    grpcio's completion queue is global to a process, so there is one runner for
    the whole test session (:func:`runner`); nodes are started in it on demand.
    """

    def __init__(self) -> None:
        self.live: set[FakeNode] = set()
        self._done: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._grpc: Grpc | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fake-nodes", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the fake-node runner did not start: {self._error!r}")

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._done = trio.Event()
            async with open_grpc() as grpc_rt, trio.open_nursery() as nursery:
                self._grpc, self._nursery = grpc_rt, nursery
                self._ready.set()
                await self._done.wait()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        except BaseException as err:  # reported to the test thread
            self._error = err
            self._ready.set()

    def start(self, node: FakeNode) -> int:
        async def start() -> int:
            assert self._nursery is not None and self._grpc is not None
            port: int = await self._nursery.start(node.serve, self._grpc)
            return port

        node._runner = self
        self.live.add(node)
        return trio.from_thread.run(start, trio_token=self._token)

    def release(self, node: FakeNode) -> None:
        """A node stopped; the last one ends the runner (one grpc runtime per process at a time, so
        tests that run their own must not overlap with it)."""
        self.live.discard(node)
        if not self.live and self._done is not None:
            self.call(self._done.set)
            self._thread.join(30)
            if _RUNNER and _RUNNER[0] is self:
                _RUNNER.clear()

    def call(self, fn: Callable[[], object]) -> None:
        if self._token is not None:
            try:
                trio.from_thread.run_sync(fn, trio_token=self._token)
            except trio.RunFinishedError:
                pass


_RUNNER: list[FakeRunner] = []


def runner() -> FakeRunner:
    """The running fake-node runner, started on first use (and again after the last node stopped)."""
    if not _RUNNER:
        _RUNNER.append(FakeRunner())
    return _RUNNER[0]
