"""The ingress side of the Ray deployment: an `EngineClient` (engine_client.py) that routes each request
to one engine replica (routing.py) and relays its snapshots into an ordinary `RequestStream`, so the
OpenAI app (openai_api.py) serves it exactly as it serves the in-process engine.

Failure handling. A replica call that fails (actor died, engine loop dead, replica draining) marks the
replica down until a health probe gets an answer again (Serve meanwhile replaces the actor), and the
router skips it: its keys move to the next replicas on the ring. A request whose replica fails before
the ingress has seen any token of it is sent once more, to another replica; nothing was streamed, so the
client cannot tell. After a token has been seen the request fails with an error naming the replica
(HTTP 500, or an SSE error event): replaying it could repeat or change text the client already has.

Invariant: `ReplicaState.in_flight` counts the calls of this ingress that are open on that replica;
each call adds one when it is routed and removes it exactly once when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.async_engine import request_ids_of
from kvserve.server.engine_client import EngineUnavailableError, RequestStream
from kvserve.server.ray_replica import Admission, ReplicaInfo
from kvserve.server.replica_metrics import ReplicaView, aggregate_stats
from kvserve.server.routing import Router, RoutingConfig, routing_key

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the first call and one retry on another replica


@dataclass
class ReplicaState:
    name: str
    handle: DeploymentHandle
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def view(self) -> ReplicaView:
        return ReplicaView(self.healthy, self.in_flight, self.routed, self.stats)


@dataclass
class _Call:
    """One client request as the router sees it, across its attempts."""

    request_id: str
    prompts: Sequence[Prompt]
    params: SamplingParams
    cache_salt: str | None
    key: bytes
    tried: list[str] = field(default_factory=list)
    started: bool = False  # a snapshot with a token has arrived: no retry from here on


class ReplicaFailedError(EngineUnavailableError):
    """A replica failed a request after it had started streaming; other replicas still serve."""


class RayEngineClient:
    def __init__(
        self,
        handles: dict[str, DeploymentHandle],
        tokenizer: TokenizerWrapper,
        info: ReplicaInfo,
        routing: RoutingConfig,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 5.0,
    ) -> None:
        self.replicas = {name: ReplicaState(name, handle) for name, handle in handles.items()}
        self._tokenizer = tokenizer
        self.info = info
        self.router = Router(routing, list(handles))
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.draining = False  # Serve drains the ingress itself (graceful_shutdown_timeout_s)
        self.retries = 0
        self._in_flight = 0
        self._pumps: dict[int, asyncio.Task[None]] = {}  # id(stream) -> the task relaying it
        self._prober: asyncio.Task[None] | None = None

    # ---- EngineClient: model facts and health ----
    @property
    def tokenizer(self) -> TokenizerWrapper:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def quantization(self) -> str:
        return self.info.quantization

    @property
    def max_sequence_len(self) -> int:
        return self.info.max_sequence_len

    @property
    def error(self) -> str | None:
        if any(r.healthy for r in self.replicas.values()):
            return None
        return "no engine replica is healthy"

    def set_routing(self, routing: RoutingConfig) -> None:
        self.router = Router(routing, list(self.replicas))

    def start(self) -> None:
        """Start the health probes on the running event loop (the one requests arrive on)."""
        self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    def stats(self) -> dict[str, Any]:
        total = aggregate_stats([r.stats for r in self.replicas.values()])
        healthy = sum(r.healthy for r in self.replicas.values())
        return {
            **total,
            "in_flight_streams": self._in_flight,
            "replicas_healthy": healthy,
            "router_retries": self.retries,
        }

    def replica_views(self) -> dict[str, ReplicaView]:
        return {name: state.view() for name, state in self.replicas.items()}

    # ---- EngineClient: requests ----
    async def submit(
        self,
        request_id: str,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        # arrival_time is not forwarded: it is on this process's clock; the replica stamps its own.
        first = prompts[0] if prompts else []
        token_ids = self._tokenizer.encode(first, add_special_tokens=True) if isinstance(first, str) else list(first)
        key = routing_key(token_ids, cache_salt, self.info.block_size, self.router.config.prefix_blocks)
        call = _Call(request_id, prompts, params, cache_salt, key)
        replica, responses = await self._open(call)
        stream = RequestStream(asyncio.get_running_loop(), request_ids_of(request_id, len(prompts)))
        self._in_flight += 1
        self._pumps[id(stream)] = asyncio.ensure_future(self._relay(call, replica, responses, stream))
        return stream

    def release(self, stream: RequestStream) -> bool:
        if stream.released:
            return False
        stream.released = True
        self._in_flight -= 1
        pump = self._pumps.pop(id(stream), None)
        if pump is not None and not pump.done():
            pump.cancel()  # cancels the replica call, whose engine then aborts the requests
        return True

    async def _open(self, call: _Call) -> tuple[ReplicaState, DeploymentResponseGenerator]:
        """Route the call and wait for its admission. A replica failure moves the call to another replica
        while attempts remain; a refusal of the request itself (400, 429) is raised as it is."""
        while True:
            replica = self._route(call)
            responses = replica.handle.options(stream=True).generate.remote(
                call.request_id, call.prompts, call.params, call.cache_salt
            )
            try:
                admission: Admission = await responses.__anext__()
            except Exception as exc:  # a Ray error: the actor died, or generate itself failed
                self._end(replica, responses, cancel=True)
                self._fail_over(call, replica, exc)
                continue
            except asyncio.CancelledError:
                self._end(replica, responses, cancel=True)
                raise
            if admission.refusal is None:
                return replica, responses
            self._end(replica, responses, cancel=True)
            if admission.refusal != "unavailable":
                admission.raise_if_refused()
            self._fail_over(call, replica, EngineUnavailableError(admission.message))  # draining or broken

    async def _relay(
        self, call: _Call, replica: ReplicaState, responses: DeploymentResponseGenerator, stream: RequestStream
    ) -> None:
        """Copy the replica's snapshots into the stream until the request finishes; on a replica failure,
        retry on another replica if no token has been seen, else fail the stream with a clear error."""
        try:
            while True:
                done = False
                try:
                    await self._forward(call, responses, stream)
                    done = True
                    return
                except Exception as exc:
                    failure = exc
                finally:
                    self._end(replica, responses, cancel=not done)
                if call.started:
                    self._fail_replica(replica, failure)
                    raise ReplicaFailedError(
                        f"engine replica {replica.name} failed after the response had started: {_brief(failure)}"
                    ) from failure
                self._fail_over(call, replica, failure)
                replica, responses = await self._open(call)
        except Exception as exc:
            stream.put_threadsafe(exc)

    @staticmethod
    async def _forward(call: _Call, responses: DeploymentResponseGenerator, stream: RequestStream) -> None:
        last: list[RequestOutput] = []
        async for snapshot in responses:
            call.started = call.started or any(c.token_ids for output in snapshot for c in output.outputs)
            for output in snapshot:
                stream.put_threadsafe(output)
            last = snapshot
        if len(last) < len(stream.request_ids) or not all(output.finished for output in last):
            raise RuntimeError("the replica ended the stream before the request finished")

    # ---- routing and replica health ----
    def _route(self, call: _Call) -> ReplicaState:
        loads = {name: r.in_flight for name, r in self.replicas.items() if r.healthy and name not in call.tried}
        if not loads:
            raise EngineUnavailableError("no healthy engine replica is left to take the request")
        replica = self.replicas[self.router.choose(call.key, loads)]
        call.tried.append(replica.name)
        replica.in_flight += 1
        replica.routed += 1
        return replica

    @staticmethod
    def _end(replica: ReplicaState, responses: DeploymentResponseGenerator, cancel: bool) -> None:
        replica.in_flight -= 1
        if cancel:
            responses.cancel()  # best effort; the replica's generator then aborts its engine requests

    def _fail_over(self, call: _Call, replica: ReplicaState, failure: BaseException) -> None:
        """Mark the replica down and allow another attempt, or raise when the call has used its attempts."""
        self._fail_replica(replica, failure)
        if len(call.tried) >= MAX_ATTEMPTS or not any(
            r.healthy and name not in call.tried for name, r in self.replicas.items()
        ):
            raise EngineUnavailableError(f"engine replica {replica.name} failed: {_brief(failure)}") from failure
        self.retries += 1
        logger.warning("retrying %s on another replica: %s failed: %s", call.request_id, replica.name, _brief(failure))

    def _fail_replica(self, replica: ReplicaState, failure: BaseException) -> None:
        if replica.healthy:
            logger.warning("engine replica %s marked down until it answers a probe: %s", replica.name, _brief(failure))
        replica.healthy = False

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(replica) for replica in self.replicas.values()))
            await asyncio.sleep(self.probe_interval_s)

    async def _probe(self, replica: ReplicaState) -> None:
        try:
            replica.stats = await asyncio.wait_for(_awaited(replica.handle.stats.remote()), self.probe_timeout_s)
        except Exception as exc:  # dead, restarting (Serve holds the call until a replica exists) or failed
            self._fail_replica(replica, exc)
            return
        if not replica.healthy:
            logger.info("engine replica %s answers again", replica.name)
        replica.healthy = True

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober


def _brief(exc: BaseException) -> str:
    """The first line: Ray's errors go on with actor ids, pids and addresses that mean nothing to a client."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


async def first_answer(calls: Iterable[Awaitable[Any]]) -> Any:
    """The result of whichever call succeeds first (e.g. the model facts, which every replica shares)."""
    errors = []
    for next_answer in asyncio.as_completed([_awaited(call) for call in calls]):
        try:
            return await next_answer
        except Exception as exc:
            errors.append(_brief(exc))
    raise RuntimeError(f"no engine replica answered: {errors}")


async def _awaited(response: Awaitable[Any]) -> Any:
    # Serve's responses are awaitable but not coroutines, which asyncio.wait_for / as_completed want.
    return await response
