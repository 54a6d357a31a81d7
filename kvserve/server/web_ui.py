"""The web page at `/` (kvserve/server/web/: plain HTML, JS and CSS, no build step, nothing fetched from
elsewhere) and the live view's feed, `/v1/engine/events` (engine_events.py). `--no-web-ui` leaves both out.

With `--api-key` the page's three files are served openly (auth.py's OPEN_PATHS): they are the same for
everyone and hold no data. The page asks for the key and sends it as `Authorization: Bearer` on every
call; the API and the events stream refuse anything without it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from kvserve.engine.step_trace import StepTrace
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.engine_client import EngineClient
from kvserve.server.engine_events import EngineEvents
from kvserve.server.errors import APIError
from kvserve.server.streaming import SSEResponse

WEB_DIR = Path(__file__).parent / "web"
# path -> (file, media type); the page loads nothing else.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/style.css": ("style.css", "text/css; charset=utf-8"),
}
# The browser itself refuses to load or connect anywhere but this server.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def install_web_ui(app: FastAPI, async_engine: EngineClient, model_name: str) -> EngineEvents | None:
    """Add the page and the events endpoint; returns the feed (None where the engine is not in this
    process, e.g. Ray replicas: the page then says the live view is unavailable)."""
    for path, (name, media_type) in PAGE_FILES.items():
        app.add_api_route(path, _file_route(WEB_DIR / name, media_type), methods=["GET"], include_in_schema=False)

    events = _engine_events(async_engine, model_name)

    @app.get("/v1/engine/events", include_in_schema=False)
    async def engine_events(request: Request) -> SSEResponse:
        if events is None:
            raise APIError(404, "the live engine view needs the engine in this process (not available with replicas)")
        return events.response(request)

    return events


def _file_route(path: Path, media_type: str) -> Callable[[], Awaitable[FileResponse]]:
    async def page_file() -> FileResponse:
        return FileResponse(path, media_type=media_type, headers=_HEADERS)

    return page_file


def _engine_events(async_engine: EngineClient, model_name: str) -> EngineEvents | None:
    if not isinstance(async_engine, AsyncEngine):
        return None
    engine = async_engine.engine
    if engine.step_trace is None:
        # The engine thread reads this attribute once per step; assigning it is atomic.
        engine.step_trace = StepTrace()
    config = engine.config
    info = {
        "model": model_name,
        "kv_blocks_total": engine.pool.num_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "speculative": engine.speculator is not None,
        "prefix_caching": config.enable_prefix_caching,
    }
    return EngineEvents(engine.step_trace, async_engine.stats, info)
