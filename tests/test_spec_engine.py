"""Speculative decoding in the engine with the bundled model (book §31.5): greedy outputs equal the
non-speculative ones token for token whatever the proposer, KV written for rejected drafts is rolled
back, and no block leaks, under preemption and a token budget that cuts drafts short."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.spec.proposers import Proposal

# Copy-heavy: the continuation repeats the list, so n-gram lookup has something to find.
COPY_PROMPT = (
    "Repeat the list exactly: red, green, blue, yellow, purple, orange, black, white. "
    "red, green, blue, yellow, purple, orange, black, white. red, green,"
)
SPEC_CONFIGS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_tokens": 4},
    "ngram-fixed-k": {"method": "ngram", "num_tokens": 4, "adaptive": False},
    # Fixed k: the adaptive planner rarely drafts for a 12-layer self-draft (tests/test_spec_planner.py),
    # and this test needs drafts verified.
    "self-draft": {"method": "draft", "num_tokens": 3, "draft_layers": 12, "adaptive": False},
    "draft-model": {"method": "draft", "num_tokens": 3, "draft_model": "smollm2-135m-instruct"},
}


def _greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def _mixed_batch(llm: LLM) -> tuple[list[str | list[int]], list[SamplingParams]]:
    """Different prompt lengths, a copy-heavy prompt, stop strings, small and large max_tokens, n=2."""
    chat = llm.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    prompts: list[str | list[int]] = [
        COPY_PROMPT,
        "The capital of France is",
        chat,
        "def fibonacci(n):\n    ",
        "Once upon a time, in a land far away,",
    ]
    params = [
        _greedy(24, ignore_eos=True),
        _greedy(2),
        _greedy(24, stop=["\n"]),
        _greedy(16, n=2),
        _greedy(24, stop=[","], ignore_eos=True),
    ]
    return prompts, params


def _tokens(outputs: list) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _assert_idle(engine: LLMEngine) -> None:
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _assert_block_accounting(engine: LLMEngine) -> None:
    """After a step: no sequence holds a block past its tokens (drafts rolled back), and every block
    in use is referenced by exactly ref_count block tables (nothing leaked, nothing freed twice)."""
    bs = engine.config.block_size
    holders: dict[int, int] = {}
    for seq in engine.scheduler.running + engine.scheduler.waiting:
        assert len(seq.block_table) <= -(-seq.num_tokens // bs), "blocks of rejected drafts kept"
        for block in seq.held_blocks:
            holders[block] = holders.get(block, 0) + 1
    assert engine.pool.num_used == len(holders)
    assert all(engine.pool.ref_count(b) == n for b, n in holders.items())


@pytest.fixture(scope="module")
def mixed_reference(llm_fp32) -> list:
    prompts, params = _mixed_batch(llm_fp32)
    outputs = llm_fp32.generate(prompts, params)
    assert any(o.outputs[0].finish_reason == "stop" and isinstance(o.outputs[0].stop_reason, str) for o in outputs)
    return outputs


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_greedy_speculation_equals_plain_decoding(name, mixed_reference):
    llm = LLM(dtype="float32", num_kv_blocks=128, speculative=SPEC_CONFIGS[name])
    prompts, params = _mixed_batch(llm)
    outputs = llm.generate(prompts, params)

    assert _tokens(outputs) == _tokens(mixed_reference)
    assert [[c.text for c in o.outputs] for o in outputs] == [[c.text for c in o.outputs] for o in mixed_reference]
    assert [[c.finish_reason for c in o.outputs] for o in outputs] == [
        [c.finish_reason for c in o.outputs] for o in mixed_reference
    ]
    _assert_idle(llm.engine)
    stats = llm.engine.stats()
    assert stats["spec_accepted_tokens"] > 0
    assert stats["spec_mean_tokens_per_step"] > 1
    if name == "draft-model":
        # The draft is the target itself: every greedy draft is the target's own choice.
        assert stats["spec_acceptance_rate"] > 0.97


def _drive(engine: LLMEngine, prompts: list, params: list[SamplingParams], max_steps: int = 400) -> list:
    """Run requests to completion step by step (a hang fails instead of looping), checking block
    accounting after every step; outputs in prompt order."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        _assert_block_accounting(engine)
    assert not engine.has_unfinished_requests(), f"requests still running after {max_steps} steps"
    return [finished[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "spec",
    [
        SPEC_CONFIGS["ngram-fixed-k"],
        # 26 of 30 layers: a self-draft right often enough that some drafts are accepted, not all.
        {"method": "draft", "num_tokens": 3, "draft_layers": 26, "adaptive": False},
    ],
    ids=["ngram", "self-draft"],
)
def test_rollback_and_preemption_under_a_small_pool(spec, llm_fp32):
    """Many requests, 4-token blocks, a pool that holds only a few: drafts are rejected, sequences are
    preempted and recomputed, and every step leaves block tables trimmed to the accepted tokens."""
    prompts = [COPY_PROMPT[i * 7 :] for i in range(8)]
    params = [_greedy(8 + 2 * (i % 3), ignore_eos=True) for i in range(len(prompts))]
    expected = _tokens(llm_fp32.generate(prompts, params))

    llm = LLM(dtype="float32", num_kv_blocks=48, block_size=4, max_num_batched_tokens=128, speculative=spec)
    outputs = _drive(llm.engine, prompts, params)

    assert _tokens(outputs) == expected
    _assert_idle(llm.engine)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]  # some drafts rejected


def test_tiny_token_budget_cuts_drafts_and_defers_the_first_decode(llm_fp32, monkeypatch):
    """A budget of 8 tokens: the n=2 request's first prefill chunk ends one token before its prompt's
    end, yet its first decode must not be speculated (its samples fork there); later the budget cuts
    one decoder's drafts short, and only the drafts fed to the target may be verified. The proposer
    always guesses k tokens (the last k, mostly wrong): greedy outputs must not depend on guesses."""
    prompts: list[str | list[int]] = [list(range(1000, 1009)), "a b c a b c a b", "x y z x y z x y", "1 2 3 1 2"]
    params = [_greedy(6, n=2, ignore_eos=True)] + [_greedy(8, ignore_eos=True)] * 3
    expected = _tokens(llm_fp32.generate(prompts, params))

    llm = LLM(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, speculative=SPEC_CONFIGS["ngram-fixed-k"])
    speculator = llm.engine.speculator
    monkeypatch.setattr(speculator.ngram, "propose", lambda ids, k: Proposal(list(ids[-k:])))
    outputs = _drive(llm.engine, prompts, params)

    assert [o.error for o in outputs] == [None] * len(prompts)
    assert _tokens(outputs) == expected
    _assert_idle(llm.engine)
    assert 0 < speculator.stats.accepted < speculator.stats.proposed
