"""Conversations by ``conversation_id`` through the official openai client against a real swarm
(swarm-tracker, two SmolLM2 nodes [0,15) + [15,30) with 1,024 KV positions per session, swarm-gateway).

Each turn sends only its new message; its text must equal a plain chat request (another API key, no kept
KV) given the whole history the gateway kept -- and, once the conversation outgrows the context, the
compacted history the response reports. Turns stream and not, by body field and by header.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai_swarm import Swarm
from swarm_fixtures import metric_lines

from gateway.conversations import prompt_of
from gateway.protocol import ChatMessage

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def swarm(smol_swarm: Swarm) -> Swarm:
    return smol_swarm


def plain(swarm: Swarm, messages: list[dict[str, Any]], max_tokens: int) -> str:
    """The same prompt as an ordinary request: another client, nothing kept, nothing reused."""
    r = swarm.client(api_key="conversation-reference").chat.completions.create(
        model=swarm.model,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"cache_prompt": False},
    )
    return r.choices[0].message.content or ""


def counter(base: str, name: str) -> float:
    return sum(float(x.split()[-1]) for x in metric_lines(base, name) if not x.startswith("#"))


def test_turns_send_only_new_messages_and_equal_the_whole_history(swarm: Swarm) -> None:
    client = swarm.client(api_key="conversation-owner")
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    first = True
    for i, question in enumerate(("What is rain?", "And snow?", "And hail?")):
        new = [{"role": "system", "content": SYSTEM}] if first else []
        new.append({"role": "user", "content": question})
        first = False
        history.append({"role": "user", "content": question})
        stream = i == 1
        if stream:  # by header, streamed
            chunks = list(
                client.chat.completions.create(
                    model=swarm.model,
                    messages=new,  # type: ignore[arg-type]
                    temperature=0,
                    max_tokens=12,
                    stream=True,
                    extra_headers={"X-Conversation-Id": "weather-1"},
                )
            )
            info = (chunks[0].model_extra or {})["conversation"]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.chat.completions.create(
                model=swarm.model,
                messages=new,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=12,
                extra_body={"conversation_id": "weather-1"},
            )
            info = (r.model_extra or {})["conversation"]
            text = r.choices[0].message.content or ""
        assert info["turn"] == i + 1 and info["mode"] == ("start" if i == 0 else "new")
        assert not info["compacted"] and info["messages"] == len(history) + 1
        assert text == plain(swarm, history, 12), (i, text)
        history.append({"role": "assistant", "content": text})
    # The same conversation under another key does not exist: it starts anew from what was sent.
    other = swarm.client(api_key="someone-else").chat.completions.create(
        model=swarm.model,
        messages=[{"role": "user", "content": "And hail?"}],
        temperature=0,
        max_tokens=4,
        extra_body={"conversation_id": "weather-1"},
    )
    assert (other.model_extra or {})["conversation"]["turn"] == 1


def long_conversation(swarm: Swarm, base: str, api_key: str, policy: str) -> int:
    """Three long turns on a 1,024-position context, each checked against a plain request given what the
    model saw; the first turn that was compacted."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=120)
    filler = " ".join(f"fact {i}: the sky was {['blue', 'grey', 'red'][i % 3]}." for i in range(45))
    history = [ChatMessage("system", SYSTEM)]
    compactions_before = counter(base, "swarm_gateway_conversation_compactions_total")
    compacted_turn = None
    for turn in range(3):
        question = f"Turn {turn}. {filler} What colour came last?"
        history.append(ChatMessage("user", question))
        new = [m.to_template() for m in history[-2 if turn == 0 else -1 :]]  # the system message first
        r = client.chat.completions.create(
            model=swarm.model,
            messages=new,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=8,
            extra_body={"conversation_id": "long-1"},
        )
        info = (r.model_extra or {})["conversation"]
        text = r.choices[0].message.content or ""
        # What the model saw: the kept history less what the gateway reports it left out.
        seen = prompt_of(history, info["left_out_messages"], info.get("summary", ""))
        assert text == plain(swarm, [m.to_template() for m in seen], 8), (turn, info)
        if info["compacted"]:
            compacted_turn = compacted_turn if compacted_turn is not None else turn
            assert info["compaction"] == policy and info["left_out_messages"] >= 2
            assert bool(info.get("summary")) == (policy == "summary")
        history.append(ChatMessage("assistant", text))
    assert compacted_turn is not None and compacted_turn >= 1
    assert counter(base, "swarm_gateway_conversation_compactions_total") > compactions_before
    return compacted_turn


def test_a_conversation_past_the_context_is_compacted_and_goes_on(swarm: Swarm) -> None:
    long_conversation(swarm, swarm.base, "conversation-long", "drop_oldest")


def test_the_summary_policy_puts_the_models_summary_in_place_of_what_is_left_out(swarm: Swarm) -> None:
    from swarm_fixtures import url

    gateway = swarm.supervisor.start_gateway(
        tracker_url=url(swarm.tracker),
        name="gw-summary",
        extra_args=["--prefix-exact"],
        env={"SWARM_GATEWAY_CONVERSATION_COMPACTION": "summary"},
    ).ready(60)
    try:
        long_conversation(swarm, url(gateway), "conversation-summary", "summary")
        assert counter(url(gateway), "swarm_gateway_conversation_summaries_total") >= 1
    finally:
        gateway.stop(15)


def test_a_turn_that_cannot_fit_even_alone_is_a_409_and_bad_ids_a_400(swarm: Swarm) -> None:
    huge = "word " * 3000
    r = httpx.post(
        swarm.base + "/v1/chat/completions",
        json={
            "model": swarm.model,
            "messages": [{"role": "user", "content": huge}],
            "max_tokens": 4,
            "conversation_id": "too-big",
        },
        timeout=120,
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "conversation_full", r.text
    bad = httpx.post(
        swarm.base + "/v1/chat/completions",
        json={
            "model": swarm.model,
            "messages": [{"role": "user", "content": "hi"}],
            "conversation_id": "a b",
        },
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "conversation_id"
    assert counter(swarm.base, "swarm_gateway_conversations_live") >= 1
    with pytest.raises(openai.BadRequestError):
        swarm.client().chat.completions.create(
            model=swarm.model,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Conversation-Id": "x" * 200},
        )
