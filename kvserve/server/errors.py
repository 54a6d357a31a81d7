"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Client mistakes are 4xx with a message naming the problem; a 500 means a kvserve bug, never bad input.
A message is cut to MAX_MESSAGE_CHARS, so a body never echoes a large offending value back, and a 500
closes its connection (`Connection: close`): uvicorn closes it anyway after an unhandled exception, and
a client told so opens a new one rather than failing its next request on the dead one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvserve.server.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


_MAX_ERRORS = 4
MAX_MESSAGE_CHARS = 500
CLOSE = {"Connection": "close"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    detail = ErrorDetail(
        message=_printable(message, MAX_MESSAGE_CHARS),
        type=_TYPES.get(status, "server_error"),
        param=None if param is None else _printable(param, 64),
        code=code,
    )
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)


def _printable(text: str, limit: int) -> str:
    """text cut to limit characters, lone surrogates escaped (they cannot be written as UTF-8)."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem, e.g. "max_tokens: Input should be a valid integer"; plus the first field.

    A union field (prompt) fails once per accepted type; the location then names the type tried.
    """
    errors = exc.errors()
    lines = []
    for error in errors[:_MAX_ERRORS]:
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        lines.append(f"{loc or 'body'}: {error.get('msg')}")
    if len(errors) > _MAX_ERRORS:
        lines.append(f"and {len(errors) - _MAX_ERRORS} more")
    first_loc = [part for part in errors[0].get("loc", ()) if part != "body"] if errors else []
    return "; ".join(lines), str(first_loc[0]) if first_loc else None


def install_error_handlers(app: FastAPI, on_reject: Callable[[str, int], None]) -> None:
    """Every error response goes through here; on_reject(path, status) counts it."""

    def respond(
        request: Request,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        on_reject(request.url.path, status)
        return error_response(status, message, param, code, headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return respond(request, 400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return respond(request, exc.status_code, message, headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(request, 500, f"internal server error: {type(exc).__name__}", headers=CLOSE)
