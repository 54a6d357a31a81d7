"""`GET /v1/engine/events`: the engine's step trace (kvserve/engine/step_trace.py) as server-sent events,
for the live view of the web page (docs/web-ui.md describes the events).

Bounds, whatever the clients do:
- rate: each subscriber gets at most `max_events_per_s` events a second (it may ask for fewer with
  `?interval_ms=N`, never for more); the steps run in between travel together in one event, at most
  `max_steps_per_event` of them (the newest), the rest counted in `dropped`;
- memory: the engine keeps only the ring's records; a subscriber holds no queue, it reads the ring when it
  is due to send, so a slow reader slows only itself (back-pressure from its socket);
- subscribers: at most `max_subscribers` streams at once, more are answered 429;
- lifetime: a subscriber that disconnects is noticed within one event interval (a task watching for the
  disconnect), and its stream, its watcher and its count are gone with it, however the stream ended.
The endpoint sits behind `--api-key` like the rest of the API (auth.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from kvserve.engine.step_trace import StepRecord, StepTrace
from kvserve.server.errors import APIError
from kvserve.server.streaming import SSEResponse

# Engine stats every event carries (the page's gauges); the rest of stats() stays out of the stream.
STATS_KEYS = (
    "num_running",
    "num_waiting",
    "in_flight_streams",
    "kv_blocks_total",
    "kv_blocks_used",
    "kv_blocks_free",
    "prefix_cache_blocks",
    "prefix_cache_hit_rate",
    "spec_acceptance_rate",
    "steps",
    "generated_tokens",
    "preemptions",
)
# The longest event interval a subscriber may ask for: a feed slower than this looks dead to a viewer.
MAX_INTERVAL_MS = 10_000


def short_id(request_id: str) -> str:
    """A request id as the live view shows it: the first 8 characters after the id's kind
    ("chatcmpl-1a2b3c4d…" -> "1a2b3c4d"), keeping the "-N" of a prompt in a batch of prompts."""
    kind, _, rest = request_id.partition("-")
    if not rest:
        return kind[:12]
    head, _, index = rest.partition("-")
    return head[:8] + (f"-{index}" if index else "")


def step_json(record: StepRecord) -> dict[str, Any]:
    """One step as the page reads it (keys documented in docs/web-ui.md)."""
    return {
        "i": record.step,
        "t": round(record.wall_time * 1000, 1),
        "d": round(record.duration_s * 1000, 3),
        "s": [
            [short_id(s.request_id), s.sample, s.prefill_tokens, s.decode_tokens, s.accepted_drafts]
            for s in record.seqs
        ],
        "n": record.num_tokens,
        "kv": [record.kv_blocks_used, record.kv_blocks_cached, record.kv_blocks_free],
        "w": record.num_waiting,
        "pc": [record.prefix_cache_queries, record.prefix_cache_hits],
        "sp": [record.spec_proposed, record.spec_accepted],
        "f": [[short_id(f.request_id), _ms(f.ttft_s), _ms(f.tpot_s)] for f in record.finished],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class EngineEvents:
    def __init__(
        self,
        trace: StepTrace,
        stats: Callable[[], dict[str, Any]],
        info: dict[str, Any],
        max_events_per_s: float = 10.0,
        max_steps_per_event: int = 256,
        max_subscribers: int = 8,
        keepalive_s: float = 5.0,
    ) -> None:
        if max_events_per_s <= 0 or max_steps_per_event < 1 or max_subscribers < 1:
            raise ValueError("engine events: the rate, steps per event and subscribers must be positive")
        self.trace = trace
        self.stats = stats
        self.info = info  # sent once, first: what the page needs to scale its views
        self.interval_s = 1.0 / max_events_per_s
        self.max_steps_per_event = max_steps_per_event
        self.max_subscribers = max_subscribers
        self.keepalive_s = keepalive_s
        self.subscribers = 0  # changed on the server's event loop only

    def response(self, request: Request) -> SSEResponse:
        interval_s = self._interval_s(request.query_params.get("interval_ms"))
        if self.subscribers >= self.max_subscribers:
            raise APIError(429, f"too many engine event subscribers (at most {self.max_subscribers}); retry later")
        self.subscribers += 1
        return SSEResponse(self._events(request, interval_s), on_close=self._unsubscribe)

    def _interval_s(self, asked_ms: str | None) -> float:
        """The subscriber's event interval: the server's shortest unless it asks for a longer one (a
        viewer that draws twice a second needs no more events than that: fewer, larger events cost
        less to encode, send and parse)."""
        if asked_ms is None:
            return self.interval_s
        shortest_ms = self.interval_s * 1000
        try:
            interval_ms = float(asked_ms)
        except ValueError:
            interval_ms = float("nan")
        if not shortest_ms <= interval_ms <= MAX_INTERVAL_MS:  # NaN fails too
            raise APIError(
                400,
                f"interval_ms must be a number of milliseconds from {shortest_ms:g} to {MAX_INTERVAL_MS}, "
                f"got {asked_ms!r}",
                param="interval_ms",
            )
        return interval_ms / 1000

    def _unsubscribe(self) -> None:
        self.subscribers -= 1

    async def _events(self, request: Request, interval_s: float) -> AsyncIterator[str]:
        """hello, then every `interval_s` the steps since the last event (the newest steps still in the
        ring at first, so the view fills at once); a comment line when idle for keepalive_s."""
        loop = asyncio.get_running_loop()
        disconnected = asyncio.ensure_future(_disconnect(request))
        try:
            yield _event("hello", {**self.info, "interval_ms": interval_s * 1000})
            last_index = 0
            last_sent = loop.time()
            while True:
                records = self.trace.since(last_index)
                if records:
                    dropped = max(len(records) - self.max_steps_per_event, 0)
                    records = records[dropped:]
                    last_index = records[-1].step
                    stats = self.stats()
                    payload = {
                        "steps": [step_json(r) for r in records],
                        "dropped": dropped,
                        "stats": {k: stats[k] for k in STATS_KEYS if k in stats},
                    }
                    yield _event("steps", payload)
                    last_sent = loop.time()
                elif loop.time() - last_sent >= self.keepalive_s:
                    yield ": keepalive\n\n"
                    last_sent = loop.time()
                done, _ = await asyncio.wait({disconnected}, timeout=interval_s)
                if done:
                    return
        finally:
            disconnected.cancel()


async def _disconnect(request: Request) -> None:
    # The request has no body: receive() returns only when the client disconnects.
    while (await request.receive())["type"] != "http.disconnect":
        pass
