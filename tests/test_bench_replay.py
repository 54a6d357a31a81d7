"""The HTTP replay client against an in-test fake SSE endpoint (parsing and scheduling only; the
end-to-end run against a live kvserve server lives with the server's tests)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web

from kvserve.bench.metrics import summarize
from kvserve.bench.replay import ReplayConfig, payload_for, replay, replay_async
from kvserve.bench.sse import DONE, StreamCounter, parse_sse_line
from kvserve.bench.workload import WorkloadRequest

STEP_S = 0.005  # the fake server's time between chunks


def _chunk(style: str, chat: bool, texts: list[str], done_tokens: int, finish: str | None) -> dict:
    text = "".join(texts)
    choice: dict = {"index": 0, "finish_reason": finish}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    if style == "logprobs":
        key = "content" if chat else "tokens"
        choice["logprobs"] = {key: [{"token": t} for t in texts] if chat else texts}
    body: dict = {"choices": [choice]}
    if style == "vllm":
        body["usage"] = {"prompt_tokens": 4, "completion_tokens": done_tokens}
    return body


def fake_server(
    style: str, calls: list[dict], tokens_per_chunk: int = 1, fail: set[str] = frozenset()
) -> web.Application:
    """An OpenAI-style streaming endpoint. Styles: "vllm" (cumulative usage on every chunk and a
    final usage-only chunk), "llamacpp" (usage only on a last chunk that still has a choice with
    empty text), "plain" (no usage at all), "logprobs" (per-chunk logprobs, no usage)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        calls.append(body)
        chat = request.path.endswith("/chat/completions")
        if body.get("max_tokens") in fail or str(body.get("prompt")) in fail:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def send(event: dict | str) -> None:
            await resp.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())

        n = body["max_tokens"]
        for start in range(0, n, tokens_per_chunk):
            await asyncio.sleep(STEP_S)
            texts = [f"t{i} " for i in range(start, min(n, start + tokens_per_chunk))]
            done = start + len(texts)
            finish = "length" if done == n and style != "llamacpp" else None
            await send(_chunk(style, chat, texts, done, finish))
        usage = {"prompt_tokens": 4, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 2}}
        if style == "vllm":
            await send({"choices": [], "usage": usage})
        if style == "llamacpp":
            await send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage})
        await send(DONE)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    return app


BOOK = [
    WorkloadRequest("A", 0, 3, input_ids=[10, 11, 12, 13]),
    WorkloadRequest("B", 20, 2, input_ids=[10, 11, 12, 14]),
    WorkloadRequest("C", 40, 1, input_ids=[20, 21]),
]


def run(requests, style="vllm", endpoint="completions", **kw):
    """Replay `requests` against a fake server on a free local port, in the replay's own event loop."""
    calls: list[dict] = []
    app = fake_server(style, calls, kw.pop("tokens_per_chunk", 1), kw.pop("fail", frozenset()))

    async def serve_and_replay():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            cfg = ReplayConfig(f"http://127.0.0.1:{port}", endpoint=endpoint, quiet=True, **kw)
            return await replay_async(requests, cfg)
        finally:
            await runner.cleanup()

    records, meta = asyncio.run(serve_and_replay())
    return records, meta, calls


