"""The gateway's chat page (``GET /``) in a real headless Chromium, driven as a person would: pick the
model, set max tokens and temperature, type a question, press Enter, read the streamed answer with its
time to first token and tokens per second, click Stop on a long answer, start a new conversation.

On both bundled models: the two-stage SmolLM2 swarm of the client-API tests and a small two-stage
Gemma 3 swarm (skipped when its model packages are missing). The page's answer must equal the chat
completion of the same greedy request through the official client. Screenshots go to
``$SWARM_TEST_ARTIFACTS`` (default: the test's tmp dir).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from openai_swarm import Swarm, two_stage_swarm
from swarm_fixtures import metric_lines, url

from node import testmodel
from tests.e2e.browser import (
    Page,
    chromium_path,
    click,
    headless_chromium,
    press_enter,
    select_all,
    type_text,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_path() is None, reason="needs chromium (apt-get install chromium)"),
]


LAST_ANSWER = "[...document.querySelectorAll('.msg.assistant')].pop()"


def artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("SWARM_TEST_ARTIFACTS", "") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory, node_cache: Path) -> Iterator[Swarm]:
    try:
        path = testmodel.gemma3_model_path()
    except testmodel.TestModelMissing as err:
        pytest.skip(str(err))
    with two_stage_swarm(tmp_path_factory.mktemp("gemma-chat"), path, node_cache, 9, 18) as s:
        yield s


async def set_field(page: Page, selector: str, value: str) -> None:
    await click(page, selector)
    await select_all(page)
    await type_text(page, value)


async def ask(page: Page, question: str, answers_before: int, timeout_s: float) -> dict:
    await click(page, "#prompt")
    await type_text(page, question)
    await press_enter(page)
    await page.wait_for(
        f"Number(document.body.dataset.answers || 0) > {answers_before}", timeout_s, "the answer to end"
    )
    return await page.eval(
        "(() => { const m = [...document.querySelectorAll('.msg.assistant')].pop();"
        " return {text: m.querySelector('.body').textContent, stats: m.querySelector('.stats').textContent,"
        " state: m.dataset.state}; })()"
    )


def disconnects(base: str) -> float:
    lines = metric_lines(base, "swarm_gateway_client_disconnects_total")
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def drive(swarm: Swarm, tmp_path: Path, label: str, question: str) -> None:
    out = artifacts(tmp_path)
    client = swarm.client()
    expected = await trio.to_thread.run_sync(
        lambda: (
            client.chat.completions.create(
                model=swarm.model,
                messages=[{"role": "user", "content": question}],
                max_tokens=24,
                temperature=0,
            )
            .choices[0]
            .message.content
        )
    )
    async with headless_chromium(tmp_path, width=1200, height=800) as page:
        await page.goto(swarm.base + "/")
        await page.wait_for("Number(document.body?.dataset.models) >= 1", 30, "the model list")
        options = await page.eval("[...document.querySelectorAll('#model option')].map(o => o.value)")
        assert swarm.model in options
        # pick the model (a native <select> popup is not part of the page: choose as its keyboard would)
        await page.eval(
            f"(() => {{ const s = document.querySelector('#model'); s.value = {swarm.model!r};"
            " s.dispatchEvent(new Event('change')); })()"
        )
        dashboard = await page.eval("document.querySelector('a.dashboard').href")
        assert dashboard == url(swarm.tracker) + "/"
        assert await page.eval("getComputedStyle(document.querySelector('#keyrow')).display") == "none"

        await set_field(page, "#max-tokens", "24")
        await set_field(page, "#temperature", "0")
        answer = await ask(page, question, 0, 120)
        assert answer["state"] == "done", answer
        assert answer["text"] == expected
        assert "TTFT" in answer["stats"] and "tokens/s" in answer["stats"], answer["stats"]
        (out / f"chat-{label}-answer.png").write_bytes(await page.screenshot())

        # a long answer, stopped once it streams: the page says so and the gateway ends the session
        before = await trio.to_thread.run_sync(disconnects, swarm.base)
        await set_field(page, "#max-tokens", "600")
        await click(page, "#prompt")
        await type_text(page, "Write a very long story about a dragon and a lighthouse keeper.")
        await click(page, "#send")
        await page.wait_for(
            f"{LAST_ANSWER}.querySelector('.body').textContent.length > 20",
            120,
            "the long answer to stream",
        )
        await click(page, "#stop")
        await page.wait_for("Number(document.body.dataset.answers) === 2", 10, "the stop")
        stopped = await page.eval(
            "(() => { const m = [...document.querySelectorAll('.msg.assistant')].pop();"
            " return {state: m.dataset.state, n: m.querySelector('.body').textContent.length,"
            " stats: m.querySelector('.stats').textContent}; })()"
        )
        assert stopped["state"] == "stopped" and "stopped" in stopped["stats"], stopped
        with trio.fail_after(30):
            while await trio.to_thread.run_sync(disconnects, swarm.base) <= before:  # noqa: ASYNC110
                await trio.sleep(0.2)  # another process's counter: polled
        await trio.sleep(1.0)
        later = await page.eval(
            "[...document.querySelectorAll('.msg.assistant')].pop().querySelector('.body').textContent.length"
        )
        assert later == stopped["n"]  # nothing arrives after Stop
        (out / f"chat-{label}-stopped.png").write_bytes(await page.screenshot())

        # the conversation so far went with the second question; a new one starts empty
        assert await page.eval("document.querySelectorAll('.msg').length") == 4
        await click(page, "#new")
        assert await page.eval("document.querySelectorAll('.msg').length") == 0
        assert await page.eval("document.querySelector('#send').disabled") is False


async def test_chat_page_on_smollm2(smol_swarm: Swarm, tmp_path: Path) -> None:
    await drive(smol_swarm, tmp_path, "smollm2", "What is the capital of France?")


async def test_chat_page_on_gemma3(gemma: Swarm, tmp_path: Path) -> None:
    await drive(gemma, tmp_path, "gemma3", "Name a colour.")


def keys_cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def test_chat_page_asks_for_a_key_where_keys_are_required(smol_swarm: Swarm, tmp_path: Path) -> None:
    """A second gateway on the same swarm that serves API keys only: the page shows the key field, and
    with the key typed in it lists the model and answers; the Responses and Ollama APIs want the key too."""
    keys_file = tmp_path / "keys.jsonl"
    key = keys_cli("add", "--keys-file", str(keys_file), "--name", "page")
    gw = smol_swarm.supervisor.start_gateway(
        name="gateway_chat_keys",
        tracker_url=url(smol_swarm.tracker),
        extra_args=["--api-keys-file", str(keys_file), "--no-anonymous"],
    ).ready(60)
    base = url(gw)
    try:

        def plain_http() -> None:  # one connection per request (see the report on keep-alive after a 401)
            tags = httpx.get(base + "/api/tags", timeout=30)
            assert tags.status_code == 401 and set(tags.json()) == {"error"}
            body = {"model": smol_swarm.model, "input": "hi"}
            responses = httpx.post(base + "/v1/responses", json=body, timeout=30)
            assert responses.status_code == 401 and responses.json()["error"]["code"] == "missing_api_key"
            keyed = httpx.get(base + "/api/tags", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert keyed.status_code == 200 and keyed.json()["models"]

        await trio.to_thread.run_sync(plain_http)
        async with headless_chromium(tmp_path, width=1200, height=700) as page:
            await page.goto(base + "/")
            await page.wait_for(
                "document.querySelector('#keyrow')?.classList.contains('shown')", 30, "the key field"
            )
            assert "API key" in await page.eval("document.querySelector('#status').textContent")
            await click(page, "#api-key")
            await type_text(page, key)
            await click(page, "#prompt")  # leaving the field commits the key
            await page.wait_for("Number(document.body?.dataset.models) >= 1", 30, "the model list")
            await set_field(page, "#max-tokens", "4")
            answer = await ask(page, "Hello!", 0, 120)
            assert answer["state"] == "done" and answer["text"], answer
            (artifacts(tmp_path) / "chat-api-key.png").write_bytes(await page.screenshot())
    finally:
        gw.stop()
