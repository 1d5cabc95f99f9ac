"""The tracker's challenge runner: is a newly announced node where it says, holding what it says?

Every node that announces (or comes back after expiring) waits in state
``challenging`` until this runner has, through ``common.grpc_adapter``:

1. asked ``Info`` at the node's announced address and checked that the node
   there has the announced key, model and span, and a runtime recipe whose
   fingerprint its fields hash to;
2. opened a Route Session on it alone, with a tracker-signed ticket for a
   one-hop route (no downstream, so the node answers with its output rows);
3. sent one PREFILL of the span's challenge input (``tracker/challenge.py``)
   and read the answer: output rows and digest, or a greedy sampled token;
4. released the session, and compared the digest with trusted nodes' answers.

A mismatch, a wrong identity or an answer inconsistent with itself keeps the
node out (``challenge_failed``); no trusted reference yet lets it in on
probation; a node that does not answer (refused connection, timeout, busy, a
ticket it does not accept yet) is tried ``challenge_attempts`` times, then
counts as failed. Relayed nodes cannot be dialled: the gateway relaying one carries the same
session's frames to it and brings back the answer, which is judged here alike
(:meth:`Challenger.relay_orders`, :meth:`Challenger.relay_result`, tracker/relay_challenges.py).

Bounds: ``challenge_concurrency`` challenges at once, at most
``challenge_queue_max`` waiting (more are picked up by the periodic sweep of
nodes still ``challenging``), one in flight per node, each attempt within
``challenge_timeout_s`` and its first answer (Info) within ``challenge_info_timeout_s``, so
a tarpit address (accepts TCP, never answers) holds a challenge slot seconds, not minutes;
the pause before a retry holds no slot (the node waits outside the queue, at most
``challenge_queue_max`` of them); the answer read is at most the input's rows.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from common.grpc_adapter import Grpc, RpcError, StreamClosed
from common.logs import event
from proto import codec
from proto.errors import ProtocolError, error_from_body
from proto.recipe import Recipe
from proto.signing import RouteTicket, TicketHop, route_ticket_bytes, sign_route_ticket
from proto.swarm.v1 import frame_pb2, shard_service_pb2, status_pb2
from tracker.challenge import TOP_LOGPROBS, ChallengeInput, challenge_input, sampled_digest, verdict
from tracker.trust_store import ChallengeTarget

RELAY_ADDRESS_PREFIX = "relay:"  # a relayed node's route address: relay:<gateway id>

if TYPE_CHECKING:
    from tracker.service import Registry

log = logging.getLogger("swarm.tracker.challenge")
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_RETRYABLE = frozenset(
    {
        status_pb2.STATUS_TICKET_INVALID,  # the node may not have learnt the tracker's key yet
        status_pb2.STATUS_RESOURCE_EXHAUSTED,
        status_pb2.STATUS_UNAVAILABLE,
        status_pb2.STATUS_INTERNAL,
    }
)


class ChallengeFailed(Exception):
    """The node's answer is wrong in itself (not a digest mismatch): it stays out."""


class Unanswered(Exception):
    """The node did not answer this attempt (connection, timeout, busy): try again later."""


@dataclass(frozen=True)
class Outcome:
    node_id: str
    outcome: str  # passed, no_reference, mismatch, failed, skipped, gone
    routable: bool
    detail: str
    digest: str = ""
    recipe: str = ""


