"""Who speculates: the gateway's speculation / speculation_max_drafts and a request's own speculation."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.errors import InvalidRequest
from gateway.prompt_plan import PROPOSERS, sampling_settings
from gateway.protocol import parse_chat_request
from proto import codec
from proto.swarm.v1 import frame_pb2


def drafts(config: GatewayConfig, temperature: float, override: bool | None = None, **kw: bool) -> int:
    return config.speculation_drafts(
        temperature, override, grammar=kw.get("grammar", False), checked=kw.get("checked", False)
    )


def test_greedy_requests_speculate_by_default_and_a_request_can_override() -> None:
    config = GatewayConfig().validate()
    assert drafts(config, 0.0) == 8
    assert drafts(config, 0.7) == 0
    assert drafts(config, 0.7, True) == 8  # exact under the request's seed: allowed when asked
    assert drafts(config, 0.0, False) == 0
    assert drafts(config, 0.0, grammar=True) == 0 and drafts(config, 0.0, True, grammar=True) == 0
    assert drafts(config, 0.0, True, checked=True) == 0


def test_modes_and_bounds() -> None:
    assert drafts(GatewayConfig(speculation="all").validate(), 1.0) == 8
    assert drafts(GatewayConfig(speculation="off").validate(), 0.0) == 0
    assert drafts(GatewayConfig(speculation="off").validate(), 0.0, True) == 8
    assert drafts(GatewayConfig(speculation_max_drafts=3).validate(), 0.0) == 3
    assert drafts(GatewayConfig(speculation_max_drafts=0).validate(), 0.0, True) == 0
    with pytest.raises(ConfigError, match="speculation must be"):
        GatewayConfig(speculation="sometimes").validate()
    with pytest.raises(ConfigError, match="speculation_max_drafts"):
        GatewayConfig(speculation_max_drafts=16).validate()


def test_the_request_field_is_a_boolean_or_a_proposer() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(base).speculation is None
    assert parse_chat_request({**base, "speculation": False}).speculation is False
    assert parse_chat_request({**base, "speculation": True}).speculation is True
    want = {
        "off": (False, ""),
        "ngram": (True, "ngram"),
        "draft": (True, "draft"),
        "auto": (None, ""),
    }
    for value, (on, proposer) in want.items():
        request = parse_chat_request({**base, "speculation": value})
        assert (request.speculation, request.proposer) == (on, proposer)
        assert (
            sampling_settings(request, seed=0, index=0, grammar="", prompt_tokens=1, check_top_logprobs=0)
            .to_wire()
            .proposer
            == PROPOSERS[proposer]
        )
    assert parse_chat_request({**base, "speculation": True}).proposer == ""
    for bad in ("yes", "Draft", 1, ["ngram"]):
        with pytest.raises(InvalidRequest, match="'speculation' must be true, false or one of") as caught:
            parse_chat_request({**base, "speculation": bad})
        assert caught.value.param == "speculation"


def test_the_proposer_travels_in_the_open() -> None:
    wire = codec.SamplingSettings(proposer=frame_pb2.PROPOSER_DRAFT).to_wire().SerializeToString()
    assert (
        codec.sampling_settings(frame_pb2.SamplingParams.FromString(wire)).proposer
        == frame_pb2.PROPOSER_DRAFT
    )
    assert codec.sampling_settings(frame_pb2.SamplingParams()).proposer == frame_pb2.PROPOSER_UNSPECIFIED
