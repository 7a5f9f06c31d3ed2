"""A headless Chromium page driven over the DevTools protocol, in real time.

`report.browser.Chromium` runs the page under a virtual clock (`--virtual-time-budget`): fine for reading what a
page shows, but its `performance.now()` is not wall time and a server-sent event stream arrives all at once. A
live page's timings (first paint, the gap between two updates) need the real clock: `DevToolsPage` starts Chromium
with a remote-debugging port, opens the page and evaluates expressions in it while it runs. Failures are
`BrowserError`s, as in the kit.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

from gpuplane.report.browser import BrowserError, Screenshot, find_chromium, png_size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DevToolsPage:
    """One page in its own headless Chromium (fresh profile, own process group), `width` × `height`."""

    def __init__(self, width: int = 1400, height: int = 900, *, binary: Path | None = None,
                 timeout_s: float = 60.0) -> None:
        self.binary = binary if binary is not None else find_chromium()
        self.width, self.height, self.timeout_s = width, height, timeout_s
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ws: websocket.WebSocket | None = None
        self._id = 0

    def __enter__(self) -> DevToolsPage:
        self._profile = tempfile.TemporaryDirectory(prefix="gpuplane-devtools-")
        port = _free_port()
        command = [str(self.binary), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--no-first-run", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
                   "--force-device-scale-factor=1", f"--window-size={self.width},{self.height}",
                   f"--user-data-dir={self._profile.name}", f"--remote-debugging-port={port}", "about:blank"]
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        except OSError as exc:
            self.close()
            raise BrowserError(f"chromium {self.binary} could not start: {exc}") from None
        deadline = time.monotonic() + self.timeout_s
        target: str | None = None
        while target is None:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise BrowserError("chromium's DevTools endpoint did not come up")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as answer:
                    pages = [t for t in json.load(answer) if t.get("type") == "page"]
                target = pages[0]["webSocketDebuggerUrl"] if pages else None
            except (OSError, ValueError, KeyError):
                target = None
            if target is None:
                time.sleep(0.1)
        self._ws = websocket.create_connection(target, timeout=self.timeout_s, suppress_origin=True)
        self.send("Page.enable")
        self.send("Runtime.enable")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None
        if self._proc is not None:
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            self._proc = None
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        if self._ws is None:
            raise BrowserError("the page is not open")
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The expression's value in the page (JSON-able), or a `BrowserError` if it throws."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]!r} threw: {result['exceptionDetails'].get('text')}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 10.0, every_s: float = 0.05) -> Any:
        """Poll until `expression` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression[:80]!r} was not true within {timeout_s:g} s")
            time.sleep(every_s)

    def dom(self) -> str:
        return str(self.evaluate("document.documentElement.outerHTML"))

    def screenshot(self, out: Path, *, full_page: bool = False) -> Screenshot:
        """A PNG of the viewport (`full_page`: the whole page's height at the page's width)."""
        height = self.height
        if full_page:
            height = max(height, int(self.evaluate("document.documentElement.scrollHeight")))
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1,
                  mobile=False)
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        width, got = png_size(data)
        return Screenshot(out, width, got, len(data))


__all__ = ["DevToolsPage"]
