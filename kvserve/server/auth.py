"""`--api-key`: every request but /health and the web page's files must carry `Authorization: Bearer <key>`.

The scheme is matched case-insensitively (RFC 9110 11.1: `bearer` is as good as `Bearer`), the key
exactly, in constant time.

A pure ASGI middleware, so it rejects before the body is read and leaves streaming and disconnect
detection of the endpoints untouched (Starlette's BaseHTTPMiddleware wraps both).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import error_response

# The web page's files hold no data (web_ui.py): the page asks for the key and sends it on every call.
OPEN_PATHS = frozenset({"/health", "/", "/web/app.js", "/web/style.css"})


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[str, int], None]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            self.on_reject(scope["path"], 401)
            response = error_response(
                401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, key = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(b" "), self.expected)
