"""The engine loop beside asyncio: one thread owns the LLMEngine, every request gets an async stream.

Threading invariants:
- Only the engine thread calls into the LLMEngine. Other threads post commands (add, abort, stop) on a
  queue that the engine thread applies between steps, so an abort frees the request's blocks before the
  next iteration runs.
- The engine thread never touches asyncio objects directly: outputs reach a stream through
  `loop.call_soon_threadsafe` on the loop that created it (several servers may share one engine).
- The thread steps while the engine has work and sleeps on a condition variable otherwise (waking every
  IDLE_WAKE_S, so that signal handlers run on an idle main thread).

`kvserve serve` runs the loop on the process's main thread (`run`) and uvicorn beside it: every short
OpenMP parallel region started from a non-main thread runs several times slower, as if the team's
workers slept between regions (OMP_WAIT_POLICY=passive makes the main thread as slow;
OMP_WAIT_POLICY=active and GOMP_SPINCOUNT do not help the other thread), and a served decode step with
it. Figures: benchmarks/RESULTS.md, "Figures behind the code's rules".
Embedders (tests, Ray replicas) may still `start` a thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.engine.engine import LLMEngine
from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.server.engine_client import EngineUnavailableError, RequestStream, deliver_threadsafe

logger = logging.getLogger(__name__)

# How often an idle engine loop wakes. Python runs signal handlers on the main thread only, when it
# next executes bytecode; the kernel may deliver SIGTERM to any thread (an OpenMP worker, uvloop's), and
# a main thread asleep on the condition variable would then not see it until the next request: a
# `kvserve serve` left idle ignored SIGTERM for minutes. Waking twice a second costs nothing measurable.
IDLE_WAKE_S = 0.5


def request_ids_of(request_id: str, num_prompts: int) -> list[str]:
    """The engine request ids of the prompts submitted together under one id."""
    return [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]


class AsyncEngine:
    """The in-process `EngineClient` (engine_client.py)."""

    def __init__(self, engine: LLMEngine) -> None:
        # Read-only attributes of the engine (tokenizer, max_model_len, model_name) may be used anywhere.
        self.engine = engine
        self._cond = threading.Condition()
        # (command, on_dead): on_dead tells the poster when the loop died before running the command.
        self._commands: list[tuple[Callable[[], None], Callable[[str], None] | None]] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stats: dict[str, Any] = engine.stats()  # replaced (never mutated) after each step
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        # Set when the loop itself died; /health reports it and nothing more is admitted.
        self.error: str | None = None
        self.draining = False
        self.step_failures = 0
        self._in_flight = 0  # streams not yet finished; changed on event loops only
        self._in_flight_lock = threading.Lock()

    # ---- lifecycle ----
    def start(self) -> AsyncEngine:
        """Run the engine loop on a thread of its own."""
        self._thread.start()
        return self

    def run(self) -> None:
        """Run the engine loop on the calling thread until `shutdown` (instead of `start`)."""
        self._run()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever still runs and stop the engine loop (waiting for it if it runs on a thread)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting (503), give in-flight requests up to timeout_s to finish, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_in_flight:
            logger.warning("drain timeout: aborting %d in-flight requests", self.num_in_flight)
            self._post(self._abort_all)
            while self.num_in_flight and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.05)

    # ---- requests (called from event loops) ----
    @property
    def tokenizer(self) -> TokenizerWrapper:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def quantization(self) -> str:
        return self.engine.quantization

    @property
    def max_sequence_len(self) -> int:
        return self.engine.max_sequence_len

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "step_failures": self.step_failures, "in_flight_streams": self._in_flight}

    async def submit(
        self,
        request_id: str,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Admit all prompts or none. Raises ValueError (bad input), QueueFullError or EngineUnavailableError."""
        if self.draining:
            raise EngineUnavailableError("the server is shutting down")
        if self.error is not None:
            raise EngineUnavailableError(f"the engine loop has failed: {self.error}")
        if len(prompts) > (queue := self.engine.config.max_waiting_requests):
            # Not a 429: retrying can never succeed.
            raise ValueError(f"{len(prompts)} prompts can never be admitted: the waiting queue holds {queue}")
        loop = asyncio.get_running_loop()
        ids = request_ids_of(request_id, len(prompts))
        stream = RequestStream(loop, ids)
        admitted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            added: list[str] = []
            try:
                for rid, prompt in zip(ids, prompts, strict=True):
                    self.engine.add_request(rid, prompt, params, arrival_time, cache_salt)
                    added.append(rid)
                    self._streams[rid] = stream
                outcome: BaseException | None = None
            except Exception as exc:  # ValueError / QueueFullError belong to the caller
                for rid in added:
                    self.engine.abort_request(rid)
                    self._streams.pop(rid, None)
                outcome = exc
            loop.call_soon_threadsafe(_settle, admitted, outcome)

        def refuse(error: str) -> None:
            loop.call_soon_threadsafe(_settle, admitted, EngineUnavailableError(f"the engine loop has failed: {error}"))

        self._post(add, refuse)
        try:
            # shield: if the client goes away now, the add still completes and is then aborted.
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            self.abort(ids)
            raise
        with self._in_flight_lock:
            self._in_flight += 1
        return stream

    def release(self, stream: RequestStream) -> bool:
        """The consumer is done with the stream: abort its requests if they have not finished.
        Idempotent; returns False when the stream had been released already."""
        with self._in_flight_lock:
            if stream.released:
                return False
            stream.released = True
            self._in_flight -= 1
        if not stream.finished:
            self.abort(stream.request_ids)
        return True

    def abort(self, request_ids: list[str]) -> None:
        def abort() -> None:
            for rid in request_ids:
                self._finish_stream(rid, self.engine.abort_request(rid))

        self._post(abort)

    # ---- engine thread ----
    def _post(self, command: Callable[[], None], on_dead: Callable[[str], None] | None = None) -> None:
        with self._cond:
            if self.error is not None:
                if on_dead is not None:
                    on_dead(self.error)
                return
            self._commands.append((command, on_dead))
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._cond.wait(IDLE_WAKE_S)
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command, _ in commands:
                    command()
                if commands:
                    # Aborts free blocks between steps: publish that even if no step follows.
                    self._stats = self.engine.stats()
                if stopping:
                    self._abort_all()
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:
            logger.exception("the engine loop died")
            with self._cond:
                self.error = error = f"{type(exc).__name__}: {exc}"
                pending, self._commands = self._commands, []
            for _, on_dead in pending:
                if on_dead is not None:
                    on_dead(error)
            for stream in set(self._streams.values()):
                stream.put_threadsafe(EngineUnavailableError(f"the engine loop has failed: {error}"))
            self._streams.clear()

    def _step(self) -> None:
        steps_before = self._stats["steps"]
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The engine isolates per-request failures itself; an exception here cannot be pinned on one
            # request, so the requests in flight fail (their blocks freed) and the loop carries on.
            logger.exception("engine step failed")
            self.step_failures += 1
            self._fail_all(exc)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            deliver_threadsafe(loop, items)
        self._stats = self.engine.stats()
        if not outputs and self._stats["steps"] == steps_before:
            # Work exists but none could be scheduled: wait for a command rather than spin.
            with self._cond:
                self._cond.wait(0.005)

    def _finish_stream(self, request_id: str, output: RequestOutput | None, error: BaseException | None = None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if error is None and output is not None:
            stream.put_threadsafe(output)
        else:
            stream.put_threadsafe(error or RuntimeError(f"request {request_id} vanished from the engine"))

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self._streams):
            self._finish_stream(rid, self.engine.abort_request(rid), exc)
        self._stats = self.engine.stats()

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self._finish_stream(rid, self.engine.abort_request(rid))
        self._stats = self.engine.stats()


def _settle(future: asyncio.Future[None], outcome: BaseException | None) -> None:
    if future.cancelled():
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)
