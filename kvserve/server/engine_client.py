"""What the HTTP front end needs from an engine: the in-process `AsyncEngine`, or the Ray router that
forwards each request to one of several engine replicas (`ray_client.RayEngineClient`).

Contract of `submit`: admit all prompts or none, raising ValueError (bad input), QueueFullError or
EngineUnavailableError before any output exists; afterwards the returned stream yields cumulative
snapshots until every request has finished, or raises once. `release` is called exactly once per
admitted stream (idempotent, returns False on repeats) and aborts whatever has not finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper


class EngineUnavailableError(RuntimeError):
    """The server is draining or its engine loop has died; the request was not admitted."""


class RequestStream:
    """The outputs of the requests submitted together (a batch of prompts), on the submitter's loop.

    Iterating yields the latest snapshot of every request, in submission order, each time at least one
    of them changed; snapshots that arrive faster than the consumer reads are coalesced (they are
    cumulative, so nothing is lost). Iteration ends when all of them have finished.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, request_ids: list[str]) -> None:
        self.loop = loop
        self.request_ids = request_ids
        self._latest: dict[str, RequestOutput] = {}
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.error: BaseException | None = None  # what iteration raised, if it did
        self.released = False

    @property
    def finished(self) -> bool:
        return len(self._latest) == len(self.request_ids) and all(o.finished for o in self._latest.values())

    @property
    def outputs(self) -> list[RequestOutput]:
        """The latest snapshot of each request that has produced one, in submission order."""
        return [self._latest[i] for i in self.request_ids if i in self._latest]

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        deliver_threadsafe(self.loop, [(self, item)])

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """On the stream's own loop only."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self.finished:
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                self.error = item
                raise item
            self._latest[item.request_id] = item
        return self.outputs


def deliver_threadsafe(
    loop: asyncio.AbstractEventLoop, items: Sequence[tuple[RequestStream, RequestOutput | BaseException]]
) -> None:
    """Hand items to streams living on `loop` with one wake-up of that loop, however many there are
    (one call_soon_threadsafe per output woke the loop once per request per step)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the loop is closed: the server that asked is gone, nobody is left to read
        pass


def _put_all(items: Sequence[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


class EngineClient(Protocol):
    # draining: shutting down.
    draining: bool

    @property
    def error(self) -> str | None:
        """Why nothing can be admitted now (None while healthy)."""
        ...

    # Read-only facts of the served model, used for request validation and response shaping.
    @property
    def tokenizer(self) -> TokenizerWrapper: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_sequence_len(self) -> int:
        """The most tokens (prompt + output) one sequence can hold: the context and the KV pool allow."""

    # Which weight matrices run from GGUF blocks ("Q4_1 x 120, Q8_0 x 1"), or "none".
    @property
    def quantization(self) -> str: ...

    async def submit(
        self,
        request_id: str,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream: ...

    def release(self, stream: RequestStream) -> bool: ...

    def stats(self) -> dict[str, Any]: ...
