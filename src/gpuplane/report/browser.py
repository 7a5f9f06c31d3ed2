"""Headless Chromium for the reports and the dashboard: a page (a file or a URL) rendered to a PNG of a
given size, and its DOM after load, so that tests can read the numbers the page shows.

Chromium runs once per call (`--headless --screenshot` or `--dump-dom`) in its own process group, with a
fresh profile and a timeout; a hung browser is killed with all its children. A missing binary, a failed
run or a screenshot that is not the PNG asked for is a `BrowserError` saying what happened, never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
from PIL import Image

from gpuplane.model import GpuplaneError

CHROMIUM_ENV = "GPUPLANE_CHROMIUM"
"""An explicit browser binary; otherwise `CHROMIUM_PATHS`, then `CHROMIUM_NAMES` on PATH."""
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/lib/chromium/chromium")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "install Debian's chromium (apt-get install chromium) or set GPUPLANE_CHROMIUM to a browser binary"
ARTEFACTS_ENV = "GPUPLANE_TEST_ARTEFACTS"
"""Where tests keep their screenshots; `build/test-artefacts` under the working directory when unset."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_NOISE = ("dbus/", "Fontconfig", "unexpected operator", "bytes written to file", "GPU stall", "gles2", "viz_main")
"""stderr lines Chromium prints on a healthy headless run here (no D-Bus, no GPU): left out of error messages."""


class BrowserError(GpuplaneError):
    """Chromium is missing, failed, timed out, or did not write what was asked."""


@dataclass(frozen=True, slots=True)
class Screenshot:
    path: Path
    width: int
    height: int
    size_bytes: int


