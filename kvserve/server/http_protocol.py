"""uvicorn's httptools protocol with two limits it lacks: time and bytes to send a request's headers.

uvicorn starts the ASGI app only once the headers are complete, and until then waits as long as the
client likes: a connection that trickles its headers (or sends nothing) stays open for good. Here the
request line and headers must arrive within `header_timeout_s` of the connection opening or of the
request's first byte, and hold at most `max_header_bytes`; otherwise the connection is answered with
408 or 431 and closed. The request body has its own limits (body_limit.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _raw_response(status: str, message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


class _LimitedHeadersProtocol(HttpToolsProtocol):
    header_timeout_s: float
    max_header_bytes: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._start_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        super().on_headers_complete()

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
            message = f"request line and headers exceed {self.max_header_bytes} bytes (--max-header-bytes)"
            self._refuse("431 Request Header Fields Too Large", message)

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            message = f"no complete request headers within {self.header_timeout_s:g} s (--header-timeout-s)"
            self._refuse("408 Request Timeout", message)

    def _refuse(self, status: str, message: str) -> None:
        self._stop_header_timer()
        self.transport.write(_raw_response(status, message))
        self.transport.close()


def limited_headers_protocol(header_timeout_s: float, max_header_bytes: int) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn.Config(http=...)."""
    return type(
        "LimitedHeadersProtocol",
        (_LimitedHeadersProtocol,),
        {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes},
    )
