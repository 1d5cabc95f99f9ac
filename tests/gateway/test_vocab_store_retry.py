"""The gateway waits (bounded) for nodes that answer UNAVAILABLE to GetVocab.

Found by ``sim.bench_join`` on the 4 GB model: the first request after the
swarm formed got a 502 from every node (they were still writing their
vocabulary files; a node now writes it before it serves, but a node not
listening yet or restarting answers the same). The node side is the real gRPC
service elsewhere (tests/node); here the gateway's ``VocabStore`` talks to a
scripted stand-in for ``NodeChannels`` under trio's mock clock, so the waits
cost no real time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from gateway import vocab_store
from gateway.errors import UpstreamFailed
from gateway.grpc_bridge import StreamError
from gateway.routes import StageInfo
from gateway.vocab_store import VocabStore

FP = "ab" * 32


class Channels:
    """``get_vocab`` answers ``answers`` in turn (an exception is raised), then ``b"vocab"``."""

    def __init__(self, answers: list[Exception]) -> None:
        self.answers = list(answers)
        self.vocab_calls: list[tuple[str, float]] = []

    async def manifest(self, address: str, fingerprint: str) -> bytes:
        raise StreamError(f"{address}: no manifest (an unregistered model: used unchecked)")

    async def get_vocab(self, address: str, fingerprint: str, max_bytes: int) -> bytes:
        self.vocab_calls.append((address, trio.current_time()))
        if self.answers:
            raise self.answers.pop(0)
        return b"vocab"


def stage(address: str) -> StageInfo:
    return StageInfo("n-" + address, address, "r", 8, 30, 8192, True, True, 1 << 20, 512, 512, 0.0)


def download(tmp_path: Path, channels: Channels, stages: list[StageInfo]) -> bytes:
    store = VocabStore(tmp_path, channels, timeout_s=5.0)  # type: ignore[arg-type]
    try:
        return trio.run(store._download, FP, stages, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        store.close()


def unavailable() -> StreamError:
    return StreamError("UNAVAILABLE: failed to connect to all addresses", transient=True)


def test_a_node_not_ready_is_asked_again_until_it_serves(tmp_path: Path) -> None:
    channels = Channels([unavailable(), unavailable(), unavailable()])
    assert download(tmp_path, channels, [stage("a:1")]) == b"vocab"
    times = [t for _, t in channels.vocab_calls]
    assert len(times) == 4
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps == pytest.approx([0.5, 1.0, 2.0])  # backing off, not hammering


def test_another_node_that_serves_is_used_at_once(tmp_path: Path) -> None:
    channels = Channels([unavailable()])
    assert download(tmp_path, channels, [stage("a:1"), stage("b:2")]) == b"vocab"
    assert [a for a, _ in channels.vocab_calls] == ["a:1", "b:2"]
    assert channels.vocab_calls[1][1] == channels.vocab_calls[0][1]


def test_a_lasting_failure_is_not_waited_for(tmp_path: Path) -> None:
    channels = Channels([StreamError("NOT_FOUND: this node serves another model")])
    with pytest.raises(UpstreamFailed) as err:
        download(tmp_path, channels, [stage("a:1")])
    assert len(channels.vocab_calls) == 1
    assert err.value.retry_after_s is None


def test_the_wait_is_bounded_and_says_when_to_retry(tmp_path: Path) -> None:
    channels = Channels([unavailable() for _ in range(1000)])
    with pytest.raises(UpstreamFailed) as err:
        download(tmp_path, channels, [stage("a:1")])
    times = [t for _, t in channels.vocab_calls]
    assert times[-1] - times[0] <= vocab_store.VOCAB_WAIT_S
    assert len(times) < 30
    assert err.value.retry_after_s == 5
    assert "failed to connect to all addresses" in str(err.value)
