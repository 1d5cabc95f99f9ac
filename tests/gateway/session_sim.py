"""The gateway's Route Session and the nodes' session machines, wired together in memory.

Both sides are sans-IO, so a whole swarm runs here without sockets, threads or
clocks: :class:`SimNode` is a real ``node.session_machine.FrameServer`` with a
deterministic engine (hidden rows are a function of the input; the last stage
"samples" a token that is a hash of the session's token history), and
:class:`SimSwarm` carries frames between the gateway's ``RouteMachine`` and the
nodes: per-stream FIFOs (gRPC keeps a stream in order), pushes between nodes,
engine jobs that finish later, a virtual clock for the deadlines. A seeded
scheduler picks which ready event happens next, so every interleaving a real
swarm could produce is reachable; faults are injected by a plan: kill a node
(its streams break, pushes to it fail), hang it (it stops answering; it may
resume later with stale replies), duplicate a reply to the gateway, or
preempt the session on a node (it frees the session's KV and answers
STATUS_PREEMPTED / RETRY_RESUME, as a node whose KV pool ran out does).

:func:`run_request` mimics ``gateway.serving``: a failure the machine cannot
repair in place is answered by re-running the token history on a fresh route
without the failed node; a preemption by re-running it on any route (the
preempting node included: it did nothing wrong), at most ``max_preemptions``
times. The reference is the same request on an undisturbed swarm.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gateway.route_plan import Ended, EndKind, Next, RoutePlan
from gateway.session_machine import (
    Closed,
    CloseStream,
    Command,
    EmitToken,
    FindReplacement,
    ForwardBytes,
    HopTimed,
    OpenStream,
    Recovered,
    RouteConfig,
    RouteMachine,
    SendFrame,
    SessionFailed,
    StageSpec,
    StepTimed,
)
from node.push import STALE
from node.session_machine import (
    Compute,
    Drop,
    FrameServer,
    FreeKv,
    OpenKv,
    Push,
    Send,
    ServingSpec,
    StepOutcome,
    TruncateKv,
)
from proto import codec
from proto.codec import Sampled
from proto.errors import PreemptedError

MODEL_FP = "a" * 64
RECIPE_FP = "b" * 64
N_EMBD = 8
N_VOCAB = 97
EOS = 96
N_LAYERS = 12


def _token(history: list[int]) -> int:
    """The "model": the next token is a hash of everything before it (never EOS before 200 tokens)."""
    digest = hashlib.blake2b(np.asarray(history, dtype=np.int32).tobytes(), digest_size=4).digest()
    value = int.from_bytes(digest, "little") % (N_VOCAB - 1)
    return value


def _repetitive_token(history: list[int]) -> int:
    """A "model" that mostly repeats itself (period 5), so n-gram drafts are often but not always right."""
    value = _token(history)
    if len(history) >= 5 and value % 4 != 0:
        return history[-5]
    return value


@dataclass
class SimNode:
    name: str
    start: int
    end: int
    machine: FrameServer = field(init=False)
    kv: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # last stage: token history per session
    dead: bool = False
    hung: bool = False
    repetitive: bool = False  # the last stage's "model" is _repetitive_token (speculation tests)

    def __post_init__(self) -> None:
        spec = ServingSpec(
            node_id=self.name,
            model_fingerprint=MODEL_FP,
            recipe_fingerprint=RECIPE_FP,
            shard_start=self.start,
            shard_end=self.end,
            n_embd=N_EMBD,
            n_vocab=N_VOCAB,
            is_first=self.start == 0,
            is_last=self.end == N_LAYERS,
            max_sessions=8,
            session_kv_tokens=4096,
            n_ctx_train=4096,
            idle_lease_s=300.0,
            reattach_window_s=30.0,
        )
        self.machine = FrameServer(spec, lambda *_: None)

    @property
    def is_last(self) -> bool:
        return self.end == N_LAYERS

    def compute(self, job: object) -> StepOutcome:
        """The deterministic engine: the same inputs give the same outputs on every node of a span."""
        from node.session_machine import StepJob

        assert isinstance(job, StepJob)
        sid = job.session_id
        n = job.n_tokens
        if self.kv.get(sid) != job.start:
            return StepOutcome(job.job_id, self.kv.get(sid, 0), error_status="POSITION_MISMATCH")
        self.kv[sid] = job.start + n
        if self.is_last:
            history = self.tokens.setdefault(sid, [])
            del history[job.start :]
            ids = [] if job.token_ids is None else [int(t) for t in job.token_ids]
            history.extend(ids)
            model = _repetitive_token if self.repetitive else _token
            if job.drafts:  # a window: the draw after each of its positions
                window = tuple(
                    Sampled(token_id=model(history[: job.start + i + 1]), logprob=-0.5) for i in range(n)
                )
                return StepOutcome(job.job_id, self.kv[sid], window=window)
            sampled = None
            if job.sample:
                sampled = Sampled(token_id=model(history), logprob=-0.5)
            return StepOutcome(job.job_id, self.kv[sid], sampled=sampled)
        if job.tokens is not None:
            rows = np.repeat(job.tokens.astype(np.float32)[:, None], N_EMBD, axis=1)
        else:
            assert job.hidden is not None
            rows = job.hidden
        pos = np.arange(job.start, job.start + n, dtype=np.float32)[:, None]
        return StepOutcome(
            job.job_id, self.kv[sid], hidden=(rows * 1.5 + pos + self.start).astype(np.float32)
        )


@dataclass
class Fault:
    kind: str  # "kill", "hang", "resume", "dup", "preempt"
    at: int  # after this many scheduler events
    node: str = ""


@dataclass
class SimSwarm:
    """Nodes, the network between them and one gateway machine at a time."""

    nodes: dict[str, SimNode]
    rng: random.Random
    now: float = 0.0
    events: int = 0
    run: int = 0  # which gateway machine (slots restart at 1 with each one)
    # gateway <-> node streams: (run, slot) -> (node name, conn id on that node)
    slots: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    to_node: dict[tuple[int, int], deque[bytes]] = field(default_factory=dict)  # gateway -> node
    to_gw: dict[tuple[int, int], deque[bytes]] = field(default_factory=dict)  # node -> gateway
    pushes: dict[tuple[str, str, str], tuple[int, deque[bytes]]] = field(default_factory=dict)
    jobs: list[tuple[str, object]] = field(default_factory=list)  # (node, job) waiting for the engine
    failed_slots: list[tuple[int, int]] = field(default_factory=list)
    lookups: list[FindReplacement] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    outcome: Command | None = None
    failure: SessionFailed | None = None
    failures: list[SessionFailed] = field(default_factory=list)  # every run's, in order
    recoveries: int = 0
    dup_next: bool = False
    timings: list[StepTimed | HopTimed] = field(default_factory=list)  # (now, what) of every decode step
    timed_at: list[float] = field(default_factory=list)  # self.now of each entry of timings
    pushed: list[tuple[str, int]] = field(default_factory=list)  # (sender, tensor encoding) of each push
    preemptions: int = 0  # sessions a node preempted (fault "preempt")

    # -- node side ------------------------------------------------------------------------------------

    def node_actions(self, node: SimNode, actions: list[object]) -> None:
        for action in actions:
            if isinstance(action, Send):
                slot = self._slot_of(node.name, action.conn)
                data = [codec.serialize_frame(f) for f in action.frames]
                if slot is not None:
                    self.to_gw.setdefault(slot, deque()).extend(data)
                # replies on a push connection are refusals: the pusher learns through push_failed
                for (src, sid, dst), (conn, _queue) in list(self.pushes.items()):
                    if dst == node.name and conn == action.conn:
                        for frame in action.frames:
                            if codec.body_kind(frame) == "error" and frame.error.status not in STALE:
                                self._push_failed(
                                    src, sid, f"{dst} refused a pushed step", int(frame.route_epoch) or None
                                )
            elif isinstance(action, Push):
                self._push(node, action)
            elif isinstance(action, Compute):
                self.jobs.append((node.name, action.job))
            elif isinstance(action, Drop):
                self.jobs = [
                    (n, j) for n, j in self.jobs if not (n == node.name and j.job_id == action.job_id)
                ]  # type: ignore[attr-defined]
            elif isinstance(action, OpenKv):
                node.kv[action.session_id] = action.source_positions if action.source else 0
                if action.source:  # KV reuse: the source's first positions (and token history)
                    tokens = node.tokens.get(action.source, [])[: action.source_positions]
                    node.tokens[action.session_id] = list(tokens)
                    if action.move:
                        node.kv.pop(action.source, None)
                        node.tokens.pop(action.source, None)
            elif isinstance(action, TruncateKv):
                node.kv[action.session_id] = action.position
                if action.session_id in node.tokens:
                    del node.tokens[action.session_id][action.position :]
            elif isinstance(action, FreeKv):
                node.kv.pop(action.session_id, None)
                node.tokens.pop(action.session_id, None)

    def _slot_of(self, name: str, conn: int) -> tuple[int, int] | None:
        for slot, (n, c) in self.slots.items():
            if n == name and c == conn:
                return slot
        return None

    def _push(self, node: SimNode, push: Push) -> None:
        target = self.nodes.get(push.target.address)
        if target is None or target.dead:
            self._push_failed(node.name, push.session_id, f"{push.target.address} unreachable")
            return
        for frame in push.frames:
            if codec.body_kind(frame) == "activation":
                self.pushed.extend((node.name, int(t.encoding)) for t in frame.activation.tensors)
        key = (node.name, push.session_id, target.name)
        if key not in self.pushes:
            self.pushes[key] = (target.machine.connect(), deque())
        self.pushes[key][1].extend(codec.serialize_frame(f) for f in push.frames)

    def _push_failed(self, src: str, sid: str, message: str, epoch: int | None = None) -> None:
        node = self.nodes[src]
        if not node.dead:
            self.node_actions(node, node.machine.push_failed(sid, message, epoch))

    # -- gateway side ----------------------------------------------------------------------------------

    def gateway_commands(self, machine: RouteMachine, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, OpenStream):
                key = (self.run, command.slot)
                node = self.nodes[command.stage.node_id]
                if node.dead:
                    self.failed_slots.append(key)
                    continue
                self.slots[key] = (node.name, node.machine.connect())
            elif isinstance(command, SendFrame | ForwardBytes):
                key = (self.run, command.slot)
                if key not in self.slots:
                    continue
                data = (
                    codec.serialize_frame(command.frame) if isinstance(command, SendFrame) else command.data
                )
                self.to_node.setdefault(key, deque()).append(data)
            elif isinstance(command, CloseStream):
                # half-close: what was queued still reaches the node, then the connection ends
                key = (self.run, command.slot)
                if key in self.slots:
                    self.to_node.setdefault(key, deque()).append(b"")
            elif isinstance(command, FindReplacement):
                self.lookups.append(command)
            elif isinstance(command, EmitToken):
                self.emitted.append(command.sampled.token_id)
            elif isinstance(command, Recovered):
                self.recoveries += command.report.ok
            elif isinstance(command, SessionFailed):
                self.failure = command
                self.failures.append(command)
            elif isinstance(command, Closed):
                self.outcome = command
            elif isinstance(command, StepTimed | HopTimed):
                self.timings.append(command)
                self.timed_at.append(self.now)

    # -- the scheduler ---------------------------------------------------------------------------------

    def ready(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for slot, q in self.to_node.items():
            if q and slot in self.slots and not self.nodes[self.slots[slot][0]].hung:
                out.append(("to_node", slot))
        for slot, q in self.to_gw.items():
            if q:
                out.append(("to_gw", slot))
        for key, (_conn, q) in self.pushes.items():
            if q and not self.nodes[key[2]].hung:
                out.append(("push", key))
        for i, (name, _job) in enumerate(self.jobs):
            if not self.nodes[name].hung:
                out.append(("job", i))
        if self.failed_slots:
            out.append(("failed", 0))
        if self.lookups:
            out.append(("lookup", 0))
        return out

    def step(
        self, machine: RouteMachine, spares: dict[tuple[int, int], list[str]], faults: list[Fault]
    ) -> bool:
        """One event; False when nothing can happen any more (then time advances to the deadline)."""
        for fault in [f for f in faults if f.at == self.events]:
            self.apply(machine, fault)
        self.events += 1
        ready = self.ready()
        if not ready:
            if machine.deadline == float("inf"):
                return False
            self.now = max(self.now, machine.deadline)
            self.gateway_commands(machine, machine.on_tick(self.now))
            return True
        kind, key = ready[self.rng.randrange(len(ready))]
        self.now += 0.001
        if kind == "to_node":
            slot = key  # type: ignore[assignment]
            data = self.to_node[slot].popleft()
            name, conn = self.slots[slot]
            node = self.nodes[name]
            if data == b"":  # the half-close reached the node: the connection ends
                del self.slots[slot]
                self.node_actions(node, node.machine.disconnect(conn, self.now))
            else:
                self.node_actions(node, node.machine.handle(conn, data, self.now))
        elif kind == "to_gw":
            data = self.to_gw[key].popleft()  # type: ignore[index]
            if self.dup_next:
                self.dup_next = False
                self.to_gw[key].appendleft(data)  # type: ignore[index]  # the same reply arrives twice
            run, slot = key  # type: ignore[misc]
            if run == self.run:  # replies to an earlier machine's streams go nowhere
                self.gateway_commands(machine, machine.on_bytes(slot, data, self.now))
        elif kind == "push":
            src, sid, dst = key  # type: ignore[misc]
            conn, q = self.pushes[key]  # type: ignore[index]
            node = self.nodes[dst]
            self.node_actions(node, node.machine.handle(conn, q.popleft(), self.now))
        elif kind == "job":
            name, job = self.jobs.pop(key)  # type: ignore[call-overload]
            node = self.nodes[name]
            if not node.dead:
                self.node_actions(node, node.machine.complete(node.compute(job), self.now))
        elif kind == "failed":
            run, slot = self.failed_slots.pop(0)
            if run == self.run:
                self.gateway_commands(machine, machine.on_stream_failed(slot, "connection refused", self.now))
        elif kind == "lookup":
            lookup = self.lookups.pop(0)
            candidates = [
                n
                for n in spares.get((lookup.start, lookup.end), [])
                if n not in lookup.exclude and not self.nodes[n].dead and not self.nodes[n].hung
            ]
            if candidates:
                node = self.nodes[candidates[0]]
                spec = StageSpec(node.name, node.name, node.start, node.end, RECIPE_FP, b"ticket")
                self.gateway_commands(machine, machine.on_replacement(lookup.index, spec, None, self.now))
            else:
                from gateway.session_machine import Failure

                failure = Failure("stage", f"no spare for [{lookup.start}, {lookup.end})")
                self.gateway_commands(machine, machine.on_replacement(lookup.index, None, failure, self.now))
        return True

    def apply(self, machine: RouteMachine, fault: Fault) -> None:
        node = self.nodes.get(fault.node)
        if fault.kind == "dup":
            self.dup_next = True
            return
        if node is None:
            return
        if fault.kind == "preempt":
            self.preempt(machine, node)
            return
        if fault.kind == "kill" and not node.dead:
            node.dead = True
            node.hung = False
            node.kv.clear()
            self.jobs = [(n, j) for n, j in self.jobs if n != node.name]
            for slot, (name, _conn) in list(self.slots.items()):
                if name == node.name:
                    del self.slots[slot]
                    self.to_node.pop(slot, None)
                    self.failed_slots.append(slot)
            for key in [k for k in self.pushes if node.name in (k[0], k[2])]:
                _conn, q = self.pushes.pop(key)
                if key[2] == node.name and key[0] in self.nodes:
                    self._push_failed(key[0], key[1], f"{node.name} went away")
        elif fault.kind == "hang":
            node.hung = True
        elif fault.kind == "resume":
            node.hung = False

    def preempt(self, machine: RouteMachine, node: SimNode) -> None:
        """``node`` frees the current session's KV for an older session and says so on its stream."""
        sid = machine.config.session_id
        if node.dead or node.hung or node.machine.kv_len(sid) is None:
            return
        slot = next(
            (key for key, (name, _conn) in self.slots.items() if key[0] == self.run and name == node.name),
            None,
        )
        if slot is None:
            return
        self.jobs = [
            (n, j) for n, j in self.jobs if not (n == node.name and getattr(j, "session_id", None) == sid)
        ]
        self.node_actions(node, node.machine.fail_session(sid, "preempted for an older session"))
        frame = codec.error_frame(
            PreemptedError("KV pool full: freed for an older session", retry_after_ms=50, session_closed=True)
        )
        frame.session_id = sid
        frame.route_epoch = machine.epoch
        self.to_gw.setdefault(slot, deque()).append(codec.serialize_frame(frame))
        self.preemptions += 1


