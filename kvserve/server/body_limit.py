"""Request bodies: at most `max_request_body_bytes`, received within `body_timeout_s`.

A pure ASGI middleware (as auth.py). A declared Content-Length past the limit is refused (413) before a
byte of the body is read; a chunked body is counted as it arrives and refused at the first chunk past
the limit. Both refusals, and a body that is still incomplete at the deadline (408), close the
connection: the rest of the body is never read. After a large body the freed heap is handed back to
the OS beyond `retained_free_memory_bytes` (host_memory.py), so one outlier does not set the server's
memory for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine.host_memory import return_freed_memory_beyond
from kvserve.server.errors import CLOSE, error_response

# Bodies from this size on are followed by a check of the freed heap (a few dozen microseconds).
LARGE_BODY_BYTES = 2**20


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        retained_free_bytes: int,
        on_reject: Callable[[str, int], None],
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.retained_free_bytes = retained_free_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            self.on_reject(scope["path"], 413)
            await error_response(413, self._too_large(declared.decode("latin-1")[:20]), headers=CLOSE)(
                scope, receive, send
            )
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # afterwards receive() only waits for the client to disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise HTTPException(
                    408, f"the request body was not received within {self.timeout_s:g} s (--body-timeout-s)", CLOSE
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large(f"more than {self.max_bytes}"), CLOSE)
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            if received >= LARGE_BODY_BYTES:
                loop.run_in_executor(None, return_freed_memory_beyond, self.retained_free_bytes)

    def _too_large(self, size: str) -> str:
        return f"the request body is {size} bytes; at most {self.max_bytes} are accepted (--max-request-body-bytes)"
