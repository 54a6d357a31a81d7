"""Replay a workload against any OpenAI-compatible server (kvserve, vLLM, llama.cpp's server).

Each request is sent at its arrival time (time 0 = the start of the measured run), streamed, and
every output token's arrival at the client is recorded with ``time.perf_counter()``. Arrival is the
*scheduled* time: when ``max_concurrency`` (or a slow client) holds a request back, that wait is part
of its TTFT, as it is for the user; ``sent`` records when it actually left. Warmup requests run
before time 0 with prompts unrelated to the workload (so they cannot warm its prefix cache) and are
excluded from every record.

The client shares the machine's cores with the server it measures, and on a two-core machine every
CPU-millisecond it spends is about a wall-millisecond taken from a lockstep engine, so it is kept
light: aiohttp (its C HTTP parser) on uvloop where installed, the cheapest of the clients measured
(figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from kvserve.bench.records import RequestRecord
from kvserve.bench.sse import StreamCounter, parse_sse_line
from kvserve.bench.workload import WorkloadRequest, input_len_of, token_ids_for

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# How long an idle pooled connection is kept for reuse: below the servers' own idle timeout (uvicorn's
# default 5 s, which kvserve and vLLM serve with), so the client never sends a request on a connection the
# server is closing at that moment (a "Connection reset by peer" that no server load caused). aiohttp's
# default is 15 s.
IDLE_CONNECTION_S = 2.0


@dataclass(frozen=True)
class ReplayConfig:
    base_url: str
    model: str = "smollm2-135m-instruct"
    endpoint: str = "completions"
    max_concurrency: int | None = None
    warmup: int = 0
    temperature: float = 0.0
    # True/False forces ignore_eos on every request; None keeps each request's own setting.
    ignore_eos: bool | None = None
    seed: int = 0  # for the token ids of ``input_len`` requests
    timeout_s: float = 600.0
    quiet: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


def payload_for(req: WorkloadRequest, cfg: ReplayConfig) -> dict[str, Any]:
    """The request body: streaming with cumulative usage on every chunk (token counting)."""
    prompt = req.prompt if req.prompt is not None else token_ids_for(req, cfg.seed)
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": req.ignore_eos if cfg.ignore_eos is None else cfg.ignore_eos,
    }
    if cfg.endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError(f"request {req.id!r}: the chat endpoint needs a text prompt")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    return {**body, **cfg.extra_body}


async def _stream_one(
    client: aiohttp.ClientSession, cfg: ReplayConfig, body: dict[str, Any], t0: float
) -> StreamCounter:
    """POST one request and feed every event to a counter; times are relative to ``t0``."""
    counter = StreamCounter(chat=cfg.endpoint == "chat")
    try:
        async with client.post(cfg.url, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode(errors="replace")[:300]
                counter.error = f"HTTP {resp.status}: {detail}"
                return counter
            async for line in resp.content:  # one line at a time, b"\n" included
                now = time.perf_counter() - t0
                event = parse_sse_line(line.decode())
                if event is not None:
                    counter.feed(event, now)
        if counter.error is None and not counter.finished:
            counter.error = "stream ended without a finish reason or [DONE]"
    # ValueError: a malformed JSON event (or a line longer than aiohttp's read limit).
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        counter.error = f"{type(exc).__name__}: {exc}"
    return counter


async def _replay_one(
    client: aiohttp.ClientSession,
    cfg: ReplayConfig,
    req: WorkloadRequest,
    body: dict[str, Any],
    t0: float,
    slots: asyncio.Semaphore,
) -> RequestRecord:
    arrival = req.arrival_ms / 1000
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    async with slots:
        sent = time.perf_counter() - t0
        counter = await _stream_one(client, cfg, body, t0)
    return RequestRecord(
        id=req.id,
        arrival=arrival,
        token_times=counter.token_times,
        max_tokens=req.max_tokens,
        input_len=counter.prompt_tokens if counter.prompt_tokens is not None else input_len_of(req),
        sent=sent,
        text=counter.text,
        finish_reason=counter.finish_reason,
        error=counter.error,
        tenant=req.tenant,
        cached_tokens=counter.cached_tokens,
        accept=req.accept,
        count_source=counter.count_source,
    )


async def _warmup(client: aiohttp.ClientSession, cfg: ReplayConfig) -> int:
    """Send ``cfg.warmup`` short requests one by one; return how many failed."""
    failed = 0
    for i in range(cfg.warmup):
        req = WorkloadRequest(id=f"warmup{i}", arrival_ms=0, prompt=f"Warmup {i}: say hello.", max_tokens=8)
        counter = await _stream_one(client, cfg, payload_for(req, cfg), time.perf_counter())
        failed += counter.error is not None
    return failed


async def replay_async(
    requests: list[WorkloadRequest], cfg: ReplayConfig
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Replay ``requests``; returns records (in workload order) and the run's meta description."""
    # Bodies are built before anything is sent: a request the endpoint cannot take fails the run
    # at once, and no request pays for building its body (e.g. random ids) at its arrival time.
    bodies = [payload_for(r, cfg) for r in requests]
    # No total limit (a long stream is fine) but at most timeout_s of silence; no cap on connections.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        warmup_failed = await _warmup(client, cfg)
        slots = asyncio.Semaphore(cfg.max_concurrency or max(1, len(requests)))
        t0 = time.perf_counter()
        with tqdm(total=len(requests), disable=cfg.quiet, unit="req", desc="replay") as bar:

            async def tracked(req: WorkloadRequest, body: dict[str, Any]) -> RequestRecord:
                record = await _replay_one(client, cfg, req, body, t0, slots)
                bar.update(1)
                return record

            records = await asyncio.gather(*(tracked(r, b) for r, b in zip(requests, bodies, strict=True)))
    meta = {
        "source": "http replay",
        "url": cfg.url,
        "model": cfg.model,
        "max_concurrency": cfg.max_concurrency or "unlimited",
        "warmup": f"{cfg.warmup} requests before time 0 ({warmup_failed} failed), excluded from every number",
        "temperature": cfg.temperature,
        "ttft_origin": "scheduled arrival (client-side waiting under max_concurrency counts)",
        "token_counting": "server usage deltas, else logprobs entries, else 1 per non-empty chunk",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return list(records), meta


def replay(requests: list[WorkloadRequest], cfg: ReplayConfig) -> tuple[list[RequestRecord], dict[str, Any]]:
    with asyncio.Runner(loop_factory=_fastest_event_loop()) as runner:
        return runner.run(replay_async(requests, cfg))


def _fastest_event_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where installed (uvicorn[standard] brings it), else asyncio's (None)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
