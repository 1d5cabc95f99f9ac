"""Request translation and validation, response shapes (pure)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import protocol
from gateway.errors import InvalidRequest, error_body
from gateway.protocol import TokenLogprob, parse_chat_request, parse_completion_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**kw: object) -> dict:
    return {**CHAT, **kw}


def test_chat_defaults() -> None:
    r = parse_chat_request(CHAT)
    assert r.kind == "chat" and r.model == "m" and r.messages[0].content == "hi"
    assert r.max_tokens is None and r.temperature == 1.0 and r.top_p == 1.0 and r.seed is None
    assert r.stop == () and not r.stream and not r.include_usage and r.n_top_logprobs == 0


def test_chat_full() -> None:
    r = parse_chat_request(
        chat(
            max_completion_tokens=5,
            max_tokens=9,
            temperature=0,
            top_p=0.5,
            seed=-1,
            frequency_penalty=0,
            presence_penalty=0.0,
            stop="\n",
            n=1,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=3,
            user="u",
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "q", "name": "bob"},
            ],
        )
    )
    assert r.max_tokens == 5  # max_completion_tokens wins over the legacy max_tokens
    assert r.temperature == 0.0 and r.top_p == 0.5 and r.seed == 2**63 - 1
    assert r.stop == ("\n",) and r.stream and r.include_usage and r.n_top_logprobs == 3
    assert r.messages[0].content == "ab" and r.messages[1].to_template() == {
        "role": "user",
        "content": "q",
        "name": "bob",
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(temperature=-1), "temperature"),
        (chat(temperature=2.5), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(n=17), "n"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=-3), "max_completion_tokens"),
        (chat(top_p=1.5), "top_p"),
        (chat(top_logprobs=3), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(stop=5), "stop"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(logit_bias={"x": 5}), "logit_bias"),
        (chat(logit_bias={"1": 101}), "logit_bias"),
        (chat(tools=[{"type": "function"}]), "tools[0].function.name"),
        (chat(tools=[{"type": "retrieval"}]), "tools[0].type"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(functions=[{"name": "f"}]), "functions"),
        (chat(ignore_eos=True), "ignore_eos"),
        (chat(guided_json={"type": "object"}), "guided_json"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(seed=1.5), "seed"),
        (chat(stream="yes"), "stream"),
        ({"messages": CHAT["messages"]}, "model"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content"),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    ],
)
def test_chat_refusals(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and info.value.param == param
    shaped = error_body(info.value)["error"]
    assert set(shaped) == {"message", "type", "param", "code"} and shaped["type"] == "invalid_request_error"


def test_body_not_an_object() -> None:
    for parse in (parse_chat_request, parse_completion_request):
        with pytest.raises(InvalidRequest):
            parse([1, 2])


def test_completion_prompts() -> None:
    r = parse_completion_request({"model": "m", "prompt": "abc"})
    assert r.prompt_text == "abc" and r.prompt_tokens is None and r.max_tokens == 16
    assert parse_completion_request({"model": "m", "prompt": ["abc"]}).prompt_text == "abc"
    assert parse_completion_request({"model": "m", "prompt": [1, 2, 3]}).prompt_tokens == (1, 2, 3)
    assert parse_completion_request({"model": "m", "prompt": [[4, 5]]}).prompt_tokens == (4, 5)
    r = parse_completion_request({"model": "m", "prompt": "x", "logprobs": 2, "max_tokens": None})
    assert r.logprobs and r.n_top_logprobs == 2 and r.max_tokens is None
    assert not parse_completion_request({"model": "m", "prompt": "x", "logprobs": None}).logprobs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),  # several: parse_completion_batch
        ({"model": "m", "prompt": ["a", 1]}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": 3}, "prompt"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_completion_refusals(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request(body)
    assert info.value.param == param


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "temperature",
                "top_p",
                "n",
                "max_tokens",
                "seed",
                "stop",
                "logprobs",
                "top_logprobs",
                "stream",
                "presence_penalty",
            ]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-5, 5),
            st.floats(allow_nan=True),
            st.text(max_size=3),
            st.lists(st.text(max_size=2), max_size=5),
        ),
    )
)
def test_parse_never_crashes(extra: dict) -> None:
    """Whatever the values, parsing returns a request or raises InvalidRequest, nothing else."""
    try:
        r = parse_chat_request({**CHAT, **extra})
    except InvalidRequest:
        return
    assert 0 <= r.temperature <= 2 and 0 < r.top_p <= 1 and (r.max_tokens is None or r.max_tokens >= 1)


def test_logprob_formats() -> None:
    entries = [
        TokenLogprob("He", b"He", -0.5, (("He", b"He", -0.5), ("A", b"A", -1.0))),
        TokenLogprob("llo", b"llo", float("-inf"), ()),
    ]
    c = protocol.chat_logprobs(entries)
    assert c["content"][0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "A", "logprob": -1.0, "bytes": [65]},
        ],
    }
    assert c["content"][1]["logprob"] == -9999.0  # JSON has no -Infinity
    p = protocol.completion_logprobs(entries, 10)
    assert p == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"He": -0.5, "A": -1.0}, {}],
        "text_offset": [10, 12],
    }
    json.dumps(c, allow_nan=False)


def test_response_shapes() -> None:
    full = protocol.chat_completion("id", 1, "m", "hello", "stop", None, 3, 2, "fp")
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"] == "hello"
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = protocol.chat_chunk("id", 1, "m", "fp", delta={"content": "x"}, include_usage=True)
    assert chunk["usage"] is None and chunk["choices"][0]["delta"] == {"content": "x"}
    last = protocol.chat_chunk(
        "id", 1, "m", "fp", usage_block=protocol.usage(1, 1), include_usage=True, usage_only=True
    )
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 2
    text = protocol.text_completion("id", 1, "m", "t", "length", [], 1, 1, "fp")
    assert text["object"] == "text_completion" and text["choices"][0]["logprobs"]["tokens"] == []
    assert protocol.sse_event("[DONE]") == b"data: [DONE]\n\n"
    listed = protocol.model_list([{"name": "a", "fingerprint": "f", "n_layers": 30, "live_nodes": 2}], 5)
    assert listed["data"][0]["id"] == "a" and listed["object"] == "list"
