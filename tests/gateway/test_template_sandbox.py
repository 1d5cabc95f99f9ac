"""Chat templates in worker processes: the same text as in process; loops, size and memory bombs
refused within the limits while the event loop keeps running; a killed worker is replaced.

The bombs are only ever compiled in the worker processes (compiling one can itself exhaust memory)."""

from __future__ import annotations

import time

import pytest
import trio

from gateway.chat_template import FALLBACK_TEMPLATE, ChatTemplate, TemplateError, TemplateSource
from gateway.template_sandbox import TemplateSandbox

pytestmark = pytest.mark.slow  # renders in worker processes

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo ✓"}]
LOOP = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
OUTPUT_BOMB = "{% for i in range(99999) %}{{ 'y' * 1000 }}{% endfor %}"
# Built while compiling (jinja2 folds constant filter calls): never compile it in this process.
MEMORY_BOMB = "{{ 'z' | center(4294967296) | length }}"
REPEAT_BOMB = "{% set s = 'z' * (1024 * 1024 * 1024 * 4) %}{{ s | length }}"
RAISES = "{{ raise_exception('no system messages, please') }}"


async def test_same_text_as_in_process_and_limits_enforced_off_the_event_loop() -> None:
    sandbox = TemplateSandbox(workers=2, timeout_s=1.0, memory_bytes=512 << 20, max_chars=200_000)
    try:
        template = ChatTemplate(FALLBACK_TEMPLATE, bos_token="<s>")
        assert await sandbox.render(template, MESSAGES) == template.render(MESSAGES)

        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.01)
                ticks += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            t0 = time.monotonic()
            with pytest.raises(TemplateError, match="did not finish within 1 s"):
                await sandbox.render(TemplateSource(LOOP), MESSAGES)
            took = time.monotonic() - t0
            nursery.cancel_scope.cancel()
        assert 1.0 <= took < 5.0
        assert ticks >= 40  # the loop went on ticking while the template looped

        with pytest.raises(TemplateError, match="too long"):
            await sandbox.render(TemplateSource(OUTPUT_BOMB), MESSAGES)
        with pytest.raises(TemplateError, match="needs more than 512 MiB"):
            await sandbox.render(TemplateSource(MEMORY_BOMB), MESSAGES)
        with pytest.raises(TemplateError, match="a repetition of 4294967296 items"):
            await sandbox.render(TemplateSource(REPEAT_BOMB), MESSAGES)
        with pytest.raises(TemplateError, match="no system messages, please"):
            await sandbox.render(TemplateSource(RAISES), MESSAGES)
        assert sandbox.refused == {"timeout": 1, "memory": 1, "too_long": 1, "refused": 2, "died": 0}
        # the killed workers were replaced: the next render works
        assert await sandbox.render(template, MESSAGES) == template.render(MESSAGES)
    finally:
        sandbox.close()
    assert not sandbox._all


async def test_renders_run_in_parallel_up_to_the_worker_count() -> None:
    sandbox = TemplateSandbox(workers=2, timeout_s=1.0)
    try:
        await sandbox.warm()
        template = TemplateSource(LOOP)
        t0 = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(_refused, sandbox, template)
        assert time.monotonic() - t0 < 1.9  # both timed out together, not one after the other
    finally:
        sandbox.close()


async def _refused(sandbox: TemplateSandbox, template: TemplateSource) -> None:
    with pytest.raises(TemplateError):
        await sandbox.render(template, MESSAGES)
