"""The sampling surface over HTTP: vLLM's extra sampling fields reach the engine, echo returns the
prompt and its logprobs, and no field is ever ignored silently (a 400 names it)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from kvserve import LLM, EngineConfig, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Any:
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32"))).start()
    with ServerThread(build_app(engine)) as running:
        yield running
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body), headers=headers, timeout=300)


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, llm_fp32: LLM) -> None:
    prompt = "Say the word 'yes' many times: yes yes yes"
    settings = {
        "frequency_penalty": 1.2,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.3,
        "min_p": 0.1,
        "logit_bias": {"28": -100},
        "min_tokens": 4,
    }
    params = SamplingParams(temperature=0, max_tokens=10, **{**settings, "logit_bias": {28: -100}})
    expected = llm_fp32.generate(prompt, params)[0]
    extra = {k: v for k, v in settings.items() if k not in ("frequency_penalty", "presence_penalty", "logit_bias")}
    got = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        frequency_penalty=1.2,
        presence_penalty=0.5,
        logit_bias={"28": -100},
        extra_body=extra,
    )
    assert got.choices[0].text == expected.text


def test_stop_token_ids_and_skip_special_tokens(client: openai.OpenAI, llm_fp32: LLM) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    ids = llm_fp32.tokenizer.encode(plain.choices[0].message.content)
    stopped = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [ids[1]]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 2
    im_end = "<|im_end|>"
    kept = client.completions.create(
        model=MODEL,
        prompt=llm_fp32.tokenizer.apply_chat_template(CHAT),
        max_tokens=40,
        temperature=0,
        extra_body={"skip_special_tokens": False, "ignore_eos": True, "stop_token_ids": [2]},
    )
    assert im_end in kept.choices[0].text  # the end-of-turn token, shown as text


def test_echo_returns_the_prompt_and_its_logprobs(client: openai.OpenAI, llm_fp32: LLM) -> None:
    prompt = "The capital of France is"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = got.choices[0]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert choice.text == prompt + plain.choices[0].text
    prompt_ids = llm_fp32.tokenizer.encode(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == choice.text
    # A prompt logprob is that of a one-token generation after the prefix before it.
    for position in (len(prompt_ids) - 1,):
        step = llm_fp32.generate([prompt_ids[:position]], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[
            0
        ].outputs[0]
        reference = {t: lp for t, lp in step.logprobs[0].top}
        tokens = [llm_fp32.tokenizer.decode([t]) for t in reference]
        assert list(logprobs.top_logprobs[position]) == tokens
        assert list(logprobs.top_logprobs[position].values()) == pytest.approx(list(reference.values()), abs=1e-4)
    no_logprobs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert no_logprobs.choices[0].text == choice.text and no_logprobs.choices[0].logprobs is None


def test_streamed_echo_joins_to_the_non_streamed_answer(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "Water boils at"]
    args = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    whole = sorted(client.completions.create(**args).choices, key=lambda c: c.index)
    text = {c.index: "" for c in whole}
    tokens: dict[int, list[str]] = {c.index: [] for c in whole}
    offsets: dict[int, list[int]] = {c.index: [] for c in whole}
    logprobs: dict[int, list[float | None]] = {c.index: [] for c in whole}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
            if c.logprobs is not None:
                tokens[c.index] += c.logprobs.tokens
                offsets[c.index] += c.logprobs.text_offset
                logprobs[c.index] += c.logprobs.token_logprobs
    for c in whole:
        assert text[c.index] == c.text and c.text.startswith(prompts[c.index])
        assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset
        assert logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)


REFUSED = [
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, "unknown field 'max_token'"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "extra"),
]


@pytest.mark.parametrize(("path", "body", "needle"), REFUSED)
def test_unimplemented_or_contradictory_fields_get_a_400(server: ServerThread, path: str, body: dict, needle: str):
    response = post(server, path, {"max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_neutral_and_harmless_fields_are_accepted(server: ServerThread) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 1,
        "best_of": 1,
        "use_beam_search": False,
        "metadata": {"team": "a"},
        "store": False,
        "user": "u",
        "echo": False,
        "suffix": None,
    }
    assert post(server, "/v1/completions", body).status_code == 200