class Challenger:
    def __init__(self, registry: Registry, grpc_rt: Grpc, *, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.grpc = grpc_rt
        self.config = registry.config
        self.clock = clock
        self._secret = hashlib.sha256(b"swarm-challenge-key/" + bytes(registry.key)).digest()
        # (node id, attempt) waiting for a worker
        self._send, self._receive = trio.open_memory_channel[tuple[str, int]](self.config.challenge_queue_max)
        self._pending: set[str] = set()  # queued, running or waiting to retry: one per node at a time
        self._retrying = 0  # nodes waiting out the pause before their next attempt
        self._nursery: trio.Nursery | None = None
        self.completed = 0

    # -- queue -------------------------------------------------------------------------------------

    def enqueue(self, node_id: str) -> bool:
        """Ask for a challenge of ``node_id`` (no-op when one is queued or running, or the queue is
        full: the periodic sweep finds the node again)."""
        if node_id in self._pending:
            return False
        try:
            self._send.send_nowait((node_id, 0))
        except trio.WouldBlock:
            return False
        self._pending.add(node_id)
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self.config.challenge_concurrency):
                nursery.start_soon(self._worker)
            task_status.started()

    async def _worker(self) -> None:
        async for node_id, attempt in self._receive:
            retrying = False
            try:
                retrying = await self.challenge(node_id, attempt) is None
            except Exception as err:  # a bug must not stop the runner; the sweep retries the node
                event(log, "challenge_error", level=logging.ERROR, node_id=node_id, error=repr(err))
            finally:
                if not retrying:
                    self._pending.discard(node_id)

    def _retry_later(self, node_id: str, attempt: int) -> bool:
        """Queue attempt ``attempt`` after a pause (1 s, 3 s, 9 s ... at most 30 s) without holding a
        worker: nodes that do not answer must not stall the challenges of those that do. False when
        too many already wait (the node then counts as unanswered now; the sweep finds it again)."""
        if self._nursery is None or self._retrying >= self.config.challenge_queue_max:
            return False
        self._retrying += 1

        async def later() -> None:
            try:
                await trio.sleep(min(30.0, 3.0 ** (attempt - 1)))
                self._send.send_nowait((node_id, attempt))
            except trio.WouldBlock:
                self._pending.discard(node_id)  # the queue is full: the periodic sweep finds it
            finally:
                self._retrying -= 1

        self._nursery.start_soon(later)
        return True

    # -- one challenge -----------------------------------------------------------------------------

    async def challenge(self, node_id: str, attempt: int = 0) -> Outcome | None:
        """Attempt ``attempt`` (from 0) at challenging ``node_id``; None when the node did not answer
        and its next attempt is queued (see :meth:`_retry_later`)."""
        reg = self.registry
        target = await reg.gate.run_db(reg.store.trust.challenge_target, node_id)
        if target is None:
            return Outcome(node_id, "gone", False, "the node is not waiting for a challenge")
        if not target.address:
            # A relayed node cannot be dialled: the gateway relaying it carries this challenge's
            # frames when it asks for its relayed nodes' orders (:meth:`relay_orders`).
            return Outcome(
                node_id, "relayed", False, "waiting for the relaying gateway to carry the challenge"
            )
        try:
            with trio.fail_after(self.config.challenge_timeout_s):
                recipe, route_recipe, spec, digest = await self._attempt(target)
        except (Unanswered, trio.TooSlowError) as err:
            last = "no answer in time" if isinstance(err, trio.TooSlowError) else str(err)
            if attempt + 1 < self.config.challenge_attempts and self._retry_later(node_id, attempt + 1):
                return None
            detail = f"no answer after {attempt + 1} attempts: {last}"
            return await self._finish(target, "failed", False, detail, "", "", "")
        except ChallengeFailed as err:
            return await self._finish(target, "failed", False, str(err), "", "", "")
        refs = await reg.gate.run_db(self._references, target, recipe, spec.input_id)
        v = verdict(digest, refs)
        return await self._finish(
            target, v.outcome, v.routable, v.detail, digest, recipe, spec.input_id, route_recipe=route_recipe
        )

    # -- relayed nodes: the challenge carried by the relaying gateway ---------------------------

    async def relay_orders(self, gateway_id: str, infos: dict[str, bytes]) -> list[dict[str, Any]]:
        """The challenges the gateway ``gateway_id`` is to carry to the nodes it relays: for each node
        of ``infos`` (node id: the ``NodeInfo`` it gave the gateway in its signed relay hello) waiting
        for its challenge and announced as relayed through that gateway, the session's frames.

        The tracker writes every frame (the ticket, the secret input) and judges the replies the
        gateway brings back (:meth:`relay_result`): the gateway only carries bytes, and the node
        cannot tell this challenge from one the tracker dials."""
        reg = self.registry
        targets = await reg.gate.run_db(
            functools.partial(
                reg.store.trust.relayed_challenges,
                gateway_id,
                sorted(infos),
                self.clock(),
                live_within_s=self.config.heartbeat_timeout_s,
            )
        )
        limits = codec.FrameLimits(max_frame_bytes=MAX_MESSAGE_BYTES)
        orders = []
        for target in targets:
            try:
                _check, recipe, spec = self.check_info(target, infos[target.node_id])
            except ChallengeFailed as err:
                await self._finish(target, "failed", False, str(err), "", "", "")
                continue
            frames, release = self.session_frames(target, recipe, spec, RELAY_ADDRESS_PREFIX + gateway_id)
            orders.append(
                {
                    "node_id": target.node_id,
                    "input_id": spec.input_id,
                    "frames": [_b64(codec.serialize_frame(f, limits)) for f in frames],
                    "release": _b64(codec.serialize_frame(release, limits)),
                    "max_replies": self.config.challenge_tokens + 1,
                    "timeout_s": self.config.challenge_timeout_s,
                }
            )
        return orders

    async def relay_result(
        self, gateway_id: str, node_id: str, info: bytes, input_id: str, replies: list[bytes], error: str
    ) -> Outcome:
        """Judge the replies a relaying gateway brought back from a challenge it carried (see
        :meth:`relay_orders`), exactly as the tracker judges a challenge it dials itself. ``error``:
        the node did not answer (disconnected, too slow): it stays ``challenging``, out of routing,
        and the gateway carries a new challenge on a later round."""
        reg = self.registry
        targets = await reg.gate.run_db(
            functools.partial(
                reg.store.trust.relayed_challenges,
                gateway_id,
                [node_id],
                self.clock(),
                live_within_s=self.config.heartbeat_timeout_s,
            )
        )
        if not targets:
            return Outcome(
                node_id, "gone", False, "the node is not waiting for a challenge carried by this gateway"
            )
        (target,) = targets
        try:
            check, recipe, spec = self.check_info(target, info)
        except ChallengeFailed as err:
            return await self._finish(target, "failed", False, str(err), "", "", "")
        if spec.input_id != input_id:
            return Outcome(node_id, "unanswered", False, "the replies answer another challenge input")
        if error:
            return Outcome(node_id, "unanswered", False, f"the relayed node did not answer: {error[:200]}")
        try:
            digest = self.digest_of_replies(target, spec, replies)
        except ChallengeFailed as err:
            return await self._finish(target, "failed", False, str(err), "", "", "")
        except ProtocolError as err:
            if isinstance(err, _Refused) and err.status in _RETRYABLE:
                return Outcome(node_id, "unanswered", False, f"refused: {err}")
            return await self._finish(target, "failed", False, f"protocol: {err}", "", "", "")
        refs = await reg.gate.run_db(self._references, target, check, spec.input_id)
        v = verdict(digest, refs)
        return await self._finish(
            target, v.outcome, v.routable, v.detail, digest, check, spec.input_id, route_recipe=recipe
        )

    def _references(self, target: ChallengeTarget, recipe: str, input_id: str) -> set[str]:
        return self.registry.store.trust.challenge_references(
            target,
            recipe,
            input_id,
            self.clock(),
            probation_checks=self.config.probation_checks,
            trusted_nodes=self.config.trusted_node_keys(),
        )

    async def _finish(
        self,
        target: ChallengeTarget,
        outcome: str,
        routable: bool,
        detail: str,
        digest: str,
        recipe: str,
        input_id: str,
        *,
        route_recipe: str = "",
    ) -> Outcome:
        reg = self.registry
        moved = await reg.gate.run_db(
            functools.partial(
                reg.store.trust.finish_challenge,
                target,
                recipe=recipe,
                input_id=input_id,
                route_recipe=route_recipe,
                digest=digest,
                outcome=outcome,
                detail=detail,
                routable=routable,
                now_s=self.clock(),
            )
        )
        if moved:
            reg.invalidate_snapshot()
        self.completed += 1
        reg.metrics.inc("swarm_tracker_challenges_total", outcome=outcome)
        result = Outcome(target.node_id, outcome, routable, detail, digest, recipe)
        self._log(target, result)
        return result

    def _log(self, target: ChallengeTarget, result: Outcome) -> None:
        event(
            log,
            "node_challenged",
            level=logging.INFO if result.routable else logging.WARNING,
            node_id=target.node_id,
            model=target.model_fingerprint,
            start=target.start,
            end=target.end,
            outcome=result.outcome,
            routable=result.routable,
            detail=result.detail,
        )

    def _pin(self, target: ChallengeTarget) -> str | None:
        """The node's announced certificate; plaintext only where the configuration allows it."""
        if target.tls_fingerprint:
            return target.tls_fingerprint
        if self.config.allow_plaintext_nodes:
            return None
        raise ChallengeFailed("the node announced no TLS certificate and allow_plaintext_nodes is off")

    async def _attempt(self, target: ChallengeTarget) -> tuple[str, str, ChallengeInput, str]:
        """One attempt: Info, OPEN, PREFILL, RELEASE; returns (the recipe's check fingerprint, the
        recipe's fingerprint, input, digest)."""
        pin = self._pin(target)
        try:
            # A node answers Info in milliseconds: a dead or tarpit address is given up on after
            # challenge_info_timeout_s, not the whole attempt's allowance (which covers the PREFILL).
            with trio.fail_after(self.config.challenge_info_timeout_s):
                raw = await self.grpc.unary(
                    target.address, codec.INFO_METHOD, b"", max_message_bytes=MAX_MESSAGE_BYTES, pin=pin
                )
        except RpcError as err:
            if err.code == "UNAUTHENTICATED":  # another certificate than announced: not that node
                raise ChallengeFailed(f"Info refused: {err}") from err
            raise Unanswered(f"Info failed: {err}") from err
        except trio.TooSlowError as err:
            raise Unanswered(f"no Info answer within {self.config.challenge_info_timeout_s:g} s") from err
        check, recipe, spec = self.check_info(target, raw)
        digest = await self._session(target, recipe, spec)
        return check, recipe, spec, digest

    def check_info(self, target: ChallengeTarget, raw: bytes) -> tuple[str, str, ChallengeInput]:
        """The node's ``Info`` must name the announced key, model, span and width, with a recipe that
        hashes to its fingerprint; returns (the recipe's check fingerprint, the recipe's fingerprint,
        the span's challenge input). Raises :class:`ChallengeFailed`."""
        try:
            info = shard_service_pb2.NodeInfo.FromString(raw)
        except Exception as err:  # protobuf's DecodeError: the peer is not a node
            raise ChallengeFailed(f"Info answer is not a NodeInfo: {err}") from err
        if info.node_id != target.node_id:
            where = target.address or f"relay:{target.relay_via}"
            raise ChallengeFailed(f"the node at {where} is {info.node_id[:16]!r}, not the announced key")
        if (info.model.fingerprint, info.shard.start, info.shard.end) != (
            target.model_fingerprint,
            target.start,
            target.end,
        ):
            raise ChallengeFailed("the node at the announced address serves another model or span")
        if info.model.n_embd != target.n_embd or info.model.n_vocab < 1:
            raise ChallengeFailed("the node reports another width than the model's, or no vocabulary")
        claimed = Recipe.from_wire(info.recipe)
        if (
            claimed.fingerprint() != info.recipe.fingerprint
            or claimed.model_fingerprint != target.model_fingerprint
        ):
            raise ChallengeFailed("the node's runtime recipe does not hash to the fingerprint it gives")
        recipe = info.recipe.fingerprint  # what the session's frames carry
        # References are answers of nodes that compute the same bits: the same recipe and CPU features.
        check = claimed.check_fingerprint()
        spec = challenge_input(
            self._secret,
            model_fingerprint=target.model_fingerprint,
            start=target.start,
            end=target.end,
            n_layers=target.n_layers,
            n_embd=target.n_embd,
            n_vocab=int(info.model.n_vocab),
            n_tokens=self.config.challenge_tokens,
        )
        return check, recipe, spec

    def session_frames(
        self, target: ChallengeTarget, recipe: str, spec: ChallengeInput, address: str
    ) -> tuple[list[frame_pb2.Frame], frame_pb2.Frame]:
        """The challenge session's frames: (OPEN and the PREFILL's chunks, the RELEASE), under a
        tracker-signed ticket for a one-hop route to ``address``."""
        reg = self.registry
        now = self.clock()
        ticket = RouteTicket(
            tracker_id=reg.tracker_id,
            session_id=secrets.token_hex(16),
            model_fingerprint=target.model_fingerprint,
            hops=(TicketHop(target.node_id, target.start, target.end, address, target.tls_fingerprint),),
            issued_at_s=now,
            expires_at_s=now + self.config.challenge_timeout_s,
        )
        envelope = sign_route_ticket(reg.key, ticket)
        header = codec.SessionHeader(
            ticket.session_id,
            1,
            target.model_fingerprint,
            recipe,
            target.start,
            target.end,
            request_id="tracker-challenge",
        )
        n = self.config.challenge_tokens
        opening = codec.open_frame(
            header,
            step_id=1,
            route_ticket=route_ticket_bytes(envelope),
            kv_budget_tokens=n + 1,
            sampling=codec.SamplingSettings(temperature=0.0, n_top_logprobs=TOP_LOGPROBS),
            max_frame_bytes=MAX_MESSAGE_BYTES,
            # Batch-invariant answers (docs/security.md, Limits): a busy honest node
            # answers like an idle one. The challenge is one recognisable step anyway.
            isolated=True,
        )
        steps = codec.step_frames(
            header,
            frame_pb2.PHASE_PREFILL,
            step_id=2,
            start=0,
            token_ids=spec.token_ids,
            hidden=spec.hidden,
            sample=spec.sample,
            max_frame_bytes=MAX_MESSAGE_BYTES,
        )
        return [opening, *steps], codec.release_frame(header, step_id=n + 3, expected_kv_len=n)

    def digest_of_replies(self, target: ChallengeTarget, spec: ChallengeInput, replies: list[bytes]) -> str:
        """The digest of a session's replies (the OPEN's acknowledgement, then the PREFILL's result
        chunks), refusing answers that are wrong in themselves (:class:`ChallengeFailed`, or
        :class:`_Refused` for a node that refused the session)."""
        n = self.config.challenge_tokens
        limits = codec.FrameLimits(max_frame_bytes=MAX_MESSAGE_BYTES)
        if not replies:
            raise ChallengeFailed("no answer")
        _expect(codec.parse_frame(replies[0], limits), "open_ack")  # a refusal: _Refused
        if len(replies) < 2:
            raise ChallengeFailed("the answer has no result")
        frames = [_expect(codec.parse_frame(raw, limits), "result") for raw in replies[1:]]
        if len(frames) > n:
            raise ChallengeFailed("the answer has more chunks than positions")
        last = frames[-1]
        if last.HasField("chunk") and last.chunk.index < last.chunk.count - 1:
            raise ChallengeFailed("the answer ends before its last chunk")
        return _digest(frames, spec, n, target.n_embd, limits)

    async def _session(self, target: ChallengeTarget, recipe: str, spec: ChallengeInput) -> str:
        n = self.config.challenge_tokens
        limits = codec.FrameLimits(max_frame_bytes=MAX_MESSAGE_BYTES)
        frames, release = self.session_frames(target, recipe, spec, target.address)
        try:
            async with self.grpc.open_stream(
                target.address,
                codec.SESSION_METHOD,
                max_message_bytes=MAX_MESSAGE_BYTES,
                pin=self._pin(target),
            ) as stream:
                await stream.send(codec.serialize_frame(frames[0], limits))
                _expect(codec.parse_frame(await stream.receive(), limits), "open_ack")
                for frame in frames[1:]:
                    await stream.send(codec.serialize_frame(frame, limits))
                replies = [_expect(codec.parse_frame(await stream.receive(), limits), "result")]
                while replies[-1].HasField("chunk") and replies[-1].chunk.index < replies[-1].chunk.count - 1:
                    if len(replies) > n:
                        raise ChallengeFailed("the answer has more chunks than positions")
                    replies.append(_expect(codec.parse_frame(await stream.receive(), limits), "result"))
                digest = _digest(replies, spec, n, target.n_embd, limits)
                await stream.send(codec.serialize_frame(release, limits))
                with trio.move_on_after(2.0):
                    await stream.receive()  # closed (best effort: the session times out on the node anyway)
                return digest
        except StreamClosed as err:
            raise Unanswered(f"session stream failed: {err}") from err
        except ProtocolError as err:
            if isinstance(err, _Refused) and err.status in _RETRYABLE:
                raise Unanswered(f"refused: {err}") from err
            raise ChallengeFailed(f"protocol: {err}") from err


