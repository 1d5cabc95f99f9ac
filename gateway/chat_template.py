"""Render a model's chat template (GGUF ``tokenizer.chat_template``, Jinja2) in a sandbox.

The template comes from the model file, i.e. from whoever published the model:
it is rendered with jinja2's ``ImmutableSandboxedEnvironment`` (no attribute
access to Python internals, no mutation of the inputs), with the helpers
Hugging Face templates expect (``raise_exception``, ``strftime_now``) and the
same whitespace settings as ``transformers`` (``trim_blocks``,
``lstrip_blocks``). Pure: jinja2 and the standard library.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import InvalidRequest

# Used when a GGUF carries no template: ChatML, which most small instruct models use.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turn format (Gemma 1-3 instruct models): BOS, then "<start_of_turn>user|model" turns
# closed by "<end_of_turn>"; a system message is prepended to the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Templates by GGUF ``general.architecture`` for files that carry none.
BUILTIN_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


def template_source(gguf_template: str | None, architecture: str | None) -> str:
    """The model's own template; else the architecture's built-in one; else ChatML."""
    if gguf_template:
        return gguf_template
    return BUILTIN_TEMPLATES.get(architecture or "", FALLBACK_TEMPLATE)


MAX_RENDERED_CHARS = 4 * 1024 * 1024


class TemplateError(InvalidRequest):
    """The messages cannot be rendered with the model's template (the template raised)."""


def _raise(message: str) -> NoReturn:
    raise TemplateError(f"chat template refused the messages: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now(datetime.UTC).strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source or FALLBACK_TEMPLATE
        self._template = env.from_string(self.source)
        self._bos, self._eos = bos_token, eos_token

    def render(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """``extra``: more template variables (``tools`` for templates that render tools themselves)."""
        try:
            text = self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                **extra,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            raise TemplateError(f"chat template failed: {err}", param="messages") from err
        if len(text) > MAX_RENDERED_CHARS:
            raise InvalidRequest("rendered prompt is too long", param="messages")
        return text
