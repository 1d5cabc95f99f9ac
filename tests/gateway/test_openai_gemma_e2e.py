"""Structured output on the second test model: Gemma 3 270M (a base model without a chat template; the
gateway uses Gemma's turn format), two stages [0,9) and [9,18), the official openai client's ``parse``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai_swarm import Swarm, two_stage_swarm
from pydantic import BaseModel

from node import testmodel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory, node_cache: Path) -> Iterator[Swarm]:
    try:
        path = testmodel.gemma3_model_path()
    except testmodel.TestModelMissing as err:
        pytest.skip(str(err))
    with two_stage_swarm(tmp_path_factory.mktemp("gemma"), path, node_cache, 9, 18) as s:
        yield s


class Pet(BaseModel):
    name: str
    species: str
    age_years: int
    vaccinated: bool


def test_parse_returns_a_valid_object_on_gemma(gemma: Swarm) -> None:
    client = gemma.client()
    for temperature in (0.0, 0.8):
        completion = client.chat.completions.parse(
            model=gemma.model,
            messages=[{"role": "user", "content": "Describe a pet as JSON."}],
            response_format=Pet,
            temperature=temperature,
            seed=3,
            max_tokens=64,
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Pet), completion.choices[0].message.content


def test_tool_call_is_constrained_on_gemma(gemma: Swarm) -> None:
    client = gemma.client()
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    }
    r = client.chat.completions.create(
        model=gemma.model,
        messages=[{"role": "user", "content": "Look up the word 'sea'."}],
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=48,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup" and "word" in call.function.arguments
