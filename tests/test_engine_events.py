"""`GET /v1/engine/events` and the page's routes (kvserve/server/engine_events.py, web_ui.py) on the real
app and server, over an engine stand-in whose step ring the tests fill: the feed's bounds (rate, steps
per event, subscribers), the API key, `--no-web-ui`, and that clients which leave leave nothing behind.
What the records hold on the real model is tested in test_step_trace.py, the page in test_web_ui.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.cli import build_parser
from kvserve.engine.step_trace import FinishedRequest, SeqWork, StepRecord
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.engine_events import EngineEvents, short_id
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread, StandInEngine

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


def record(index: int, finished: tuple[FinishedRequest, ...] = ()) -> StepRecord:
    seqs = (SeqWork("chatcmpl-0123456789abcdef", 0, 0, 3, 2), SeqWork("cmpl-fedcba9876543210-1", 0, 7, 0, 0))
    return StepRecord(index, time.time(), 0.0125, seqs, 10, 5, 2, 95, 1, 40, 16, 6, 4, finished)


class Served:
    def __init__(self, app: FastAPI, server: ServerThread, engine: StandInEngine) -> None:
        self.app, self.url, self.engine = app, server.base_url, engine
        self.events: EngineEvents = app.state.engine_events
        self.loop: asyncio.AbstractEventLoop | None = None

    def num_tasks(self) -> int:
        async def count() -> int:
            return len(asyncio.all_tasks())

        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(count(), self.loop).result(5)


@pytest.fixture
def served() -> Iterator[Served]:
    engine = StandInEngine()
    app = build_app(AsyncEngine(engine), api_key=KEY)
    loops: list[asyncio.AbstractEventLoop] = []

    @app.get("/test-loop", include_in_schema=False)
    async def remember_loop() -> dict[str, bool]:
        loops.append(asyncio.get_running_loop())
        return {"ok": True}

    with ServerThread(app) as server:
        running = Served(app, server, engine)
        httpx.get(f"{server.base_url}/test-loop", headers=AUTH).raise_for_status()
        running.loop = loops[0]
        yield running


def events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """(event name, parsed data) of an SSE response; ("comment", text) for comment lines."""
    name = "message"
    for line in response.iter_lines():
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = "message"


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_events_need_the_key_the_page_is_open_and_holds_no_data(served: Served) -> None:
    for path in ("/", "/web/app.js", "/web/style.css"):
        page = httpx.get(served.url + path)
        assert page.status_code == 200 and "stand-in-model" not in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        denied = httpx.get(f"{served.url}/v1/engine/events", headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    served.engine.step_trace.append(record(1, (FinishedRequest("chatcmpl-0123456789abcdef", 0.25, 0.0125),)))
    with httpx.stream("GET", f"{served.url}/v1/engine/events", headers=AUTH, timeout=10) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        stream = events(response)
        name, hello = next(stream)
        assert name == "hello" and hello["model"] == "stand-in-model" and hello["kv_blocks_total"] == 100
        name, payload = next(stream)
    assert name == "steps" and payload["dropped"] == 0
    stats = {"num_running": 1, "num_waiting": 2, "kv_blocks_total": 100, "steps": 0, "in_flight_streams": 0}
    assert payload["stats"] == stats, "the engine's gauges, nothing else of stats()"
    (step,) = payload["steps"]
    assert step["i"] == 1 and step["n"] == 10 and step["d"] == 12.5 and step["w"] == 1
    assert step["s"] == [["01234567", 0, 0, 3, 2], ["fedcba98-1", 0, 7, 0, 0]]
    assert step["kv"] == [5, 2, 95] and step["pc"] == [40, 16] and step["sp"] == [6, 4]
    assert step["f"] == [["01234567", 250.0, 12.5]]


def test_short_ids_match_the_page() -> None:
    assert short_id("chatcmpl-0123456789abcdef") == "01234567"
    assert short_id("cmpl-0123456789abcdef-12") == "01234567-12"
    assert short_id("offline") == "offline"


def test_no_web_ui_means_no_page_no_feed_no_recording() -> None:
    engine = StandInEngine()
    app = build_app(AsyncEngine(engine), web_ui=False)
    with ServerThread(app) as server:
        for path in ("/", "/web/app.js", "/v1/engine/events"):
            assert httpx.get(server.base_url + path).status_code == 404
    assert engine.step_trace is None and app.state.engine_events is None


def steps_events_until(stream: Iterator[tuple[str, Any]], last_step: int) -> list[dict[str, Any]]:
    """The "steps" events' payloads read from `stream` until one carries step `last_step`."""
    received = []
    for name, payload in stream:
        if name == "steps":
            received.append(payload)
            if payload["steps"][-1]["i"] == last_step:
                break
    return received


