"""End-to-end tests of the OpenAI-compatible server: the real bundled model behind a real uvicorn server
on a free port, driven by the official `openai` client (and raw httpx where the client would hide
the HTTP status or the wire format). One server is shared by the whole module."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, EngineConfig, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0, max_tokens=12)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def async_engine() -> Any:
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32"))).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(async_engine: AsyncEngine) -> Any:
    with ServerThread(build_app(async_engine)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def async_client(server: ServerThread) -> openai.AsyncOpenAI:
    # One per asyncio.run: the client's connection pool belongs to the loop that created it.
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(base_url: str, name: str, **labels: str) -> float:
    return scrape(base_url).get((name, frozenset(labels.items())), 0.0)


def post(base_url: str, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{base_url}{path}", content=content, headers={"content-type": "application/json"}, timeout=300)


# ---- correctness against the offline API ----


def test_completion_greedy_equals_offline(client: openai.OpenAI, llm_fp32: LLM) -> None:
    prompt = "The three primary colors are"
    expected = llm_fp32.generate(prompt, GREEDY)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason

    ids = llm_fp32.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == llm_fp32.generate([ids], GREEDY)[0].text


def test_chat_greedy_equals_offline(client: openai.OpenAI, llm_fp32: LLM) -> None:
    expected = llm_fp32.chat(CHAT, GREEDY)[0]
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert content[-1].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_strings_are_never_streamed(client: openai.OpenAI, llm_fp32: LLM) -> None:
    prompt = "Write a sentence about the sea:"
    full = llm_fp32.generate(prompt, GREEDY)[0].text
    start = next(i for i in range(3, len(full) - 4) if full.find(full[i : i + 4]) == i)
    stop = full[start : start + 4]

    def streamed(stops: list[str]) -> tuple[str, str | None]:
        chunks = list(
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stops, stream=True)
        )
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    assert streamed([stop]) == (full[:start], "stop")
    # A stop string whose prefix appears but which never completes: the held-back text is released.
    assert streamed([stop[:3] + "\u2603"]) == (full, "length")


def test_parallel_samples_logprobs_and_cached_tokens(client: openai.OpenAI, server: ServerThread) -> None:
    sampled = client.completions.create(
        model=MODEL, prompt="My favourite animal is", max_tokens=6, n=3, temperature=0.9, seed=7
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    again = client.completions.create(
        model=MODEL, prompt="My favourite animal is", max_tokens=6, n=3, temperature=0.9, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded: reproducible

    with_logprobs = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = with_logprobs.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == with_logprobs.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)

    # Two full blocks of a repeated prompt come from the prefix cache, but never across a cache_salt.
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 8
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    hit = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert hit.usage.prompt_tokens_details.cached_tokens >= 32
    salted = client.completions.create(
        model=MODEL, prompt=long_prompt, max_tokens=1, extra_body={"cache_salt": "tenant-b"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_parallel_samples_and_batch_prompts(server: ServerThread) -> None:
    body = {"prompt": ["One", "Two"], "max_tokens": 3, "n": 2, "temperature": 0, "stream": True}
    response = post(server.base_url, "/v1/completions", body)
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finished = {
        json.loads(e)["choices"][0]["index"] for e in events[:-1] if json.loads(e)["choices"][0]["finish_reason"]
    }
    assert finished == {0, 1, 2, 3}  # choice index = prompt index * n + sample index


def test_models_and_health(client: openai.OpenAI, server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


# ---- load and faults ----


def test_32_concurrent_streams_share_iterations(server: ServerThread, llm_fp32: LLM) -> None:
    prompts = [f"Fact number {i} about the moon:" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.text for o in llm_fp32.generate(prompts, params)]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
        text, tokens = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            tokens = chunk.usage.completion_tokens
        return text, tokens

    async def run() -> list[tuple[str, int]]:
        async with async_client(server) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    before = scrape(server.base_url)
    start = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    after = scrape(server.base_url)
    assert [text for text, _ in results] == expected
    assert all(tokens == 8 for _, tokens in results)
    steps = after[("kvserve_iterations_total", frozenset())] - before[("kvserve_iterations_total", frozenset())]
    generated = sum(tokens for _, tokens in results)
    # Shared iterations: far fewer forward passes than one per generated token.
    assert generated / steps > 4, (generated, steps)
    assert after[("kvserve_batch_size_max", frozenset())] > 1
    print(
        f"\n32 streams: {wall:.2f} s wall, {generated / wall:.1f} tok/s, {steps:.0f} iterations, "
        f"max batch {after[('kvserve_batch_size_max', frozenset())]:.0f}"
    )


def test_disconnects_free_blocks_and_leave_others_unchanged(server: ServerThread, llm_fp32: LLM) -> None:
    others = [f"Tip {i} for learning to cook:" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.text for o in llm_fp32.generate(others, params)]
    disconnected_before = metric(
        server.base_url, "kvserve_http_requests_total", endpoint="/v1/completions", outcome="disconnected"
    )

    async def quitter(aclient: openai.AsyncOpenAI, i: int) -> None:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=f"A very long story, part {i}:",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            break  # leave after the first chunk
        await stream.close()

    async def impatient(aclient: openai.AsyncOpenAI) -> None:
        # A non-streaming client that gives up: its request is aborted as well.
        with pytest.raises(openai.APITimeoutError):
            await aclient.with_options(timeout=1.0).completions.create(
                model=MODEL, prompt="An endless list:", max_tokens=400, extra_body={"ignore_eos": True}
            )

    async def stayer(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> list[Any]:
        async with async_client(server) as aclient:
            return await asyncio.gather(
                *(quitter(aclient, i) for i in range(20)),
                *(impatient(aclient) for _ in range(2)),
                *(stayer(aclient, p) for p in others),
            )

    results = asyncio.run(run())
    assert results[22:] == expected
    # The 22 would run 400 tokens each if not aborted; their blocks must be free right away.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = scrape(server.base_url)
        done = stats.get(
            ("kvserve_http_requests_total", frozenset({("endpoint", "/v1/completions"), ("outcome", "disconnected")})),
            0,
        )
        if done - disconnected_before == 22 and stats[("kvserve_kv_blocks_used", frozenset())] == 0:
            break
        time.sleep(0.1)
    assert done - disconnected_before == 22
    assert stats[("kvserve_kv_blocks_used", frozenset())] == 0
    assert stats[("kvserve_requests_running", frozenset())] == 0
    assert stats[("kvserve_requests_in_flight", frozenset())] == 0


# ---- bad input ----

BAD_INPUTS = [
    ("/v1/completions", b'{"prompt": "hi", ', 400, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, "dictionary"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt token ids"),
    ("/v1/completions", {"prompt": [1] * 8192}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 10**9}, 400, "n must be at most"),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream_options": "yes"}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/nowhere", {"prompt": "hi"}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_INPUTS)
def test_bad_input_gets_openai_error(server: ServerThread, path: str, body: Any, status: int, needle: str) -> None:
    response = post(server.base_url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    still = post(server.base_url, "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert still.status_code == 200


def test_harmless_unknown_fields_are_ignored(server: ServerThread) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "user": "alice", "metadata": {"x": 1}, "logit_bias": {}}
    assert post(server.base_url, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize(
    "extreme",
    [{"temperature": 1e-300}, {"temperature": 1e300}, {"top_p": 1e-300}, {"top_k": 10**9}, {"seed": -(2**80)}],
)
def test_extreme_but_valid_sampling_values_are_served(server: ServerThread, extreme: dict) -> None:
    response = post(server.base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extreme})
    assert response.status_code == 200, response.text


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=1)


# ---- fuzz: no input produces a 500 ----

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
_small_int = st.integers(-1, 3) | _json
_prompt = (
    st.text(max_size=20)
    | st.lists(st.integers(-5, 60_000), max_size=6)
    | st.lists(st.text(max_size=8), max_size=3)
    | st.lists(st.lists(st.integers(0, 50_000), max_size=4), max_size=2)
    | _json
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]) | _json},
    optional={
        "content": st.text(max_size=12)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}))
        | _json
    },
)
_common = {
    "model": st.just(MODEL) | _json,
    "temperature": st.floats(0, 2) | _json,
    "top_p": st.floats(0, 1) | _json,
    "top_k": _small_int,
    "seed": st.integers(-(2**70), 2**70) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2) | _json,
    "n": _small_int,
    "ignore_eos": st.booleans() | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    )
    | _json,
    "user": _json,
    "cache_salt": st.text(max_size=4) | _json,
    "logprobs": _small_int | st.booleans(),
}
# max_tokens is always present and small, so no generated body can ask for thousands of tokens.
_completion_body = st.fixed_dictionaries(
    {"prompt": _prompt, "max_tokens": st.integers(1, 3)}, optional={**_common, "echo": _json, "suffix": _json}
)
_chat_body = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3) | _json, "max_tokens": st.integers(1, 3)},
    optional={**_common, "top_logprobs": _small_int, "max_completion_tokens": st.integers(-1, 3), "tools": _json},
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    target=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    completion=_completion_body,
    chat=_chat_body,
)
def test_fuzzed_bodies_never_get_a_500(server: ServerThread, target: str, completion: dict, chat: dict) -> None:
    body = completion if target == "/v1/completions" else chat
    response = post(server.base_url, target, body)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code == 200 and body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text
    elif response.status_code != 200:
        assert response.json()["error"]["message"]


def test_server_healthy_after_everything(server: ServerThread) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    stats = scrape(server.base_url)
    assert stats[("kvserve_step_failures_total", frozenset())] == 0
    assert stats[("kvserve_kv_blocks_used", frozenset())] == 0
    assert stats[("kvserve_engine_healthy", frozenset())] == 1
    assert (
        stats.get(
            ("kvserve_http_requests_total", frozenset({("endpoint", "/v1/completions"), ("outcome", "rejected_500")})),
            0,
        )
        == 0
    )