def artefact_path(name: str) -> Path:
    """A path for a test's artefact (a screenshot), its folder made: under $GPUPLANE_TEST_ARTEFACTS or
    build/test-artefacts."""
    folder = Path(os.environ.get(ARTEFACTS_ENV) or "build/test-artefacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def find_chromium(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The browser binary: `explicit`, then $GPUPLANE_CHROMIUM, then the Debian paths, then PATH."""
    chosen = explicit if explicit is not None else os.environ.get(CHROMIUM_ENV) or None
    if chosen is not None:
        path = Path(chosen)
        found = path if path.is_file() else Path(shutil.which(str(chosen)) or "")
        if not found.is_file() or not os.access(found, os.X_OK):
            raise BrowserError(f"chromium {str(chosen)!r} is not an executable file; {INSTALL_HINT}")
        return found
    for candidate in CHROMIUM_PATHS:
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    for name in CHROMIUM_NAMES:
        where = shutil.which(name)
        if where is not None:
            return Path(where)
    raise BrowserError(f"no chromium found (looked at {', '.join(CHROMIUM_PATHS)} and for "
                       f"{', '.join(CHROMIUM_NAMES)} on PATH); {INSTALL_HINT}")


def page_url(target: str | os.PathLike[str]) -> str:
    """A URL for a page: an http(s)/file/data URL as given, a path as a file:// URL (which must exist)."""
    text = os.fspath(target)
    if text.startswith(("http://", "https://", "file://", "data:")):
        return text
    path = Path(text).resolve()
    if not path.is_file():
        raise BrowserError(f"page {text!r} does not exist")
    return path.as_uri()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header; anything else is a `BrowserError`."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise BrowserError("not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@dataclass(frozen=True, slots=True)
class Chromium:
    """One headless browser binary. `budget_ms` is virtual time the page's scripts get before the capture."""

    binary: Path
    timeout_s: float = 60.0
    budget_ms: int = 2000

    @staticmethod
    def find(explicit: str | os.PathLike[str] | None = None, timeout_s: float = 60.0) -> Chromium:
        return Chromium(find_chromium(explicit), timeout_s)

    def _run(self, args: list[str], what: str) -> str:
        with tempfile.TemporaryDirectory(prefix="gpuplane-chromium-") as profile:
            command = [str(self.binary), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                       "--no-first-run", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
                       "--force-device-scale-factor=1", f"--user-data-dir={profile}",
                       f"--virtual-time-budget={self.budget_ms}", *args]
            try:
                proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
            except OSError as exc:
                raise BrowserError(f"chromium {self.binary} could not start: {exc}; {INSTALL_HINT}") from None
            try:
                out, err = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise BrowserError(f"chromium {what} timed out after {self.timeout_s:g} s") from None
            if proc.returncode != 0:
                raise BrowserError(f"chromium {what} failed (exit {proc.returncode}): {_stderr_tail(err)}")
            return out

    def screenshot(self, target: str | os.PathLike[str], out: Path, width: int, height: int) -> Screenshot:
        """Render `target` in a `width` × `height` window and write the PNG to `out`."""
        if width <= 0 or height <= 0:
            raise BrowserError(f"a screenshot needs a positive size, got {width} × {height}")
        url = page_url(target)
        out = out.resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        self._run([f"--window-size={width},{height}", f"--screenshot={out}", url], f"screenshot of {url[:200]}")
        if not out.is_file():
            raise BrowserError(f"chromium exited cleanly but wrote no screenshot to {out}")
        data = out.read_bytes()
        got = png_size(data)
        if got != (width, height):
            raise BrowserError(f"chromium wrote a {got[0]} × {got[1]} screenshot, {width} × {height} was asked")
        return Screenshot(out, width, height, len(data))

    def full_page(self, target: str | os.PathLike[str], out: Path, width: int, max_height: int = 16_000,
                  margin: int = 24) -> Screenshot:
        """The whole page at `width`: rendered `max_height` tall, then cut `margin` pixels below the last row
        that differs from the page's background (the bottom-right pixel)."""
        shot = self.screenshot(target, out, width, max_height)
        with Image.open(shot.path) as opened:
            image = opened.convert("RGB")
        pixels = np.asarray(image)
        background = pixels[-1, -1]
        rows = np.flatnonzero((pixels != background).any(axis=(1, 2)))
        height = min(max_height, int(rows[-1]) + 1 + margin) if len(rows) else max_height
        image.crop((0, 0, width, height)).save(shot.path, optimize=True)
        return Screenshot(shot.path, width, height, shot.path.stat().st_size)

    def dump_dom(self, target: str | os.PathLike[str]) -> str:
        """The page's DOM, serialised after load and `budget_ms` of its scripts."""
        url = page_url(target)
        dom = self._run(["--dump-dom", url], f"DOM of {url[:200]}")
        if "<html" not in dom.lower():
            raise BrowserError(f"chromium gave back no DOM for {url[:200]}")
        return dom


def shrink_png(path: Path, colours: int = 256) -> Screenshot:
    """Rewrite a screenshot as a palette PNG of at most `colours` colours (plots and text keep their look at a
    fraction of the size): for screenshots kept in the repository."""
    with Image.open(path) as opened:
        image = opened.convert("RGB")
    image.quantize(colors=colours, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(path, optimize=True)
    return Screenshot(path, image.width, image.height, path.stat().st_size)


def _stderr_tail(err: str, lines: int = 8) -> str:
    kept = [line for line in err.splitlines() if line.strip() and not any(n in line for n in _NOISE)]
    return " | ".join(kept[-lines:]) or "(nothing on stderr)"


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.skip = 0
        self.parts: list[str] = []
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style", "head"):
            self.skip += 1
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th") and self.rows:
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "head"):
            self.skip = max(0, self.skip - 1)
        elif tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(" ".join("".join(self.cell).split()))
            self.cell = None
        self.parts.append(" ")

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        self.parts.append(data)
        if self.cell is not None:
            self.cell.append(data)


def dom_text(dom: str) -> str:
    """The text a reader sees in a DOM (no scripts or styles), whitespace collapsed."""
    parser = _Text()
    parser.feed(dom)
    return " ".join("".join(parser.parts).split())


def table_rows(dom: str) -> list[list[str]]:
    """Every table row in the DOM, in order, as its cells' texts (header cells included)."""
    parser = _Text()
    parser.feed(dom)
    return parser.rows