def test_rate_and_size_are_bounded_and_every_step_is_sent_or_counted(served: Served) -> None:
    feed = served.events
    feed.interval_s, feed.max_steps_per_event = 0.2, 50
    trace = served.engine.step_trace
    produced = 5000
    stop = threading.Event()

    def engine_thread() -> None:  # much faster than the feed may send
        for i in range(1, produced + 1):
            trace.append(record(i))
            if i % 100 == 0:
                time.sleep(0.05)
        stop.set()

    writer = threading.Thread(target=engine_thread)
    with httpx.stream("GET", f"{served.url}/v1/engine/events", headers=AUTH, timeout=10) as response:
        stream = events(response)
        assert next(stream)[0] == "hello"
        started = time.monotonic()
        writer.start()
        received = steps_events_until(stream, produced)
        elapsed = time.monotonic() - started
    writer.join()
    assert len(received) <= elapsed / feed.interval_s + 2, "at most one event per interval"
    last = 0
    for payload in received:
        indices = [s["i"] for s in payload["steps"]]
        assert 1 <= len(indices) <= 50
        assert indices == list(range(indices[0], indices[-1] + 1))
        assert indices[0] == last + payload["dropped"] + 1, "the steps left out are counted"
        last = indices[-1]
    assert sum(p["dropped"] for p in received) > 0
    assert len(trace.since(0)) == trace.capacity < produced


def test_a_subscriber_may_ask_for_fewer_events_never_more(served: Served) -> None:
    url = f"{served.url}/v1/engine/events"
    assert httpx.get(url, params={"interval_ms": "500"}).status_code == 401, "the key first"
    for asked in ("50", "99.9", "10001", "abc", "nan", "inf", ""):
        refused = httpx.get(url, params={"interval_ms": asked}, headers=AUTH)
        assert refused.status_code == 400, asked
        assert (
            refused.json()["error"]["param"] == "interval_ms"
            and "from 100 to 10000" in refused.json()["error"]["message"]
        )
    assert served.events.subscribers == 0, "a refused request holds no subscription"

    trace = served.engine.step_trace
    produced = 60

    def engine_thread() -> None:  # a step every 20 ms: the default interval would send ~12 events
        for i in range(1, produced + 1):
            trace.append(record(i))
            time.sleep(0.02)

    writer = threading.Thread(target=engine_thread)
    with httpx.stream("GET", url, params={"interval_ms": "400"}, headers=AUTH, timeout=10) as response:
        stream = events(response)
        name, hello = next(stream)
        assert name == "hello" and hello["interval_ms"] == 400
        started = time.monotonic()
        writer.start()
        received = steps_events_until(stream, produced)
        elapsed = time.monotonic() - started
    writer.join()
    assert len(received) <= elapsed / 0.4 + 2, "at most one event per asked interval"
    assert [s["i"] for p in received for s in p["steps"]] == list(range(1, produced + 1)), "no step lost"


def test_subscribers_are_limited(served: Served) -> None:
    served.events.max_subscribers = 2
    with (
        httpx.stream("GET", f"{served.url}/v1/engine/events", headers=AUTH, timeout=10) as first,
        httpx.stream("GET", f"{served.url}/v1/engine/events", headers=AUTH, timeout=10) as second,
    ):
        assert first.status_code == second.status_code == 200
        third = httpx.get(f"{served.url}/v1/engine/events", headers=AUTH)
        assert third.status_code == 429 and "at most 2" in third.json()["error"]["message"]
    wait_until(lambda: served.events.subscribers == 0, 5, "the two streams to close")
    with httpx.stream("GET", f"{served.url}/v1/engine/events", headers=AUTH, timeout=10) as again:
        assert again.status_code == 200


def test_clients_that_leave_leave_nothing_behind(served: Served) -> None:
    feed = served.events
    feed.keepalive_s = 0.1
    served.engine.step_trace.append(record(1))
    baseline = served.num_tasks()

    async def hop(client: httpx.AsyncClient, wait_for: str) -> None:
        async with client.stream("GET", "/v1/engine/events", headers=AUTH) as response:
            async for line in response.aiter_lines():
                if line.startswith(wait_for):
                    return  # leaves mid-stream: the connection is closed under the server

    async def many() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
            for i in range(20):  # one by one, then all at once; leaving after hello, after steps, idle
                await hop(client, ("event: hello", "event: steps", ":")[i % 3])
            await asyncio.gather(*(hop(client, "event: steps") for _ in range(feed.max_subscribers)))

    asyncio.run(many())
    wait_until(lambda: feed.subscribers == 0, 5, "every subscriber to be gone")
    wait_until(lambda: served.num_tasks() <= baseline, 5, "the server's tasks to return to the baseline")


def test_cli_no_web_ui_flag() -> None:
    assert build_parser().parse_args(["serve"]).web_ui is True
    assert build_parser().parse_args(["serve", "--no-web-ui"]).web_ui is False
