"""What both endpoints share: usage counting, choice numbering, and turning engine snapshots into SSE.

An endpoint ("flavor": completions or chat) only says how to build its request and how one response
or one chunk looks; the order of events is defined once, here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.protocol import ErrorDetail, ErrorResponse, PromptTokensDetails, Usage


@dataclass
class ResponseMeta:
    id: str
    created: int
    model: str
    n: int  # samples per prompt; choice index = prompt index * n + sample index
    body: Any = None  # the validated request, for what shapes its responses (echo, tools)
    # Per-choice state a flavor keeps across the chunks of one stream (chat's tool-call parser).
    stream_state: dict[int, Any] = field(default_factory=dict)


@dataclass
class ChoiceDelta:
    """What one choice gained since its previous chunk."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None  # None when logprobs were not requested
    text_offset: int  # characters of this choice sent before `text`
    finish_reason: str | None
    first: bool
    request: RequestOutput  # the prompt's output the choice belongs to (its prompt, for echo)


class Flavor(Protocol):
    def prepare(self, body: Any) -> tuple[list[Prompt], SamplingParams]: ...

    def response(self, meta: ResponseMeta, outputs: list[RequestOutput], usage: Usage) -> BaseModel: ...

    def chunk(self, meta: ResponseMeta, delta: ChoiceDelta, usage: Usage | None) -> BaseModel: ...

    def usage_chunk(self, meta: ResponseMeta, usage: Usage) -> BaseModel: ...


def usage_of(outputs: list[RequestOutput]) -> Usage:
    # The prompt is counted once per prompt, not once per sample, as OpenAI does.
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs)),
    )


def choices_of(outputs: list[RequestOutput], n: int) -> Iterator[tuple[int, CompletionOutput]]:
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            yield prompt_index * n + completion.index, completion


def failure_of(outputs: list[RequestOutput]) -> str | None:
    return next((o.error for o in outputs if o.error), None)


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def error_event(message: str) -> str:
    return sse(ErrorResponse(error=ErrorDetail(message=message, type="server_error")))


async def sse_events(
    snapshots: AsyncIterator[list[RequestOutput]],
    flavor: Flavor,
    meta: ResponseMeta,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    """One chunk per choice that gained visible text, new logprobs or its finish reason; then the usage
    chunk (if asked) and [DONE]. Text is the delta of the engine's `text`, which already holds back any
    partial stop string, so a stop string is never sent. With continuous usage every chunk carries the
    cumulative usage, so a client can count the tokens each chunk brought."""
    sent: dict[int, tuple[int, int, bool]] = {}  # choice index -> (characters, tokens, finish reported)
    outputs: list[RequestOutput] = []
    try:
        async for outputs in snapshots:
            if (failure := failure_of(outputs)) is not None:
                yield error_event(f"request failed: {failure}")
                break
            usage = usage_of(outputs) if continuous_usage else None
            for index, completion in choices_of(outputs, meta.n):
                chars, tokens, reported = sent.get(index, (0, 0, False))
                text = completion.text[chars:]
                new_logprobs = completion.logprobs[tokens:] if completion.logprobs is not None else None
                finish = completion.finish_reason if not reported else None
                if not (text or new_logprobs or finish):
                    continue
                request = outputs[index // meta.n]
                delta = ChoiceDelta(index, text, new_logprobs, chars, finish, index not in sent, request)
                sent[index] = (len(completion.text), len(completion.token_ids), finish is not None or reported)
                yield sse(flavor.chunk(meta, delta, usage))
        else:
            if include_usage or continuous_usage:
                yield sse(flavor.usage_chunk(meta, usage_of(outputs)))
    except Exception as exc:  # the headers are sent: an error can only travel as an event
        yield error_event(f"request failed: {type(exc).__name__}: {exc}")
    yield sse("[DONE]")


class SSEResponse(StreamingResponse):
    """An event stream that runs on_close however it ends: finished, failed, or the client gone —
    also when the client left before the body iterator ever started (its own finally never runs then)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
