"""One engine replica as a Ray Serve deployment: an `LLMEngine` with its own KV pool, driven by the
same `AsyncEngine` loop thread as the single server, streaming snapshots back to the ingress.

`generate` is a streaming method: its first item is an `Admission` (the request was queued, or why
not), then come the cumulative `RequestOutput` snapshots until every prompt has finished. Refusals
travel as data rather than as exceptions so the ingress can tell "this request is bad" (answer
400/429) from "this replica is broken" (try another replica).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.input_processor import Prompt, QueueFullError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.engine_client import EngineUnavailableError

REFUSALS: dict[str, type[Exception]] = {
    "invalid": ValueError,
    "queue_full": QueueFullError,
    "unavailable": EngineUnavailableError,
}


@dataclass(frozen=True)
class Admission:
    refusal: str | None = None  # a key of REFUSALS, None when admitted
    message: str = ""

    def raise_if_refused(self) -> None:
        if self.refusal is not None:
            raise REFUSALS[self.refusal](self.message)


@dataclass(frozen=True)
class ReplicaInfo:
    model_name: str
    max_model_len: int
    block_size: int
    max_sequence_len: int
    quantization: str


class EngineReplica:
    """Wrapped by `serve.deployment` in ray_app.py; one Serve replica of its own deployment each."""

    def __init__(self, config: EngineConfig) -> None:
        self.async_engine = AsyncEngine(LLMEngine(config)).start()

    def info(self) -> ReplicaInfo:
        engine = self.async_engine.engine
        return ReplicaInfo(
            engine.model_name,
            engine.max_model_len,
            engine.config.block_size,
            engine.max_sequence_len,
            engine.quantization,
        )

    def stats(self) -> dict[str, Any]:
        return self.async_engine.stats()

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        if self.async_engine.error is not None:
            raise RuntimeError(f"the engine loop has failed: {self.async_engine.error}")

    async def generate(
        self, request_id: str, prompts: Sequence[Prompt], params: SamplingParams, cache_salt: str | None
    ) -> AsyncIterator[Admission | list[RequestOutput]]:
        # Arrival is stamped here, on this process's clock, which every engine timestamp shares.
        try:
            stream = await self.async_engine.submit(request_id, prompts, params, cache_salt)
        except Exception as exc:
            kind = next((key for key, cls in REFUSALS.items() if isinstance(exc, cls)), None)
            if kind is None:
                raise
            yield Admission(kind, str(exc))
            return
        try:
            yield Admission()
            async for snapshot in stream:
                yield snapshot
        finally:
            # Runs also when the ingress cancels the call (its client left): unfinished requests abort.
            self.async_engine.release(stream)

    def __del__(self) -> None:
        self.async_engine.shutdown(timeout_s=2.0)