class _Refused(ProtocolError):
    def __init__(self, status: int, message: str) -> None:
        self.status = status  # type: ignore[assignment]
        super().__init__(message)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _expect(frame: frame_pb2.Frame, kind: str) -> frame_pb2.Frame:
    got = codec.body_kind(frame)
    if got == "error":
        err = error_from_body(frame.error)
        raise _Refused(frame.error.status, f"{err.status_name}: {err.message}")
    if got != kind:
        raise ChallengeFailed(f"expected {kind}, got {got}")
    return frame


def _digest(
    replies: list[frame_pb2.Frame],
    spec: ChallengeInput,
    n_tokens: int,
    n_embd: int,
    limits: codec.FrameLimits,
) -> str:
    """The digest of a node's answer (refusing answers that are inconsistent in themselves)."""
    step = codec.reassemble(replies, limits)
    if (step.start, step.end) != (0, n_tokens):
        raise ChallengeFailed(f"the answer covers positions [{step.start}, {step.end}), not [0, {n_tokens})")
    if spec.sample:
        if len(step.sampled) != 1:
            raise ChallengeFailed("the last stage answered without exactly one sampled token")
        t = step.sampled[0]
        return sampled_digest(
            t.token_id, t.logprob, [(p.token_id, p.logprob) for p in t.top_logprobs], t.end_of_generation
        )
    hidden = step.tensors.get(codec.HIDDEN)
    if hidden is None or hidden.shape != (n_tokens, n_embd):
        raise ChallengeFailed("the answer has no output rows of the model's width")
    digest = codec.output_digest(hidden)
    claimed = bytes(replies[-1].result.output_digest)
    if claimed != digest:
        raise ChallengeFailed("the node's output digest does not match the rows it sent")
    return digest.hex()
