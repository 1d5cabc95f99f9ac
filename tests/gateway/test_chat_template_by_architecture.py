"""A GGUF without a chat template gets its architecture's turn format (Gemma), else ChatML."""

from __future__ import annotations

from gateway.chat_template import FALLBACK_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, template_source


def test_the_models_own_template_wins() -> None:
    assert template_source("{{ 'own' }}", "gemma3") == "{{ 'own' }}"


def test_gemma_files_without_a_template_get_gemma_turns() -> None:
    for arch in ("gemma", "gemma2", "gemma3"):
        assert template_source(None, arch) is GEMMA_TEMPLATE
    assert template_source(None, "llama") is FALLBACK_TEMPLATE
    assert template_source("", None) is FALLBACK_TEMPLATE


def test_gemma_turns_render_like_the_gemma_format() -> None:
    t = ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>")
    text = t.render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Capital of France?"},
        ]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert not t.render([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith("model\n")
