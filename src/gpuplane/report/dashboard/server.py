"""The dashboard's web server: Starlette on uvicorn, every asset from the package (it works offline).

Routes: `/` the page, with the board's state inlined (the first paint needs no second request); `/static/…` the
page's script and style; `/api/state` the state as JSON; `/events` server-sent events, one `state` message every
`interval_s` seconds. `DashboardServer` runs it in a thread on a socket it binds itself (port 0: a free one).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gpuplane.model import GpuplaneError
from gpuplane.report.dashboard.state import Board

INTERVAL_S = 0.5
"""Seconds between two live updates (the target: at most 1 s apart)."""
STATIC = Path(str(resources.files("gpuplane.report.dashboard") / "static"))


class DashboardError(GpuplaneError):
    """The server could not start (the address is taken, say)."""


def state_json(board: Board) -> bytes:
    return orjson.dumps(board.state(), option=orjson.OPT_NON_STR_KEYS)


def page(board: Board) -> str:
    """The page with the state inlined (`</` escaped so no string in it can close the script element)."""
    template = (STATIC / "index.html").read_text(encoding="utf-8")
    inline = state_json(board).decode().replace("</", "<\\/")
    return template.replace("__TITLE__", board.title).replace("__STATE__", inline)


def make_app(board: Board, interval_s: float = INTERVAL_S) -> Starlette:
    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse(await run_in_threadpool(page, board), headers={"Cache-Control": "no-store"})

    async def api_state(request: Request) -> Response:
        return Response(await run_in_threadpool(state_json, board), media_type="application/json")

    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            seq = 0
            yield b"retry: 1000\n\n"
            next_at = time.monotonic()
            while not await request.is_disconnected():
                data = await run_in_threadpool(state_json, board)
                seq += 1
                yield b"id: " + str(seq).encode() + b"\nevent: state\ndata: " + data + b"\n\n"
                next_at += interval_s
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return Starlette(routes=[Route("/", index), Route("/api/state", api_state), Route("/events", events),
                             Mount("/static", StaticFiles(directory=STATIC), name="static")])


class DashboardServer:
    """The app served by uvicorn in a daemon thread. `url` is known once `start` returns."""

    def __init__(self, board: Board, host: str = "127.0.0.1", port: int = 0, interval_s: float = INTERVAL_S) -> None:
        self.board = board
        self.host = host
        self.port = port
        self.interval_s = interval_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self, timeout_s: float = 10.0) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise DashboardError(f"cannot listen on {self.host}:{self.port}: {exc}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(make_app(self.board, self.interval_s), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dashboard",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise DashboardError(f"the dashboard did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["INTERVAL_S", "DashboardError", "DashboardServer", "make_app", "page", "state_json"]
