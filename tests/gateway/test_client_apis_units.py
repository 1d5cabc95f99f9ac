"""The pure translations behind the Responses API, Ollama's API and several-prompt completions
(gateway/responses_api.py, gateway/response_store.py, gateway/ollama_api.py, protocol.parse_completion_batch):
no process, no network."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import ollama_api, responses_api
from gateway.errors import InvalidRequest
from gateway.protocol import ToolCall, merge_completions, parse_completion_batch, text_completion
from gateway.response_store import ResponseStore

# --------------------------------------------------------------------------- several prompts


def test_batch_of_strings_and_token_arrays_keeps_order_and_settings() -> None:
    batch = parse_completion_batch(
        {"model": "m", "prompt": ["a", [1, 2], "c"], "n": 2, "temperature": 0.5, "max_tokens": 7}
    )
    assert [(r.prompt_text, r.prompt_tokens) for r in batch] == [("a", None), (None, (1, 2)), ("c", None)]
    assert {(r.n, r.temperature, r.max_tokens) for r in batch} == {(2, 0.5, 7)}
    assert len(parse_completion_batch({"model": "m", "prompt": [5, 6, 7]})) == 1  # one token-id prompt


@pytest.mark.parametrize(
    ("prompt", "n"),
    [(["x"] * 17, 1), (["x"] * 5, 16), ([[]], 1), ([["a"]], 1), ([1, "a"], 1), ([], 1)],
)
def test_batch_refusals(prompt: Any, n: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_batch({"model": "m", "prompt": prompt, "n": n})
    assert info.value.param in ("prompt", "n")


def test_merge_reindexes_choices_and_sums_usage() -> None:
    bodies = []
    for i in range(3):
        body = text_completion(f"cmpl-{i}", 1, "m", f"t{i}", "stop", None, 10 + i, 2, "fp")
        body["choices"] = [{**body["choices"][0], "index": j, "text": f"p{i}c{j}"} for j in range(2)]
        bodies.append(body)
    merged = merge_completions(bodies, 2)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (i * 2 + j, f"p{i}c{j}") for i in range(3) for j in range(2)
    ]
    assert merged["id"] == "cmpl-0"
    assert merged["usage"] == {"prompt_tokens": 33, "completion_tokens": 6, "total_tokens": 39}


# --------------------------------------------------------------------------- Responses


def test_responses_request_becomes_the_chat_request_it_means() -> None:
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    rr = responses_api.parse_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Let me"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"Rome"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "w"},
            "max_output_tokens": 33,
            "temperature": 0.2,
            "top_p": 0.5,
            "metadata": {"k": "v"},
            "store": False,
            "reasoning": {"effort": "low"},  # ignored (no reasoning models here)
        },
        history,
    )
    chat = rr.chat
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "tool", "tool"]
    assert chat.messages[0].content == "Be brief."
    assistant = chat.messages[4]
    assert assistant.content == "Let me" and [c.id for c in assistant.tool_calls] == ["c1", "c2"]
    assert [m.tool_call_id for m in chat.messages[5:]] == ["c1", "c2"] and chat.messages[6].content == "rain"
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (33, 0.2, 0.5)
    assert chat.tool_choice == "function" and chat.tool_name == "w"
    assert [m["role"] for m in rr.turn][0:2] == ["user", "assistant"]  # history first, no instructions
    assert len(rr.turn) == 6 and not rr.store and rr.previous_response_id is None
    assert rr.echo["metadata"] == {"k": "v"} and rr.echo["max_output_tokens"] == 33


def test_responses_text_format_and_string_input() -> None:
    rr = responses_api.parse_request(
        {
            "model": "m",
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}},
            "stream": True,
        }
    )
    assert rr.chat.response_format.kind == "json_schema" and rr.chat.response_format.name == "p"
    assert [m.role for m in rr.chat.messages] == ["user"] and rr.stream and rr.store


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": [{"type": "input_image"}]}, "input[0].type"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "temperature": 5}, "temperature"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"model": "m", "input": "x", "previous_response_id": 3}, "previous_response_id"),
        ({"input": "x"}, "model"),
    ],
)
def test_responses_refusals_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        responses_api.parse_request(body)
    assert info.value.param == param, info.value.message


def test_responses_stream_events_in_order_with_sequence_numbers() -> None:
    rr = responses_api.parse_request({"model": "m", "input": "hi"})
    stream = responses_api.EventStream("resp_abc", 5, rr)
    events = stream.start() + stream.delta("Hel") + stream.delta("") + stream.delta("lo")
    events += stream.end(())
    last, final = stream.finish("stop", responses_api.usage(3, 2))
    events.append(last)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[6]["text"] == "Hello" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 5
    assert responses_api.sse_frame(events[4]).startswith(b"event: response.output_text.delta\ndata: {")


def test_responses_stream_tool_calls_and_length_and_failure() -> None:
    rr = responses_api.parse_request({"model": "m", "input": "hi"})
    stream = responses_api.EventStream("resp_x", 1, rr)
    calls = (ToolCall("call_1", "w", '{"a": 1}'), ToolCall("call_2", "v", "{}"))
    events = stream.start() + stream.end(calls)
    kinds = [e["type"] for e in events[2:]]
    assert (
        kinds
        == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        * 2
    )
    assert [e["output_index"] for e in events[2:]] == [0] * 4 + [1] * 4
    assert events[5]["item"] == {
        "type": "function_call",
        "id": "fc_x_0",
        "call_id": "call_1",
        "name": "w",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    last, final = stream.finish("length", responses_api.usage(1, 1))
    assert last["type"] == "response.incomplete" and final["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert (
        len(final["output"]) == 2
        and responses_api.assistant_turn("", calls)["tool_calls"][1]["id"] == "call_2"
    )

    failing = responses_api.EventStream("resp_y", 1, rr)
    failing.start()
    failing.delta("par")
    error, failed = failing.fail(
        {"message": "A node failed", "type": "server_error", "code": "upstream_failed"}
    )
    assert error == {
        "type": "error",
        "sequence_number": 5,
        "code": "upstream_failed",
        "message": "A node failed",
        "param": None,
    }
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "upstream_failed"


def test_output_items_skip_an_empty_message_before_calls() -> None:
    call = ToolCall("c", "f", "{}")
    assert [o["type"] for o in responses_api.output_items("resp_1", "", (call,))] == ["function_call"]
    assert [o["type"] for o in responses_api.output_items("resp_1", "so", (call,))] == [
        "message",
        "function_call",
    ]
    assert [o["type"] for o in responses_api.output_items("resp_1", "", ())] == ["message"]


# --------------------------------------------------------------------------- store


def test_store_is_per_owner_bounded_and_expires() -> None:
    store = ResponseStore(max_entries=2, ttl_s=10.0, max_chars=10_000)
    msg = [{"role": "user", "content": "x"}]
    assert store.put("alice", "r1", msg, {"id": "r1"}, now=0.0)
    assert store.get("bob", "r1", now=1.0) is None  # another owner's id reads as absent
    assert store.get("alice", "r1", now=1.0) is not None
    store.put("alice", "r2", msg, {"id": "r2"}, now=2.0)
    store.get("alice", "r1", now=3.0)  # r1 is now the most recently used
    store.put("alice", "r3", msg, {"id": "r3"}, now=4.0)  # evicts r2
    assert store.get("alice", "r2", now=4.0) is None and store.get("alice", "r1", now=4.0) is not None
    assert store.get("alice", "r3", now=14.5) is None  # past its TTL
    assert not store.delete("bob", "r1", now=5.0) and store.delete("alice", "r1", now=5.0)
    assert store.statistics().entries == 0

    small = ResponseStore(max_entries=100, ttl_s=10.0, max_chars=200)
    assert not small.put("a", "big", [{"role": "user", "content": "y" * 300}], {}, now=0.0)
    for i in range(10):
        small.put("a", f"r{i}", msg, {"id": f"r{i}"}, now=0.0)
    stats = small.statistics()
    assert stats.chars <= 200 and 0 < stats.entries < 10 and small.get("a", "r9", now=0.0) is not None


# --------------------------------------------------------------------------- Ollama


def test_ollama_chat_maps_options_and_defaults() -> None:
    req = ollama_api.parse_chat(
        {
            "model": "smol:latest",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 12, "repeat_penalty": 1.2, "seed": 4, "stop": "\n", "num_ctx": 4096},
        }
    )
    r = req.request
    assert r is not None and req.stream and req.model == "smol:latest"
    assert (r.model, r.max_tokens, r.repetition_penalty, r.seed, r.stop) == ("smol", 12, 1.2, 4, ("\n",))
    assert (r.temperature, r.top_k, r.top_p) == (0.8, 40, 0.9)  # Ollama's defaults
    assert req.ignored_options == ("num_ctx",)
    plain = ollama_api.parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "stream": False,
            "options": {"num_predict": -1},
        }
    )
    assert plain.request is not None and plain.request.max_tokens is None and not plain.stream


def test_ollama_tools_format_and_tool_messages() -> None:
    req = ollama_api.parse_chat(
        {
            "model": "m",
            "format": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "messages": [
                {"role": "user", "content": "w?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "w", "arguments": {"c": 1}}}],
                },
                {"role": "tool", "tool_name": "w", "content": "sunny"},
            ],
        }
    )
    r = req.request
    assert r is not None and r.response_format.kind == "json_schema"
    call = r.messages[1].tool_calls[0]
    assert json.loads(call.arguments) == {"c": 1} and r.messages[2].tool_call_id == call.id
    as_json = ollama_api.parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "format": "json"}
    )
    assert as_json.request is not None and as_json.request.response_format.kind == "json_object"


def test_ollama_generate_templated_raw_and_load() -> None:
    templated = ollama_api.parse_generate({"model": "m", "prompt": "hi", "system": "be nice"})
    assert templated.request is not None and templated.request.kind == "chat"
    assert [m.role for m in templated.request.messages] == ["system", "user"]
    raw = ollama_api.parse_generate(
        {"model": "m", "prompt": "hi", "raw": True, "options": {"num_predict": 3}}
    )
    assert raw.request is not None and raw.request.kind == "completion" and raw.request.prompt_text == "hi"
    assert raw.request.max_tokens == 3
    assert ollama_api.parse_generate({"model": "m"}).request is None  # load only
    assert ollama_api.parse_chat({"model": "m", "messages": []}).request is None


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "x", "images": ["aGk="]},
        {"model": "m", "prompt": "x", "suffix": "y"},
        {"model": "m", "prompt": "x", "context": [1, 2]},
        {"model": "m", "prompt": "x", "options": {"mirostat": 2}},
        {"model": "m", "prompt": "x", "options": {"num_predict": 0}},
        {"model": "m", "prompt": "x", "options": {"temperature": 3}},
        {"model": "m", "prompt": "x", "options": "hot"},
        {"model": "m", "prompt": "x", "format": "yaml"},
        {"model": "m", "prompt": "x", "stream": "yes"},
        {"prompt": "x"},
    ],
)
def test_ollama_refusals(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        ollama_api.parse_generate(body)


def test_ollama_response_shapes() -> None:
    assert ollama_api.timestamp(1700000000.25) == "2023-11-14T22:13:20.250000000Z"
    timing = ollama_api.Timing.of(2.0, 0.5)
    line = ollama_api.final(
        "chat",
        "m:latest",
        0.0,
        text="",
        done_reason="tool_calls",
        prompt_tokens=7,
        completion_tokens=9,
        timing=timing,
        calls=(ToolCall("c1", "w", '{"city": "Paris"}'),),
    )
    assert line["done"] and line["done_reason"] == "stop"
    assert line["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert (line["total_duration"], line["prompt_eval_duration"], line["eval_duration"]) == (
        2_000_000_000,
        500_000_000,
        1_500_000_000,
    )
    assert (line["prompt_eval_count"], line["eval_count"], line["load_duration"]) == (7, 9, 0)
    assert ollama_api.chunk("generate", "m", 0.0, "x") == {
        "model": "m",
        "created_at": "1970-01-01T00:00:00.000000000Z",
        "response": "x",
        "done": False,
    }
    models = [
        {
            "id": "smol",
            "name": "SmolLM2",
            "fingerprint": "ab" * 32,
            "status": "ready",
            "architecture": "llama",
        },
        {"id": "big", "name": "Big", "fingerprint": "cd" * 32, "status": "assembling"},
    ]
    assert [m["name"] for m in ollama_api.tags(models, 0.0)["models"]] == ["smol:latest", "big:latest"]
    assert [m["name"] for m in ollama_api.running(models, 0.0)["models"]] == ["smol:latest"]
    assert ollama_api.find(models, "smol:latest") is models[0] and ollama_api.find(models, "x") is None
    shown = ollama_api.show({**models[0], "tool_format": "generic"}, "{{ messages }}", 0.0)
    assert shown["details"]["family"] == "llama" and shown["capabilities"] == ["completion", "tools"]
    assert shown["template"] == "{{ messages }}" and shown["model_info"]["general.name"] == "SmolLM2"
    assert ollama_api.error_body("boom") == {"error": "boom"}


# --------------------------------------------------------------------------- never crash

JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=4)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "role",
                    "content",
                    "name",
                    "call_id",
                    "arguments",
                    "output",
                    "text",
                    "function",
                    "format",
                    "schema",
                ]
            ),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)


def _body(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys), JSONISH, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _body(
        [
            "model",
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "text",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "store",
            "previous_response_id",
            "parallel_tool_calls",
            "metadata",
            "seed",
        ]
    )
)
def test_responses_parse_never_crashes(body: dict[str, Any]) -> None:
    """Whatever the body, a Responses request parses into a chat request or raises InvalidRequest."""
    try:
        rr = responses_api.parse_request({"model": "m", "input": "x", **body})
    except InvalidRequest:
        return
    assert rr.chat.kind == "chat" and rr.chat.messages and 0 <= rr.chat.temperature <= 2


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _body(["model", "messages", "prompt", "system", "options", "format", "stream", "raw", "tools", "think"])
)
def test_ollama_parse_never_crashes(body: dict[str, Any]) -> None:
    """Whatever the body, an Ollama request parses or raises InvalidRequest."""
    for parse in (ollama_api.parse_chat, ollama_api.parse_generate):
        try:
            req = parse({"model": "m", **body})
        except InvalidRequest:
            continue
        assert req.request is None or req.request.kind in ("chat", "completion")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(st.text(max_size=3), st.lists(st.integers(-1, 70000), max_size=3)), max_size=20),
    st.integers(1, 20),
)
def test_batch_parse_never_crashes(prompt: list[Any], n: int) -> None:
    try:
        batch = parse_completion_batch({"model": "m", "prompt": prompt, "n": n})
    except InvalidRequest:
        return
    assert 1 <= len(batch) <= 16 and len(batch) * n <= 64


@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_a_role_that_is_not_a_string_is_a_clear_400_in_every_client_api(role: Any) -> None:
    """Found by test_responses_parse_never_crashes: a list as the role was looked up in a frozenset
    (TypeError: unhashable, a 500) in the Responses, Ollama and chat-completions parsers alike."""
    from gateway.protocol import parse_chat_request

    parsers = [
        lambda: responses_api.parse_request({"model": "m", "input": [{"role": role, "content": "hi"}]}),
        lambda: ollama_api.parse_chat({"model": "m", "messages": [{"role": role, "content": "hi"}]}),
        lambda: parse_chat_request({"model": "m", "messages": [{"role": role, "content": "hi"}]}),
    ]
    for parse in parsers:
        with pytest.raises(InvalidRequest) as err:
            parse()
        assert err.value.param.endswith(".role")


def test_a_content_part_whose_type_is_not_a_string_is_refused_not_a_crash() -> None:
    with pytest.raises(InvalidRequest):
        responses_api.parse_request(
            {"model": "m", "input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}
        )
