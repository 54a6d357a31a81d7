"""Run an app on a free local port in a background thread (tests, notebooks, end-to-end benchmarks);
how those drive the web page in a browser; and an engine stand-in for the page's feed without a model."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from types import SimpleNamespace, TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.step_trace import StepTrace

# Debian's chromium, headless, without a sandbox (CI runs as root), a GPU or any network of its own.
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


class ServerThread:
    """`with ServerThread(app) as server:` serves on server.base_url until the block ends."""

    def __init__(self, app: FastAPI, start_timeout_s: float = 30.0) -> None:
        # Binding here (port 0) and handing uvicorn the socket avoids racing other processes for a port.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._start_timeout_s = start_timeout_s

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


class StandInEngine:
    """The parts of an LLMEngine that AsyncEngine and the web UI read; it never runs a step (a test or
    a benchmark appends to its step ring as the engine thread would)."""

    model_name = "stand-in-model"
    max_model_len = 64
    max_sequence_len = 64
    quantization = "none"
    # The app sizes its prompt-length limit from this when it is built; the stand-in serves no prompt.
    tokenizer = SimpleNamespace(max_token_bytes=16)
    speculator = None

    def __init__(self) -> None:
        self.config = EngineConfig()
        self.pool = SimpleNamespace(num_blocks=100)
        self.step_trace: StepTrace | None = None

    def stats(self) -> dict[str, Any]:
        return {"num_running": 1, "num_waiting": 2, "kv_blocks_total": 100, "steps": 0, "model": "stand-in"}

    def has_unfinished_requests(self) -> bool:
        return False
