"""sim/reference.py renders prompts with the template the gateway uses (issue 26): a Gemma 3 file
without a chat template gets Gemma's turns and its BOS, not ChatML (with ChatML every Gemma answer of
the WAN rebalancing benchmark differed from the reference although the swarm's text was exact)."""

from __future__ import annotations

import pytest

from common.vocab import Vocabulary
from gateway.chat_template import GEMMA_TEMPLATE
from node import testmodel
from sim.reference import chat_template_of


def test_the_reference_renders_gemma_turns_for_a_gemma_file_without_a_template() -> None:
    try:
        path = testmodel.gemma3_model_path()
    except testmodel.TestModelMissing as err:
        pytest.skip(str(err))
    with Vocabulary(path) as vocab:
        assert not vocab.chat_template
        template = chat_template_of(vocab)
    assert template.source is GEMMA_TEMPLATE
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_a_file_with_its_own_template_keeps_it() -> None:
    with Vocabulary(testmodel.test_model_path()) as vocab:
        template = chat_template_of(vocab)
        assert template.source == vocab.chat_template
