"""`kvserve serve`: the engine loop, the app and uvicorn, with a draining shutdown.

On the first SIGTERM/SIGINT the server stops admitting (503, /health says "draining"), lets in-flight
requests finish for up to drain_timeout_s, aborts what is left, then lets uvicorn close. A second
signal exits at once, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import threading
from types import FrameType

import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.startup_report import StartupReport, engine_report, time_since_start
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.http_protocol import limited_headers_protocol
from kvserve.server.limits import ServerLimits
from kvserve.server.openai_api import build_app

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout_s: float, report: StartupReport
    ) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout_s = drain_timeout_s
        self.report = report
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: the report is complete
            self.report.add("listen", f"http://{self.config.host}:{self.config.port}")
            self.report.add("time to ready", time_since_start())
            for line in self.report.lines():
                logger.info("%s", line)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        # Signal handlers run between bytecodes of the loop's thread: hand the work to the loop.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            logger.info(
                "draining: refusing new requests, waiting up to %.0f s for in-flight ones", self.drain_timeout_s
            )
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.async_engine.drain(self.drain_timeout_s)
        self.should_exit = True


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
    web_ui: bool = True,
    limits: ServerLimits | None = None,
) -> None:
    """The engine loop on this (main) thread, uvicorn on another: see async_engine.py for why."""
    limits = limits or ServerLimits()
    log_to_stderr(log_level)
    logger.info("loading %s (device %s, dtype %s)", config.model, config.device, config.dtype)
    engine = LLMEngine(config)
    report = engine_report(engine)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, api_key, served_model_name, web_ui=web_ui, limits=limits)
    # What is loaded by now (torch, the model, its tokenizer, the app) lives as long as the server. Frozen out of
    # the cyclic collector's generations, a full collection walks only what requests allocated since, not this
    # heap, so it no longer stalls every running request's next token (vLLM freezes its engine's heap too;
    # benchmarks/RESULTS.md, "The decode step's model converted once").
    gc.collect()
    gc.freeze()
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        http=limited_headers_protocol(limits.header_timeout_s, limits.max_header_bytes),
    )
    server = DrainingServer(uv_config, async_engine, drain_timeout_s, report)
    # uvicorn installs its signal handlers only on the main thread, which the engine holds here.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    http = threading.Thread(target=_serve_http, args=(server, async_engine), name="kvserve-http")
    http.start()
    async_engine.run()
    http.join()


def log_to_stderr(level: str) -> None:
    """kvserve's own log lines (the startup report, kernel builds, draining) beside uvicorn's, in its format."""
    kvserve_logger = logging.getLogger("kvserve")
    kvserve_logger.setLevel(level.upper())
    if not kvserve_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        kvserve_logger.addHandler(handler)


def _serve_http(server: DrainingServer, async_engine: AsyncEngine) -> None:
    try:
        server.run()
    finally:  # however uvicorn ended (drained, failed to bind), the engine loop ends with it
        async_engine.shutdown()