@dataclass
class RequestResult:
    tokens: list[int]
    failed: str | None
    recoveries: int
    route_runs: int
    preempted: int = 0  # runs that ended in a preemption and were resumed (or failed past the bound)


def make_nodes(
    spans: list[tuple[int, int]], spares: int, *, repetitive: bool = False
) -> tuple[dict[str, SimNode], dict[tuple[int, int], list[str]]]:
    nodes: dict[str, SimNode] = {}
    by_span: dict[tuple[int, int], list[str]] = {}
    for a, b in spans:
        for i in range(1 + spares):
            name = f"n{a}-{b}-{i}"
            nodes[name] = SimNode(name, a, b, repetitive=repetitive)
            by_span.setdefault((a, b), []).append(name)
    return nodes, by_span


def run_request(
    swarm: SimSwarm,
    by_span: dict[tuple[int, int], list[str]],
    prompt: list[int],
    max_new: int,
    *,
    faults: list[Fault] = (),  # type: ignore[assignment]
    push: bool = True,
    step_tokens: int = 5,
    prefill_pipeline_steps: int = 3,
    max_events: int = 200_000,
    encodings: tuple[int, ...] = (),
    timeouts: dict[str, float] | None = None,  # RouteConfig deadline fields to override
    max_preemptions: int = 4,
    exact_resume: bool = True,
    max_drafts: int = 0,  # speculative decoding (RouteConfig.max_drafts)
) -> RequestResult:
    """Generate ``max_new`` tokens, the way the gateway's service does, with ``faults`` injected:
    what follows a failed Route Session is the product's own route plan (gateway/route_plan.py).
    The route choice stands in for the tracker's: the first node per span that the plan does not
    avoid and that is alive (a dead or hung node stops heartbeating and leaves the registry)."""
    generated: list[int] = []
    plan = RoutePlan(max_preemptions=max_preemptions)
    recoveries = 0
    runs = 0
    spans = sorted(by_span)
    faults = list(faults)
    while True:
        runs += 1
        route = []
        for span in spans:
            live = [
                n
                for n in by_span[span]
                if n not in plan.avoid and not swarm.nodes[n].dead and not swarm.nodes[n].hung
            ]
            if not live:
                return RequestResult(generated, f"no node for {span}", recoveries, runs, plan.preemptions)
            route.append(live[0])
        history = prompt + generated
        budget = len(prompt) + max_new - 1
        config = RouteConfig(
            session_id=f"s{runs}",
            request_id="r",
            model_fingerprint=MODEL_FP,
            sampling=codec.SamplingSettings(temperature=0.0),
            kv_budget=budget,
            step_tokens=step_tokens,
            node_frame_bytes=1 << 20,
            push=push,
            prefill_pipeline_steps=prefill_pipeline_steps,
            max_recoveries=3,
            open_timeout_s=5,
            prefill_step_timeout_s=5,
            decode_step_timeout_s=5,
            decode_timeout_floor_s=1,
            close_timeout_s=2,
            encodings=encodings,  # type: ignore[arg-type]
            # A re-run prefills the generated tokens one per step, as gateway.serving does (exact_resume).
            single_from=len(prompt) if generated and exact_resume else 0,
            max_drafts=max_drafts,
        )
        if timeouts:
            config = dataclasses.replace(config, **timeouts)  # type: ignore[arg-type]
        stages = [
            StageSpec(n, n, swarm.nodes[n].start, swarm.nodes[n].end, RECIPE_FP, b"ticket") for n in route
        ]
        counter = itertools.count(runs * 1000)
        machine = RouteMachine(config, stages, new_token=lambda c=counter: next(c).to_bytes(8, "little"))
        swarm.run += 1
        swarm.lookups.clear()
        swarm.emitted, swarm.failure, swarm.outcome = [], None, None
        swarm.gateway_commands(machine, machine.open(swarm.now))
        begun = False
        stopped = False
        for _ in range(max_events):
            if machine.phase == "ready" and not begun:
                begun = True
                swarm.gateway_commands(machine, machine.begin(history, swarm.now))
            if swarm.emitted and not stopped:
                generated.extend(swarm.emitted)
                swarm.emitted = []
                if len(generated) >= max_new or generated[-1] == EOS:
                    stopped = True
                    swarm.gateway_commands(machine, machine.stop(release=True, now=swarm.now))
            if machine.done:
                break
            if not swarm.step(machine, by_span, faults):
                break
        recoveries += machine.recoveries
        del generated[max_new:]
        if swarm.failure is None or stopped:
            return RequestResult(generated, None, recoveries, runs, plan.preemptions)
        failure = swarm.failure.failure
        kind: EndKind = "preempted" if failure.kind == "preempted" else "other"
        if failure.kind in ("stage", "busy"):
            kind = "stage"
        nodes = frozenset({failure.node_id}) if failure.node_id else frozenset()
        # The session opened (the machine ran it); the tokens are kept for a re-run or a resumption.
        if plan.after(Ended(kind, True, failure.replaceable, nodes)) not in (Next.RETRY, Next.WAIT_FOR_KV):
            return RequestResult(generated, failure.message, recoveries, runs, plan.preemptions)
