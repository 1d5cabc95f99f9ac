"""Render a model's chat template (GGUF ``tokenizer.chat_template``, Jinja2) in a sandbox.

The template comes from the model file, i.e. from whoever published the model:
it is rendered with jinja2's ``ImmutableSandboxedEnvironment`` (no attribute
access to Python internals, no mutation of the inputs), with the helpers
Hugging Face templates expect (``raise_exception``, ``strftime_now``) and the
same whitespace settings as ``transformers`` (``trim_blocks``,
``lstrip_blocks``). The output is produced piece by piece and refused as soon
as it passes ``max_chars``, so a template that only *outputs* too much never
holds more than that. Pure: jinja2 and the standard library.

The sandbox limits what a template can reach, not how long it runs or how
much it allocates in one expression: the gateway renders in worker processes
(``gateway/template_sandbox.py``) with a time limit and a memory limit.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
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


MAX_POWER_EXPONENT = 4096


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, plus run-time checks of ``*`` and ``**`` (which also stops jinja2 from folding
    them at compile time: ``{{ 'x' * 10**10 }}`` would otherwise be built while compiling)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (
                    isinstance(seq, str | list | tuple)
                    and isinstance(n, int)
                    and len(seq) * n > MAX_RENDERED_CHARS
                ):
                    raise TemplateError(
                        f"chat template refused: a repetition of {len(seq) * n} items", param="messages"
                    )
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT:
            raise TemplateError(f"chat template refused: an exponent of {right}", param="messages")
        return super().call_binop(context, operator, left, right)


@dataclass(frozen=True)
class TemplateSource:
    """A template as text, not compiled: what the gateway holds (compiling an untrusted template can
    itself exhaust memory, so it is compiled only in the sandbox's worker processes)."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def compile(self) -> ChatTemplate:
        return ChatTemplate(self.source, bos_token=self.bos_token, eos_token=self.eos_token)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source or FALLBACK_TEMPLATE
        self._template = env.from_string(self.source)
        self._bos, self._eos = bos_token, eos_token

    @property
    def bos_token(self) -> str:
        return self._bos

    @property
    def eos_token(self) -> str:
        return self._eos

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        max_chars: int = MAX_RENDERED_CHARS,
        **extra: Any,
    ) -> str:
        """``extra``: more template variables (``tools`` for templates that render tools themselves)."""
        pieces: list[str] = []
        total = 0
        try:
            for piece in self._template.generate(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                **extra,
            ):
                total += len(piece)
                if total > max_chars:
                    raise InvalidRequest(
                        f"rendered prompt is too long (over {max_chars} characters)", param="messages"
                    )
                pieces.append(piece)
        except InvalidRequest:  # TemplateError too: raise_exception() or the size limit
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, OverflowError) as err:
            raise TemplateError(f"chat template failed: {err}", param="messages") from err
        return "".join(pieces)
