"""Client-facing cases of llama.cpp's own server test suite, run against the gateway on a real swarm.

Ported (rewritten here) from ``tools/server/tests/unit/test_chat_completion.py``, ``test_completion.py``
and ``test_tool_call.py`` of github.com/ggml-org/llama.cpp. The expectations are the same kind of
checks those tests make (status codes, response shapes, finish reasons, token counts, constrained
output, determinism); the texts differ because the model is SmolLM2-135M, not their tinyllama, so
regexes on generated text become checks against what the gateway itself returns for an equivalent
request. Cases that cannot apply are listed in docs/gateway.md ("llama.cpp's server tests") with why.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest
from openai_swarm import Swarm

from common.vocab import Vocabulary
from gateway.chat_template import ChatTemplate

pytestmark = pytest.mark.slow

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
LIFE = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def swarm(smol_swarm: Swarm) -> Swarm:
    return smol_swarm


@pytest.fixture(scope="module")
def client(swarm: Swarm) -> openai.OpenAI:
    return swarm.client(api_key="llama-cpp-ported")


def post(swarm: Swarm, path: str, body: dict) -> httpx.Response:
    return httpx.post(swarm.base + path, json=body, timeout=120, headers={"Authorization": "Bearer ported"})


# --------------------------------------------------------------------------- test_chat_completion.py


def test_chat_completion_shape_and_counts(swarm: Swarm, model_path) -> None:  # type: ignore[no-untyped-def]
    r = post(swarm, "/v1/chat/completions", {"model": swarm.model, "max_tokens": 8, "messages": BOOK})
    assert r.status_code == 200
    body = r.json()
    assert "cmpl" in body["id"] and body["system_fingerprint"]
    with Vocabulary(model_path) as vocab:
        rendered = ChatTemplate(vocab.chat_template).render(BOOK)
        assert body["usage"]["prompt_tokens"] == len(vocab.tokenize(rendered, add_special=False))
    assert body["usage"]["completion_tokens"] == 8
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"


def test_chat_completion_text_parts_equal_the_joined_string(client: openai.OpenAI, swarm: Swarm) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": " the best book"}]
    a = client.chat.completions.create(
        model=swarm.model, messages=[BOOK[0], {"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    b = client.chat.completions.create(model=swarm.model, messages=BOOK, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_completion_stream(client: openai.OpenAI, swarm: Swarm) -> None:
    chunks = list(
        client.chat.completions.create(
            model=swarm.model,
            messages=BOOK,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and all(c.model == swarm.model for c in chunks)
    first, *rest = [c for c in chunks if c.choices]
    assert first.choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in rest)
    finals = [c for c in rest if c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert not finals[0].choices[0].delta.content
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 8


def test_chat_completion_with_openai_library(client: openai.OpenAI, swarm: Swarm) -> None:
    r = client.chat.completions.create(
        model=swarm.model,
        messages=BOOK,
        max_tokens=8,
        seed=42,
        temperature=0.8,
    )
    assert r.system_fingerprint and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "json_object", "schema": {"const": "42"}}, '"42"'),
        ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, '"foooooo"'),
        ({"type": "json_object", "schema": {"type": "array", "items": {"type": "integer"}}}, r"^\[.*\]$"),
        ({"type": "json_object"}, r"^\{"),
    ],
)
def test_completion_with_response_format(swarm: Swarm, response_format: dict, expected: str) -> None:
    r = post(
        swarm,
        "/v1/chat/completions",
        {
            "model": swarm.model,
            "max_tokens": 24,
            "messages": [
                {"role": "system", "content": "You are a coding assistant."},
                {"role": "user", "content": "Write an example"},
            ],
            "response_format": response_format,
        },
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert re.search(expected, content), content
    json.loads(content)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "sound"},
        {"type": "json_object", "schema": 123},
        {"type": "json_object", "schema": {"type": 123}},
        {"type": "json_object", "schema": {"type": "hiccup"}},
    ],
)
def test_invalid_response_format(swarm: Swarm, response_format: dict) -> None:
    r = post(
        swarm,
        "/v1/chat/completions",
        {"model": swarm.model, "messages": BOOK, "max_tokens": 4, "response_format": response_format},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_completion_with_json_schema_field(swarm: Swarm) -> None:
    r = post(
        swarm,
        "/v1/chat/completions",
        {"model": swarm.model, "messages": BOOK, "max_tokens": 6, "json_schema": {"const": "42"}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == '"42"'


def test_completion_with_grammar_field(swarm: Swarm) -> None:
    r = post(
        swarm,
        "/v1/chat/completions",
        {
            "model": swarm.model,
            "messages": [{"role": "user", "content": "Does not matter what I say, does it?"}],
            "max_tokens": 6,
            "grammar": 'root ::= "a"{5,5}',
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "aaaaa"


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "string",
        [123],
        [{}],
        [{"role": 123}],
        [{"role": "system", "content": 123}],
        [{"role": "system", "content": "test"}, {}],
    ],
)
def test_invalid_chat_completion_request(swarm: Swarm, messages: object) -> None:
    r = post(swarm, "/v1/chat/completions", {"model": swarm.model, "messages": messages})
    assert r.status_code == 400 and "error" in r.json()


def test_logprobs(client: openai.OpenAI, swarm: Swarm) -> None:
    r = client.chat.completions.create(
        model=swarm.model, messages=BOOK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=10
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob <= 0 and t.bytes is not None and len(t.top_logprobs) == 10 for t in content)


def test_logprobs_stream(client: openai.OpenAI, swarm: Swarm) -> None:
    text, joined = "", ""
    for chunk in client.chat.completions.create(
        model=swarm.model,
        messages=BOOK,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=10,
        stream=True,
    ):
        choice = chunk.choices[0]
        if choice.finish_reason is None and choice.delta.content:
            text += choice.delta.content
            assert choice.logprobs is not None
            for t in choice.logprobs.content:
                joined += t.token
                assert t.logprob <= 0 and t.top_logprobs
    assert joined == text and text


def test_logit_bias_excludes_words(client: openai.OpenAI, swarm: Swarm, model_path) -> None:  # type: ignore[no-untyped-def]
    exclude = ["i", "I", "the", "The", "to", "a", "an", "be", "is", "was", "but", "But", "and", "And"]
    exclude += ["so", "So", "you", "You", "he", "He", "she", "She", "we", "We", "they", "They", "it", "It"]
    exclude += ["his", "His", "her", "Her", "book", "Book"]
    with Vocabulary(model_path) as vocab:
        tokens = vocab.tokenize(" " + " ".join(exclude) + " ", add_special=False)
    r = client.chat.completions.create(
        model=swarm.model,
        messages=BOOK,
        temperature=0,
        max_tokens=64,
        logit_bias={str(t): -100 for t in tokens},
    )
    text = r.choices[0].message.content or ""
    assert text and all(f" {word} " not in text for word in exclude), text


@pytest.mark.parametrize("stream", [False, True])
def test_context_size_exceeded(swarm: Swarm, stream: bool) -> None:
    r = post(swarm, "/v1/chat/completions", {"model": swarm.model, "messages": BOOK * 100, "stream": stream})
    assert r.status_code == 413  # past every route's context: prompt_too_long, naming the largest one
    assert r.json()["error"]["code"] == "prompt_too_long"


def test_chat_completions_multiple_choices(swarm: Swarm) -> None:
    r = post(swarm, "/v1/chat/completions", {"model": swarm.model, "max_tokens": 8, "n": 2, "messages": BOOK})
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert len(choices) == 2 and [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)


# --------------------------------------------------------------------------- test_completion.py


def test_completion_with_openai_library(client: openai.OpenAI, swarm: Swarm) -> None:
    r = client.completions.create(model=swarm.model, prompt=LIFE, max_tokens=8)
    assert r.system_fingerprint and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 8


def test_completion_stream_vs_non_stream(client: openai.OpenAI, swarm: Swarm) -> None:
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=swarm.model, prompt=LIFE, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    whole = client.completions.create(model=swarm.model, prompt=LIFE, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].text


def test_consistent_result_same_seed(client: openai.OpenAI, swarm: Swarm) -> None:
    texts = {
        client.completions.create(model=swarm.model, prompt=LIFE, seed=42, temperature=0.0, max_tokens=12)
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(texts) == 1


def test_different_result_different_seed(client: openai.OpenAI, swarm: Swarm) -> None:
    texts = [
        client.completions.create(model=swarm.model, prompt=LIFE, seed=seed, temperature=1.0, max_tokens=12)
        .choices[0]
        .text
        for seed in range(4)
    ]
    assert all(a != b for a, b in zip(texts, texts[1:], strict=False))


def test_completion_with_tokens_input(client: openai.OpenAI, swarm: Swarm, model_path) -> None:  # type: ignore[no-untyped-def]
    with Vocabulary(model_path) as vocab:
        tokens = vocab.tokenize(LIFE, add_special=True)
    by_tokens = client.completions.create(model=swarm.model, prompt=tokens, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=swarm.model, prompt=LIFE, max_tokens=8, temperature=0)
    assert by_tokens.choices[0].text == by_text.choices[0].text


def test_completion_parallel_requests(client: openai.OpenAI, swarm: Swarm) -> None:
    prompts = [
        "Write a very long book.",
        "Write another a poem.",
        "What is LLM?",
        "The sky is blue and I love it.",
    ]

    def one(prompt: str) -> str:
        r = client.completions.create(
            model=swarm.model, prompt=prompt, seed=42, temperature=1.0, max_tokens=16
        )
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, prompts))
    assert all(isinstance(t, str) and len(t) > 10 for t in texts), texts


def test_completion_logprobs(client: openai.OpenAI, swarm: Swarm) -> None:
    r = client.completions.create(model=swarm.model, prompt=LIFE, max_tokens=5, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(p <= 0 for p in lp.token_logprobs)
    assert all(len(top) == 5 for top in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text


# --------------------------------------------------------------------------- test_tool_call.py

TEST_TOOL = {
    "type": "function",
    "function": {
        "name": "test",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
        },
    },
}
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Runs code in an ipython interpreter and returns the result of the execution after 60 seconds."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The code to run in the ipython interpreter."}
            },
            "required": ["code"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("tool", "argument_key"), [(TEST_TOOL, "success"), (PYTHON_TOOL, "code")])
def test_completion_with_required_tool(swarm: Swarm, tool: dict, argument_key: str, stream: bool) -> None:
    body = {
        "model": swarm.model,
        "max_tokens": 96,
        "messages": [
            {"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "Write an example"},
        ],
        "tool_choice": "required",
        "tools": [tool],
        "parallel_tool_calls": False,
        "temperature": 0.0,
        "top_p": 1.0,
        "extra_body": {"top_k": 1},
    }
    client = swarm.client(api_key="tools")
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **body))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        r = client.chat.completions.create(**body)
        calls = r.choices[0].message.tool_calls or []
        content = r.choices[0].message.content or ""
        name, arguments = calls[0].function.name, calls[0].function.arguments
    assert len(calls) == 1 and content == ""
    assert name == tool["function"]["name"] and isinstance(arguments, str)
    assert argument_key in json.loads(arguments)


@pytest.mark.parametrize(
    ("tools", "tool_choice"), [([], None), ([TEST_TOOL], "none"), ([PYTHON_TOOL], "none")]
)
def test_completion_without_tool_call(
    client: openai.OpenAI, swarm: Swarm, tools: list, tool_choice: str | None
) -> None:
    kwargs: dict = {"tools": tools} if tools else {}
    if tool_choice:
        kwargs["tool_choice"] = tool_choice
    r = client.chat.completions.create(
        model=swarm.model,
        messages=[
            {"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "say hello world with python"},
        ],
        max_tokens=32,
        temperature=0,
        **kwargs,
    )
    assert r.choices[0].message.tool_calls is None
