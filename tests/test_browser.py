"""The headless-Chromium kit: real Chromium renders small pages to PNGs of the asked size and gives back the
DOM after the page's scripts ran; a missing, failing, hanging or silent browser is a clear error."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from gpuplane.report.browser import (
    CHROMIUM_ENV,
    BrowserError,
    Chromium,
    artefact_path,
    dom_text,
    find_chromium,
    page_url,
    png_size,
    shrink_png,
    table_rows,
)

PAGE = """<!doctype html><html><head><style>body { margin: 0; background: rgb(200, 30, 30); }</style></head>
<body><table><tr><th>cards full</th><td id="full">17</td></tr><tr><th>pods pending</th><td id="pending"></td></tr>
</table><script>document.getElementById("pending").textContent = String(6 * 7);</script></body></html>"""
"""Red background; 17 written in the HTML, 42 (6 × 7) written by the page's script after load."""


@pytest.fixture(scope="module")
def chromium() -> Chromium:
    return Chromium.find()


@pytest.fixture
def page(tmp_path: Path) -> Path:
    path = tmp_path / "page.html"
    path.write_text(PAGE, encoding="utf-8")
    return path


def test_the_debian_chromium_is_found() -> None:
    found = find_chromium()
    assert found.is_file() and os.access(found, os.X_OK)


@pytest.mark.parametrize(("width", "height"), [(320, 200), (1000, 1400)])
def test_a_screenshot_is_a_png_of_the_asked_size_showing_the_page(chromium: Chromium, page: Path, width: int,
                                                                  height: int) -> None:
    out = artefact_path(f"test_browser-{width}x{height}.png")
    shot = chromium.screenshot(page, out, width, height)
    data = out.read_bytes()
    assert (shot.width, shot.height, shot.size_bytes) == (width, height, len(data))
    assert png_size(data) == (width, height)
    with Image.open(out) as image:
        assert image.size == (width, height)
        # the page's body is red below the table: the bottom-right pixel is the page's background, not white
        assert image.convert("RGB").getpixel((width - 1, height - 1)) == (200, 30, 30)


def test_the_dumped_dom_has_the_numbers_the_page_shows_after_its_scripts(chromium: Chromium, page: Path) -> None:
    dom = chromium.dump_dom(page)
    assert ["cards full", "17"] in table_rows(dom)
    assert ["pods pending", "42"] in table_rows(dom)  # written by the script: 6 × 7
    assert "cards full 17 pods pending 42" in dom_text(dom)
    assert "String(6" not in dom_text(dom)  # scripts are not text a reader sees


def test_a_file_url_and_a_path_render_the_same_dom(chromium: Chromium, page: Path) -> None:
    assert table_rows(chromium.dump_dom(page.as_uri())) == table_rows(chromium.dump_dom(str(page)))


def _fake(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake-chromium"
    script.write_text("#!/bin/sh\n" + body + "\n", encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.parametrize(("body", "message"), [
    ("echo 'the renderer crashed' >&2; exit 3", "failed (exit 3): the renderer crashed"),
    ("exit 0", "wrote no screenshot"),
    ("for a in \"$@\"; do case $a in --screenshot=*) printf 'GIF89a' > \"${a#--screenshot=}\";; esac; done",
     "not a PNG"),
])
def test_a_browser_that_fails_or_writes_nothing_is_an_error_naming_it(tmp_path: Path, page: Path, body: str,
                                                                      message: str) -> None:
    browser = Chromium(_fake(tmp_path, body), timeout_s=20)
    with pytest.raises(BrowserError, match=re.escape(message)):
        browser.screenshot(page, tmp_path / "out.png", 100, 100)


def test_a_screenshot_of_another_size_than_asked_is_an_error(tmp_path: Path, page: Path, chromium: Chromium) -> None:
    real = chromium.screenshot(page, tmp_path / "real.png", 50, 40)
    body = (f"for a in \"$@\"; do case $a in --screenshot=*) cp {real.path} \"${{a#--screenshot=}}\";; esac; done")
    with pytest.raises(BrowserError, match="50 × 40 screenshot, 60 × 40 was asked"):
        Chromium(_fake(tmp_path, body)).screenshot(page, tmp_path / "out.png", 60, 40)


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (killed, not yet reaped by whoever adopted it) is not alive."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_a_hung_browser_is_killed_with_its_children_at_the_timeout(tmp_path: Path, page: Path) -> None:
    pid_file = tmp_path / "child.pid"
    browser = Chromium(_fake(tmp_path, f"sleep 60 & echo $! > {pid_file}; wait"), timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(BrowserError, match="timed out after 1 s"):
        browser.dump_dom(page)
    assert time.monotonic() - started < 10
    assert not _alive(int(pid_file.read_text()))  # the browser's child went with it (its process group was killed)


def test_a_missing_browser_or_page_is_an_error_saying_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 page: Path) -> None:
    with pytest.raises(BrowserError, match="apt-get install chromium"):
        find_chromium(tmp_path / "no-such-chromium")
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "nor-this"))
    with pytest.raises(BrowserError, match="nor-this"):
        find_chromium()
    with pytest.raises(BrowserError, match="does not exist"):
        page_url(tmp_path / "missing.html")
    with pytest.raises(BrowserError, match="positive size"):
        Chromium(Path("/bin/true")).screenshot(page, tmp_path / "x.png", 0, 10)
    assert page_url("http://127.0.0.1:8000/x") == "http://127.0.0.1:8000/x"


@settings(max_examples=50, deadline=None)
@given(cells=st.lists(st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=4), min_size=1, max_size=6))
def test_table_rows_give_back_every_cell_in_order(cells: list[list[int]]) -> None:
    dom = "<html><body><table>" + "".join(
        "<tr>" + "".join(f"<td> {v}\n</td>" for v in row) + "</tr>" for row in cells) + "</table></body></html>"
    assert table_rows(dom) == [[str(v) for v in row] for row in cells]
    assert dom_text(dom) == " ".join(str(v) for row in cells for v in row)


def test_a_full_page_screenshot_ends_below_the_pages_last_content(chromium: Chromium, tmp_path: Path) -> None:
    page = tmp_path / "tall.html"
    page.write_text('<html><body style="margin:0;background:#fff"><div style="height:300px;background:#00f">'
                    "</div></body></html>", encoding="utf-8")
    shot = chromium.full_page(page, artefact_path("test_browser-full-page.png"), 200, max_height=1000, margin=10)
    assert (shot.width, shot.height) == (200, 310)  # 300 px of blue, then the 10 px margin
    with Image.open(shot.path) as image:
        assert image.size == (200, 310)
        assert image.convert("RGB").getpixel((100, 299)) == (0, 0, 255)
        assert image.convert("RGB").getpixel((100, 300)) == (255, 255, 255)


def test_a_shrunk_screenshot_keeps_its_size_in_a_palette(chromium: Chromium, page: Path, tmp_path: Path) -> None:
    shot = chromium.screenshot(page, tmp_path / "shot.png", 400, 300)
    small = shrink_png(shot.path, colours=16)
    assert (small.width, small.height) == (400, 300)
    with Image.open(small.path) as image:
        assert image.mode == "P"
        assert len(image.getcolors() or []) <= 16
        pixel = image.convert("RGB").getpixel((399, 299))
        assert isinstance(pixel, tuple)
        # the background survives, to within the palette's rounding (octree buckets: a level or two)
        assert max(abs(a - b) for a, b in zip(pixel, (200, 30, 30), strict=True)) <= 4
