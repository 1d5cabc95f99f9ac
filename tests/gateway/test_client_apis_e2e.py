"""The client APIs beyond chat completions against a real two-stage SmolLM2 swarm (swarm-tracker, two
swarm-node processes [0,15) and [15,30), swarm-gateway, loopback), through the official clients:

- ``openai``'s ``responses.create`` (streamed and not, instructions, a tool round trip by items and by
  ``previous_response_id``, json_schema output): the text equals the chat-completions path's for the
  same greedy request;
- the ``ollama`` library from PyPI (``chat``, ``generate``, ``list``, ``show``, ``ps``, errors): the
  same texts again, NDJSON streaming, counts and durations;
- several prompts in one completions request (strings and token arrays, n > 1, streamed and not): each
  choice equals the single-prompt request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import openai
import pytest
from openai_swarm import Swarm

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "seed": 5}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}


@pytest.fixture(scope="module")
def swarm(smol_swarm: Swarm) -> Swarm:
    return smol_swarm


@pytest.fixture(scope="module")
def client(swarm: Swarm) -> openai.OpenAI:
    return swarm.client()


def chat_text(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], max_tokens: int, **kw: Any
) -> Any:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **kw)
    return r.choices[0]


# --------------------------------------------------------------------------- several prompts


def test_several_prompts_each_equal_to_its_own_request(client: openai.OpenAI, swarm: Swarm) -> None:
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    singles = [
        client.completions.create(model=swarm.model, prompt=p, max_tokens=8, **GREEDY) for p in prompts
    ]
    batch = client.completions.create(model=swarm.model, prompt=prompts, max_tokens=8, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    # n > 1: choice j of prompt i is index i * n + j; each equals the single request with seed + j
    two = client.completions.create(
        model=swarm.model, prompt=prompts[:2], n=2, max_tokens=6, temperature=0.9, seed=11
    )
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in two.choices}
    for i, p in enumerate(prompts[:2]):
        one = client.completions.create(
            model=swarm.model, prompt=p, n=2, max_tokens=6, temperature=0.9, seed=11
        )
        assert [by_index[i * 2 + j] for j in range(2)] == [
            c.text for c in sorted(one.choices, key=lambda c: c.index)
        ]

    # token arrays, streamed, with usage at the end
    tokens = [[504, 3575, 282], [19842, 2060, 253, 655]]
    singles = [client.completions.create(model=swarm.model, prompt=t, max_tokens=6, **GREEDY) for t in tokens]
    texts = ["", ""]
    usage = None
    ids = set()
    for chunk in client.completions.create(
        model=swarm.model,
        prompt=tokens,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    ):
        ids.add(chunk.id)
        for c in chunk.choices:
            texts[c.index] += c.text
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(ids) == 1
    assert texts == [s.choices[0].text for s in singles]
    assert usage is not None and usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_several_prompts_refusals(swarm: Swarm) -> None:
    r = httpx.post(
        swarm.base + "/v1/completions", json={"model": swarm.model, "prompt": ["a"] * 17}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(
        swarm.base + "/v1/completions",
        json={"model": swarm.model, "prompt": ["a", "b", "c", "d", "e"], "n": 16},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# --------------------------------------------------------------------------- Responses


def test_responses_text_equals_chat_completions_streamed_and_not(client: openai.OpenAI, swarm: Swarm) -> None:
    instructions, question = "Answer in one short sentence.", "What is the capital of France?"
    expected = chat_text(
        client,
        swarm.model,
        [{"role": "system", "content": instructions}, {"role": "user", "content": question}],
        24,
    )
    r = client.responses.create(
        model=swarm.model,
        instructions=instructions,
        input=question,
        max_output_tokens=24,
        **_responses_greedy(),
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == expected.message.content
    assert r.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == instructions and r.max_output_tokens == 24

    kinds: list[str] = []
    deltas: list[str] = []
    final = None
    for event in client.responses.create(
        model=swarm.model,
        instructions=instructions,
        input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
        max_output_tokens=24,
        stream=True,
        **_responses_greedy(),
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == expected.message.content
    assert final is not None and final.output_text == expected.message.content

    # a stored response can be read back and continued
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text
    follow = client.responses.create(
        model=swarm.model,
        previous_response_id=r.id,
        input="And of Italy?",
        max_output_tokens=16,
        **_responses_greedy(),
    )
    expected2 = chat_text(
        client,
        swarm.model,
        [
            {"role": "user", "content": question},
            {"role": "assistant", "content": r.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
        16,
    )
    assert follow.output_text == expected2.message.content  # the new instructions (none) replace the old


def _responses_greedy() -> dict[str, Any]:
    return {"temperature": 0, "extra_body": {"seed": 5}}


def test_responses_tool_round_trip_by_items_and_by_previous_id(client: openai.OpenAI, swarm: Swarm) -> None:
    question = "What is the weather in Paris?"
    first = client.responses.create(
        model=swarm.model,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=48,
        **_responses_greedy(),
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    assert isinstance(arguments.get("city"), str)
    chat_first = chat_text(
        client,
        swarm.model,
        [{"role": "user", "content": question}],
        48,
        tools=[CHAT_WEATHER],
        tool_choice="required",
    )
    assert chat_first.message.tool_calls[0].function.arguments == calls[0].arguments

    result = {
        "type": "function_call_output",
        "call_id": calls[0].call_id,
        "output": '{"sky": "sunny", "c": 21}',
    }
    by_items = client.responses.create(
        model=swarm.model,
        input=[
            {"role": "user", "content": question},
            *[o.model_dump(exclude_none=True) for o in first.output],
            result,
        ],
        tools=[WEATHER],
        max_output_tokens=32,
        **_responses_greedy(),
    )
    by_previous = client.responses.create(
        model=swarm.model,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=32,
        **_responses_greedy(),
    )
    chat_second = chat_text(
        client,
        swarm.model,
        [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": calls[0].call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": calls[0].arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": result["output"]},
        ],
        32,
        tools=[CHAT_WEATHER],
    )
    assert by_items.output_text == by_previous.output_text == (chat_second.message.content or "")

    # streamed: the function call arrives as its own item with its argument events
    kinds = []
    done_args = None
    for event in client.responses.create(
        model=swarm.model,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=48,
        stream=True,
        **_responses_greedy(),
    ):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.done":
            done_args = event.arguments
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert done_args == calls[0].arguments


def test_responses_structured_output_and_errors(client: openai.OpenAI, swarm: Swarm) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=swarm.model,
        input="A person as JSON with name and age.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
        **_responses_greedy(),
    )
    person = json.loads(r.output_text)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="hi")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as previous:
        client.responses.create(model=swarm.model, input="hi", previous_response_id="resp_nope")
    assert previous.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as item:
        client.responses.create(model=swarm.model, input=[{"type": "input_image", "image_url": "x"}])
    assert item.value.body["param"] == "input[0].type"
    with pytest.raises(openai.BadRequestError) as rng:
        client.responses.create(model=swarm.model, input="hi", temperature=3)
    assert rng.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    # another key cannot read a stored response
    stored = client.responses.create(model=swarm.model, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        swarm.client(api_key="another-key").responses.retrieve(stored.id)


# --------------------------------------------------------------------------- Ollama


@pytest.fixture(scope="module")
def olla(swarm: Swarm) -> ollama.Client:
    return ollama.Client(host=swarm.base, timeout=120)


def test_ollama_chat_and_generate_equal_the_openai_paths(
    olla: ollama.Client, client: openai.OpenAI, swarm: Swarm
) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = chat_text(client, swarm.model, messages, 20)
    options = {"temperature": 0, "num_predict": 20, "seed": 5}
    r = olla.chat(model=swarm.model + ":latest", messages=messages, options=options)
    assert r.message.role == "assistant" and r.message.content == expected.message.content
    assert r.done and r.done_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert r.eval_count == 20 or r.done_reason == "stop"
    assert r.prompt_eval_count and r.prompt_eval_count > 0
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0
    assert r.created_at and r.created_at.endswith("Z")

    pieces = list(olla.chat(model=swarm.model, messages=messages, options=options, stream=True))
    assert all(not p.done for p in pieces[:-1]) and pieces[-1].done
    assert "".join(p.message.content or "" for p in pieces) == expected.message.content
    assert pieces[-1].eval_count == r.eval_count

    g = olla.generate(model=swarm.model, prompt="Name three colours.", options=options)
    assert g.response == expected.message.content  # the prompt goes through the chat template
    streamed = "".join(
        p.response
        for p in olla.generate(model=swarm.model, prompt="Name three colours.", options=options, stream=True)
    )
    assert streamed == g.response

    raw = olla.generate(
        model=swarm.model, prompt="The capital of France is", raw=True, options={**options, "num_predict": 8}
    )
    completion = client.completions.create(
        model=swarm.model, prompt="The capital of France is", max_tokens=8, **GREEDY
    )
    assert raw.response == completion.choices[0].text

    as_json = olla.chat(
        model=swarm.model,
        messages=[{"role": "user", "content": "A cat as JSON."}],
        format="json",
        options={**options, "num_predict": 48},
    )
    assert isinstance(json.loads(as_json.message.content), dict)


def test_ollama_models_show_version_and_errors(olla: ollama.Client, swarm: Swarm) -> None:
    names = [m.model for m in olla.list().models]
    assert swarm.model + ":latest" in names
    shown = olla.show(swarm.model)
    assert shown.details.format == "gguf" and "completion" in (shown.capabilities or [])
    assert shown.modelinfo["general.name"] == swarm.name
    assert any(m.model == swarm.model + ":latest" for m in olla.ps().models)
    assert httpx.get(swarm.base + "/api/version", timeout=10).json()["version"]

    with pytest.raises(ollama.ResponseError) as missing:
        olla.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        olla.chat(model=swarm.model, messages=[{"role": "user", "content": "hi"}], options={"temperature": 9})
    assert bad.value.status_code == 400 and "temperature" in bad.value.error
    r = httpx.post(
        swarm.base + "/api/generate",
        json={"model": swarm.model, "prompt": "x", "images": ["aGk="]},
        timeout=30,
    )
    assert r.status_code == 400 and set(r.json()) == {"error"}
    loaded = olla.generate(model=swarm.model, prompt="")  # Ollama's "load the model" call
    assert loaded.done and loaded.done_reason == "load"
