"""A real headless Chromium, driven over the DevTools protocol.

The dashboard's pages are bokeh apps: the HTML is an empty shell, and bokeh's
JavaScript fetches the document over a websocket and renders it into shadow
DOM.  ``chromium --dump-dom`` neither waits for that (``--virtual-time-budget``
fast-forwards the page's timers, which here left the page blank) nor prints
shadow roots.  So the browser is started with a DevTools port, told to open
the page, and asked (``Runtime.evaluate``) for the page's text, shadow roots
included, until the expected text is there; then it takes the screenshot
(``Page.captureScreenshot``).  Only tornado (distributed's web server) is
needed for the websocket.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Any, Callable

__all__ = ["chromium", "Page", "open_page"]

#: Environment variable naming the browser to use instead of the one on PATH.
BROWSER_ENV = "FIBER_DASK_CHROMIUM"

# Every text node of the page, through open shadow roots (bokeh renders its
# widgets into them), without <style>/<script> contents.
_TEXT = r"""
(() => {
  const out = [];
  const walk = (n) => {
    if (n.nodeType === 3) { out.push(n.textContent); return; }
    if (n.nodeName === 'STYLE' || n.nodeName === 'SCRIPT') return;
    if (n.shadowRoot) walk(n.shadowRoot);
    for (const c of n.childNodes) walk(c);
  };
  walk(document.documentElement);
  return out.join('\n');
})()
"""


def chromium() -> str | None:
    """The Chromium executable: ``$FIBER_DASK_CHROMIUM`` or one on PATH."""
    named = os.environ.get(BROWSER_ENV)
    if named:
        return shutil.which(named) or named
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Page:
    """One browser tab, on a DevTools websocket (use :func:`open_page`)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        mine = self._ids
        await self._ws.write_message(
            json.dumps({"id": mine, "method": method, "params": params})
        )
        while True:
            raw = await self._ws.read_message()
            if raw is None:
                raise ConnectionError(f"the browser hung up during {method}")
            msg = json.loads(raw)
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def text(self) -> str:
        result = await self.call(
            "Runtime.evaluate", expression=_TEXT, returnByValue=True
        )
        return str(result["result"].get("value") or "")

    async def wait_for_text(
        self, predicate: Callable[[str], Any], timeout: float, what: str
    ) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = await self.text()
            if predicate(text):
                return text
            await asyncio.sleep(0.2)
        raise AssertionError(
            f"timed out after {timeout:g}s waiting for {what}; the page shows:\n{text}"
        )

    async def screenshot(self, path: str) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))


def open_page(
    url: str,
    work: Callable[[Page], Any],
    *,
    width: int = 1280,
    height: int = 800,
    timeout: float = 60.0,
) -> Any:
    """Open ``url`` in a new headless Chromium, run ``await work(page)``, close it.

    The browser is a child of this process, ended (and waited for) however
    ``work`` ends.
    """
    from tornado.websocket import websocket_connect

    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH")
    profile = tempfile.mkdtemp(prefix="fiber-dask-chromium-")
    proc = subprocess.Popen(
        [
            exe,
            "--headless",
            "--no-sandbox",  # root in CI: Chromium's sandbox refuses to run as root
            "--disable-gpu",
            "--no-first-run",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def drive() -> Any:
        port_file = os.path.join(profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{exe} exited with {proc.returncode} at start")
            try:
                with open(port_file) as f:
                    port = int(f.read().split()[0])
                break
            except (OSError, ValueError, IndexError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{exe} opened no DevTools port") from None
                await asyncio.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10) as r:
            targets = json.load(r)
        (tab,) = [t for t in targets if t.get("type") == "page"][:1]
        ws = await websocket_connect(tab["webSocketDebuggerUrl"])
        try:
            page = Page(ws)
            # The screenshot is exactly width x height, whatever the window.
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            await page.call("Page.enable")
            await page.call("Page.navigate", url=url)
            result = await work(page)
            try:
                await page.call("Browser.close")
            except (ConnectionError, RuntimeError):
                pass
            return result
        finally:
            ws.close()

    try:
        return asyncio.run(drive())
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
