"""What the HTTP front end needs from an engine: the in-process `AsyncEngine`, or the Ray router that
forwards each request to one of several engine replicas (`ray_client.RayEngineClient`).

Contract of `submit`: admit all prompts or none, raising ValueError (bad input), QueueFullError or
EngineUnavailableError before any output exists; afterwards the returned stream yields cumulative
snapshots until every request has finished, or raises once. `release` is called exactly once per
admitted stream (idempotent, returns False on repeats) and aborts whatever has not finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.async_engine import Prompt, RequestStream


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
