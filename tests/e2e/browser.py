"""A real headless Chromium driven over the DevTools protocol (for dashboard tests).

Uses the system's ``chromium`` (Debian's package; ``.ci/run`` installs it) and
speaks the DevTools protocol over ``trio-websocket`` (already a dependency), so
no browser-automation library and no downloaded browser build is needed::

    async with headless_chromium(tmp_path) as page:
        await page.goto("http://127.0.0.1:7460/")
        n = await page.eval("document.querySelectorAll('tr').length")
        png = await page.screenshot()

Every wait is bounded (``trio.fail_after``); the browser process is killed on exit.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--mute-audio",
)


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class BrowserError(Exception):
    pass


class Page:
    def __init__(self, ws: WebSocketConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self._ws.send_message(json.dumps({"id": msg_id, "method": method, "params": params}))
        with trio.fail_after(30):
            while True:
                reply = json.loads(await self._ws.get_message())
                if reply.get("id") == msg_id:
                    if "error" in reply:
                        raise BrowserError(f"{method}: {reply['error']}")
                    return dict(reply.get("result", {}))

    async def goto(self, url: str) -> None:
        await self.call("Page.enable")
        await self.call("Page.navigate", url=url)

    async def eval(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str = "") -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        with trio.move_on_after(timeout_s):
            while True:
                value = await self.eval(expression)
                if value:
                    return value
                await trio.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or expression}")

    async def screenshot(self, *, full_page: bool = True) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = await self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            params["captureBeyondViewport"] = True
        return base64.b64decode((await self.call("Page.captureScreenshot", **params))["data"])


@asynccontextmanager
async def headless_chromium(
    workdir: Path, *, width: int = 1440, height: int = 1000, log: Callable[[str], None] | None = None
) -> AsyncIterator[Page]:
    exe = chromium_path()
    if exe is None:
        raise BrowserError("no chromium on PATH (apt-get install chromium)")
    profile = workdir / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    proc = await trio.lowlevel.open_process(
        [
            exe,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        with trio.fail_after(30):
            while not port_file.exists() or not port_file.read_text().strip():
                if proc.poll() is not None:
                    raise BrowserError(f"chromium exited with {proc.returncode} before it listened")
                await trio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with httpx.AsyncClient() as http:
            with trio.fail_after(15):
                while True:
                    targets = (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
                    pages = [t for t in targets if t.get("type") == "page"]
                    if pages:
                        break
                    await trio.sleep(0.1)
        async with open_websocket_url(
            pages[0]["webSocketDebuggerUrl"], max_message_size=64 * 1024 * 1024
        ) as ws:
            page = Page(ws)
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            yield page
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await proc.wait()


async def click(page: Page, selector: str) -> None:
    """A left click in the middle of the element ``selector`` matches (as a person clicks)."""
    box = await page.eval(
        f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
        " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
    )
    x, y = box
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        extra = {"button": "left", "clickCount": 1} if kind != "mouseMoved" else {}
        await page.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)


async def type_text(page: Page, text: str) -> None:
    """Type ``text`` into the focused element (what a keyboard's input method delivers)."""
    await page.call("Input.insertText", text=text)


async def press_enter(page: Page) -> None:
    for kind in ("keyDown", "keyUp"):
        await page.call(
            "Input.dispatchKeyEvent",
            type=kind,
            key="Enter",
            code="Enter",
            windowsVirtualKeyCode=13,
            nativeVirtualKeyCode=13,
            **({"text": "\r"} if kind == "keyDown" else {}),
        )


async def select_all(page: Page) -> None:
    """Ctrl+A in the focused field (so the next typing replaces its value)."""
    for kind in ("keyDown", "keyUp"):
        await page.call(
            "Input.dispatchKeyEvent", type=kind, key="a", code="KeyA", windowsVirtualKeyCode=65, modifiers=2
        )
