"""A scripted stand-in for a node: real gRPC on loopback, real frames (proto.codec), no model.

It speaks the Session protocol exactly (OPEN/steps/RELEASE/CANCEL with KV
length and step checks), answers Info and GetVocab (the test model's real
vocabulary file), and instead of computing, a last stage "samples" the next
token of a fixed script (the next one after the part of the script the
session's history ends with, so a session replayed on another route
continues the same text). Used for the gateway's in-process tests: HTTP API,
SSE, errors, admission and disconnect handling without llama.cpp. Tests that
check the numbers use real ``swarm-node`` processes instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import nacl.signing
import numpy as np

from proto import codec, errors
from proto.recipe import Recipe
from proto.signing import public_key_hex
from proto.swarm.v1 import frame_pb2, shard_service_pb2
from proto.vocab import vocab_chunks

N_EMBD = 576
# Scripted failures shared by every fake node of a test: the next ``left`` decode steps that find a session
# past ``after`` generated tokens get INTERNAL.
FAILURES: dict[str, int] = {"left": 0, "after": 0}


@dataclass
class FakeState:
    sessions: dict[str, int] = field(default_factory=dict)  # session id -> kv_len
    history: dict[str, list[int]] = field(default_factory=dict)  # last stage: token ids seen per session
    epochs: dict[str, int] = field(default_factory=dict)
    opened: int = 0
    released: int = 0
    cancelled: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


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
    ) -> None:
        self.key = nacl.signing.SigningKey(bytes([seed]) * 32)
        self.node_id = public_key_hex(self.key)
        self.fingerprint, self.start, self.end, self.n_layers = fingerprint, start, end, n_layers
        self.recipe = Recipe("fake", fingerprint, "f16", True)
        self.vocab, self.script, self.eos = vocab, script, eos
        self.step_delay_s = step_delay_s
        self.kv_per_session = kv_per_session
        self.state = FakeState()
        self.is_last = end == n_layers
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handlers = {
            "Session": grpc.stream_stream_rpc_method_handler(self._session),
            "Info": grpc.unary_unary_rpc_method_handler(
                self._info,
                request_deserializer=shard_service_pb2.InfoRequest.FromString,
                response_serializer=shard_service_pb2.NodeInfo.SerializeToString,
            ),
            "GetVocab": grpc.unary_stream_rpc_method_handler(
                self._get_vocab,
                request_deserializer=shard_service_pb2.VocabRequest.FromString,
                response_serializer=shard_service_pb2.VocabChunk.SerializeToString,
            ),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("swarm.v1.ShardService", handlers),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)

    def _info(self, request: object, context: object) -> shard_service_pb2.NodeInfo:
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
            serves_vocab=self.is_last,
        )

    def _get_vocab(
        self, request: shard_service_pb2.VocabRequest, context: object
    ) -> Iterator[shard_service_pb2.VocabChunk]:
        yield from vocab_chunks(self.vocab, model_fingerprint=self.fingerprint, chunk_bytes=512 * 1024)

    def _session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        assembler = codec.StepAssembler()
        for data in requests:
            try:
                frame = codec.parse_frame(data)
                replies = self._handle(frame, assembler)
                if replies is None:
                    continue
                assembler = codec.StepAssembler()
            except errors.ProtocolError as exc:
                assembler = codec.StepAssembler()
                yield codec.serialize_frame(codec.error_frame(exc))
                continue
            for reply in replies:
                yield codec.serialize_frame(reply)

    def _generated(self, history: list[int]) -> int:
        """How much of the script the history already ends with: a "model" that is the same on every route."""
        for k in range(min(len(self.script), len(history)), 0, -1):
            if history[-k:] == self.script[:k]:
                return k
        return 0

    def _handle(self, frame: frame_pb2.Frame, assembler: codec.StepAssembler) -> list[frame_pb2.Frame] | None:
        st, sid, kind = self.state, frame.session_id, codec.body_kind(frame)
        if kind == "open":
            if frame.open.kv_budget.max_tokens > self.kv_per_session:
                raise errors.ResourceExhaustedError("budget too large")
            with st.lock:
                reattached = sid in st.sessions
                if reattached:
                    # Re-attach (docs/protocol.md, Recovery): a higher epoch keeps the KV prefix asked for.
                    if frame.route_epoch <= st.epochs[sid]:
                        raise errors.RouteEpochError(f"epoch {frame.route_epoch} is not newer")
                    kv = min(st.sessions[sid], int(frame.expected_kv_len))
                    st.sessions[sid] = kv
                    st.history[sid] = st.history[sid][:kv]
                else:
                    kv = 0
                    st.sessions[sid] = 0
                    st.history[sid] = []
                    st.opened += 1
                st.epochs[sid] = int(frame.route_epoch)
            return [
                codec.open_ack_frame(
                    frame,
                    reattached=reattached,
                    kv_len=kv,
                    node_id=self.node_id,
                    kv_tokens_granted=frame.open.kv_budget.max_tokens,
                    max_frame_bytes=4 << 20,
                    max_step_tokens=512,
                )
            ]
        if kind in ("release", "cancel"):
            with st.lock:
                freed = st.sessions.pop(sid, 0)
                st.history.pop(sid, None)
                st.epochs.pop(sid, None)
                if kind == "release":
                    st.released += 1
                else:
                    st.cancelled += 1
            return [codec.closed_frame(frame, freed_kv_tokens=freed)]
        if sid not in st.sessions:
            raise errors.UnknownSessionError("no such session")
        if frame.route_epoch != st.epochs[sid]:
            raise errors.RouteEpochError(f"epoch {frame.route_epoch}, the session is at {st.epochs[sid]}")
        step = assembler.add(frame)
        if step is None:
            return None
        if step.expected_kv_len != st.sessions[sid]:
            raise errors.PositionMismatchError("kv mismatch")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        with st.lock:
            generated = self._generated(st.history[sid])
            if (
                self.is_last
                and step.phase == frame_pb2.PHASE_DECODE
                and FAILURES["left"] > 0
                and generated >= FAILURES["after"]
            ):
                FAILURES["left"] -= 1
                raise errors.InternalError("scripted failure")
            st.history[sid].extend(int(t) for t in step.token_ids)
        with st.lock:
            st.sessions[sid] = step.end
        if not self.is_last:
            return codec.result_frames(
                step, kv_len=step.end, hidden=np.zeros((step.n_tokens, N_EMBD), np.float32)
            )
        sampled: list[frame_pb2.SampledToken] = []
        if step.sample:
            with st.lock:
                k = self._generated(st.history[sid])
            token = self.script[k] if k < len(self.script) else self.eos
            sampled.append(
                frame_pb2.SampledToken(
                    token_id=token,
                    logprob=-0.25,
                    top_logprobs=[
                        frame_pb2.TokenLogprob(token_id=token, logprob=-0.25),
                        frame_pb2.TokenLogprob(token_id=self.eos, logprob=-3.0),
                    ],
                    end_of_generation=token == self.eos,
                )
            )
        return codec.result_frames(step, kv_len=step.end, sampled=sampled)
