"""The FastAPI app: OpenAI-compatible completions and chat (plain and SSE), models, health, metrics.

A generation request is checked against the server's limits (limits.py), tokenized off the event loop
and the engine thread (inputs.py), and admitted (all its prompts queued in the engine) before any
response byte is sent, so every refusal — bad input 400, unknown model 404, full queue 429, draining 503 — is an HTTP
status with an OpenAI error body. Once admitted, its stream is released exactly once, however the
response ends: a client that goes away aborts it (blocks freed before the next iteration).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from pydantic import BaseModel

from kvserve.engine.input_processor import QueueFullError
from kvserve.engine.outputs import RequestOutput
from kvserve.server.auth import BearerAuth
from kvserve.server.body_limit import BodyLimit
from kvserve.server.chat import ChatFlavor
from kvserve.server.completions import CompletionsFlavor
from kvserve.server.engine_client import EngineClient, EngineUnavailableError, RequestStream
from kvserve.server.errors import APIError, error_response, install_error_handlers
from kvserve.server.inputs import InputProcessor
from kvserve.server.limits import RequestLimits, ServerLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvserve.server.streaming import Flavor, ResponseMeta, SSEResponse, failure_of, sse_events, usage_of
from kvserve.server.web_ui import install_web_ui

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 429, 500, 503)
}


class _Generator:
    """Admission, tracking and response shaping shared by both generation endpoints."""

    def __init__(self, async_engine: EngineClient, metrics: ServerMetrics, model_name: str, inputs: InputProcessor):
        self.async_engine = async_engine
        self.metrics = metrics
        self.model_name = model_name
        self.inputs = inputs

    async def __call__(self, request: Request, body: Any, flavor: Flavor, id_prefix: str) -> Response:
        arrival = time.perf_counter()
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        meta = ResponseMeta(f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name, body.n)
        meta.body = body
        try:
            prompts, params = await self.inputs(flavor, body)
            stream = await self.async_engine.submit(meta.id, prompts, params, body.cache_salt, arrival)
        except ValueError as exc:
            raise APIError(400, str(exc), getattr(exc, "param", None)) from exc
        except QueueFullError as exc:
            raise APIError(429, f"server busy: {exc}; retry later") from exc
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc)) from exc

        endpoint = request.url.path
        if body.stream:
            events = sse_events(stream, flavor, meta, body.include_usage, body.continuous_usage)
            return SSEResponse(events, on_close=lambda: self._close(stream, endpoint))
        try:
            outputs = await _collect(stream, request)
        except Exception as exc:  # the engine failed this request (counted as "failed" by _close)
            return error_response(500, f"request failed: {type(exc).__name__}: {exc}")
        finally:
            self._close(stream, endpoint)
        if outputs is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if (failure := failure_of(outputs)) is not None:
            return error_response(500, f"request failed: {failure}")
        return _json(flavor.response(meta, outputs, usage_of(outputs)))

    def _close(self, stream: RequestStream, endpoint: str) -> None:
        """Release the stream (aborting unfinished requests) and count the outcome, once."""
        if not self.async_engine.release(stream):
            return
        outputs = stream.outputs
        if stream.error is not None or failure_of(outputs):
            outcome = "failed"
        elif not stream.finished:
            outcome = "disconnected"
        elif any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
            outcome = "aborted"  # cut short by a drain
        else:
            outcome = "success"
            for output in outputs:
                self.metrics.observe_finished(output)
        self.metrics.requests.labels(endpoint, outcome).inc()


async def _collect(stream: RequestStream, request: Request) -> list[RequestOutput] | None:
    """The final snapshots, or None if the client disconnected first."""

    async def last() -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        async for snapshot in stream:
            outputs = snapshot
        return outputs

    async def disconnected() -> None:
        # Once the body has been read, receive() returns only when the client disconnects.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(last())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not result.done():
            result.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await result
    return None if result.cancelled() else result.result()


def _json(model: BaseModel) -> Response:
    # Pydantic writes non-finite floats (a -inf logprob) as null, where json.dumps would fail.
    return Response(model.model_dump_json(), media_type="application/json")


def build_app(
    async_engine: EngineClient,
    api_key: str | None = None,
    served_model_name: str | None = None,
    extra_collectors: Sequence[Collector] = (),
    web_ui: bool = True,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The app over one engine client; extra_collectors add to /metrics (e.g. per-replica series);
    web_ui: the page at / and its live view's feed (web_ui.py)."""
    limits = limits or ServerLimits()
    tokenizer = async_engine.tokenizer
    max_prompt_chars = limits.max_prompt_chars or async_engine.max_model_len * tokenizer.max_token_bytes
    inputs = InputProcessor(tokenizer, RequestLimits(limits, async_engine.max_model_len, max_prompt_chars))
    model_name = served_model_name or async_engine.model_name
    created = int(time.time())
    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM server", version="0.1.0")
    metrics = ServerMetrics(async_engine)
    for collector in extra_collectors:
        metrics.registry.register(collector)

    def count_rejection(path: str, status: int) -> None:
        if path in GENERATION_PATHS:
            metrics.requests.labels(path, f"rejected_{status}").inc()

    install_error_handlers(app, count_rejection)
    app.add_middleware(
        BodyLimit,
        max_bytes=limits.max_request_body_bytes,
        timeout_s=limits.body_timeout_s,
        retained_free_bytes=limits.retained_free_memory_bytes,
        on_reject=count_rejection,
    )
    if api_key:  # added last, so it runs first: an unauthorized body is never read
        app.add_middleware(BearerAuth, api_key=api_key, on_reject=count_rejection)
    generate = _Generator(async_engine, metrics, model_name, inputs)
    completions = CompletionsFlavor(tokenizer)
    chat = ChatFlavor(tokenizer, async_engine.max_sequence_len, limits.allow_special_tokens_in_messages)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body, completions, "cmpl")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body, chat, "chatcmpl")

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        card = ModelCard(
            id=model_name,
            created=created,
            max_model_len=async_engine.max_model_len,
            quantization=async_engine.quantization,
        )
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.error is not None:
            return JSONResponse({"status": "error", "error": async_engine.error}, status_code=503)
        if async_engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.engine_events = install_web_ui(app, async_engine, model_name) if web_ui else None
    return app
