"""Greedy outputs equal HF transformers' token for token, one at a time and all in one batch."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_model_and_tokenizer

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "In 1969, Neil Armstrong",
    "Water boils at a temperature of",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompt_ids(llm_fp32) -> list[list[int]]:
    tok = llm_fp32.tokenizer
    raw = [tok.encode(p) for p in RAW_PROMPTS]
    chat = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return raw + chat


@pytest.fixture(scope="module")
def hf_outputs(prompt_ids) -> list[list[int]]:
    return [hf_greedy(ids, NEW_TOKENS) for ids in prompt_ids]


def test_prompt_token_ids_equal_hf_tokenizer(llm_fp32, prompt_ids):
    _, hf_tok = hf_model_and_tokenizer()
    assert [hf_tok.encode(p, add_special_tokens=False) for p in RAW_PROMPTS] == prompt_ids[: len(RAW_PROMPTS)]
    chat_hf = [
        hf_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in CHAT_PROMPTS
    ]
    assert [hf_tok.encode(t, add_special_tokens=False) for t in chat_hf] == prompt_ids[len(RAW_PROMPTS) :]


def test_greedy_one_at_a_time_equals_hf(llm_fp32, prompt_ids, hf_outputs):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for ids, expected in zip(prompt_ids, hf_outputs, strict=True):
        (out,) = llm_fp32.generate([ids], params)
        assert out.token_ids == expected


def test_greedy_batched_equals_hf(llm_fp32, prompt_ids, hf_outputs):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm_fp32.generate(prompt_ids, params)
    assert [o.token_ids for o in outs] == hf_outputs
    assert all(o.finish_reason == "length" for o in outs)


def test_greedy_batched_equals_hf_with_the_tiled_kernel(prompt_ids, hf_outputs):
    """The FlashAttention-style kernel for every layer of every step, prefill and decode alike."""
    llm = LLM(dtype="float32", attention_backend="tiled")
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_outputs