@pytest.mark.parametrize(
    "style, source", [("vllm", "usage"), ("llamacpp", "chunks"), ("plain", "chunks"), ("logprobs", "logprobs")]
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_token_is_counted_whatever_the_server_reports(style: str, source: str, endpoint: str) -> None:
    requests = [WorkloadRequest("a", 0, 5, prompt="hello"), WorkloadRequest("b", 10, 1, prompt="hi")]
    records, _, _ = run(requests, style, endpoint)
    a, b = records
    assert (a.output_len, b.output_len) == (5, 1)
    assert a.text == "t0 t1 t2 t3 t4 " and a.finish_reason == "length" and a.error is None
    assert a.count_source == source
    assert a.token_times == sorted(a.token_times) and a.token_times[0] > a.arrival
    if style in ("vllm", "llamacpp"):
        assert (a.input_len, a.cached_tokens) == (4, 2)


def test_usage_deltas_give_every_token_of_a_multi_token_chunk_its_chunk_time() -> None:
    (record,), _, _ = run([WorkloadRequest("a", 0, 6, prompt="x")], tokens_per_chunk=3)
    assert record.output_len == 6
    assert record.token_times[0] == record.token_times[2] < record.token_times[3] == record.token_times[5]
    s = summarize([record])
    assert len(s["itls"][0]) == 1  # two emissions, one gap


def test_llamacpp_final_usage_reconciles_chunks_counted_one_each() -> None:
    counter = StreamCounter(chat=False)
    counter.feed({"choices": [{"text": "ab"}]}, 0.1)  # a chunk that really held two tokens
    counter.feed({"choices": [{"text": "c"}]}, 0.2)
    counter.feed({"choices": [{"text": "", "finish_reason": "stop"}], "usage": {"completion_tokens": 4}}, 0.3)
    counter.feed(DONE, 0.3)
    assert counter.token_times == [0.1, 0.2, 0.3, 0.3]
    assert (counter.count_source, counter.finished, counter.text) == ("chunks+usage", True, "abc")


def test_sse_lines() -> None:
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    counter = StreamCounter(chat=False)
    counter.feed({"error": {"message": "boom"}}, 0.0)
    assert counter.error == "boom"


def test_requests_are_sent_at_their_arrival_times() -> None:
    records, _, calls = run(BOOK)
    assert [r.id for r in records] == ["A", "B", "C"]
    for r, req in zip(records, BOOK, strict=True):
        assert r.arrival == req.arrival_ms / 1000
        assert r.sent >= r.arrival - 1e-3
        assert r.output_len == req.max_tokens and r.input_len == 4
    assert [c["prompt"] for c in calls] == [r.input_ids for r in BOOK]


def test_max_concurrency_one_queues_at_the_client_and_ttft_counts_the_wait() -> None:
    requests = [WorkloadRequest("a", 0, 4, prompt="x"), WorkloadRequest("b", 0, 4, prompt="y")]
    (a, b), meta, _ = run(requests, max_concurrency=1)
    assert b.sent >= a.token_times[-1]
    assert b.token_times[0] - b.arrival > b.token_times[0] - b.sent  # TTFT from arrival includes the queue
    assert meta["max_concurrency"] == 1


def test_errors_are_recorded_per_request_and_others_continue() -> None:
    requests = [WorkloadRequest("ok", 0, 2, prompt="x"), WorkloadRequest("bad", 0, 3, prompt="boom")]
    records, _, _ = run(requests, fail={"boom"})
    assert records[0].ok and not records[1].ok
    assert records[1].error.startswith("HTTP 503")
    s = summarize(records)
    assert (s["completed"], s["failed"]) == (1, 1)


def test_warmup_requests_are_sent_first_and_excluded() -> None:
    records, meta, calls = run(BOOK, warmup=2)
    assert len(calls) == 5 and [c["prompt"] for c in calls[:2]] == ["Warmup 0: say hello.", "Warmup 1: say hello."]
    assert [r.id for r in records] == ["A", "B", "C"]
    assert "excluded" in meta["warmup"] and meta["warmup"].startswith("2 requests")


def test_payloads() -> None:
    cfg = ReplayConfig("http://x/", model="m", seed=5, extra_body={"top_k": 1})
    body = payload_for(WorkloadRequest("a", 0, 8, input_len=6, cache_salt="tenant1", ignore_eos=True), cfg)
    assert len(body["prompt"]) == 6 and all(isinstance(t, int) for t in body["prompt"])
    assert body["stream"] and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (body["cache_salt"], body["ignore_eos"], body["model"], body["top_k"]) == ("tenant1", True, "m", 1)
    assert payload_for(WorkloadRequest("b", 0, 8, prompt="x"), ReplayConfig("u", ignore_eos=True))["ignore_eos"]
    chat = ReplayConfig("http://x", endpoint="chat")
    assert payload_for(WorkloadRequest("c", 0, 1, prompt="hi"), chat)["messages"] == [{"role": "user", "content": "hi"}]
    assert chat.url == "http://x/v1/chat/completions"
    with pytest.raises(ValueError, match="text prompt"):
        payload_for(WorkloadRequest("d", 0, 1, input_ids=[1, 2]), chat)


def test_a_server_that_is_not_there_fails_each_request_with_its_reason() -> None:
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    records, _ = replay(BOOK, ReplayConfig(f"http://127.0.0.1:{port}", quiet=True))
    assert [r.ok for r in records] == [False, False, False]
    assert all(r.error.startswith("ClientConnectorError") for r in records)
    assert summarize(records)["failed"] == 3
