"""Blocks behind the sliding window go back to the pool (Scheduler._release_behind_window): for Mistral,
whose every layer is windowed, greedy tokens still equal HF's with prompts several windows long, in a
pool too small for the sequences had every block been kept; a long sequence holds a bounded number of
blocks; preemption, speculation and prefix caching stay exact and nothing leaks. Gemma 3, which has
global layers, releases nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.intmath import div_ceil
from kvserve.model.hf import read_hf_config
from tests.family_checkpoints import VOCAB, WINDOW, save_checkpoint
from tests.test_model_families import hf_greedy

NEW_TOKENS = 32
BLOCK = 4  # two blocks per window: most of a long sequence's blocks lie behind it
_gen = torch.Generator().manual_seed(11)
_SHARED = torch.randint(3, VOCAB, (24,), generator=_gen).tolist()
# 5 to 5.5 windows long (a window: 2 blocks); the first three share 24 tokens (6 blocks), so prefix caching
# has blocks to reuse.
_TAILS = [torch.randint(3, VOCAB, (n,), generator=_gen).tolist() for n in (20, 18, 16)]
PROMPTS = [_SHARED + tail for tail in _TAILS] + [torch.randint(3, VOCAB, (42,), generator=_gen).tolist()]
# Every prompt + its tokens fits the pool alone (InputProcessor's rule), but not two of them at once
# unless blocks are released.
POOL = div_ceil(max(len(p) for p in PROMPTS) + NEW_TOKENS, BLOCK) + 1
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Held by a decoding sequence: the blocks of keys p - WINDOW + 1 .. p for its next query p.
MOST_HELD = div_ceil(WINDOW - 1, BLOCK) + 1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """family -> (directory, HF greedy tokens per prompt)."""
    made = {}
    for family in ("mistral", "gemma3"):
        directory = tmp_path_factory.mktemp(family)
        model = save_checkpoint(family, directory)
        made[family] = (directory, [hf_greedy(model, ids) for ids in PROMPTS])
    return made


def windowed_llm(directory: Path, **config) -> LLM:
    return LLM(
        model=str(directory),
        **{"dtype": "float32", "block_size": BLOCK, "num_kv_blocks": POOL, "max_num_batched_tokens": 16, **config},
    )


def assert_idle(engine: LLMEngine) -> None:
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(engine.pool.ref_count(b) == 0 for b in range(engine.pool.num_blocks))
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_the_pool_could_not_hold_two_sequences_whole():
    assert 2 * div_ceil(min(len(p) for p in PROMPTS) + NEW_TOKENS, BLOCK) > POOL
    assert min(len(p) for p in PROMPTS) >= 5 * WINDOW


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mistral_equals_hf_with_blocks_released(checkpoints, prefix_caching):
    directory, expected = checkpoints["mistral"]
    llm = windowed_llm(directory, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    assert engine.scheduler.window == WINDOW
    alone = [llm.generate([ids], GREEDY)[0] for ids in PROMPTS]
    assert [o.token_ids for o in alone] == expected
    assert_idle(engine)
    if prefix_caching:  # the 2nd and 3rd prompts found the 1st one's released (cached) blocks
        assert [o.num_cached_tokens for o in alone[1:3]] == [len(_SHARED), len(_SHARED)]
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == expected
    stats = engine.stats()
    assert stats["max_batch_size"] == len(PROMPTS) and stats["preemptions"] == 0  # all ran at once, in POOL blocks
    assert_idle(engine)


def test_a_long_sequence_holds_only_its_window(checkpoints):
    directory, expected = checkpoints["mistral"]
    engine = windowed_llm(directory).engine
    engine.add_request("long", PROMPTS[0], GREEDY)
    seq = engine.requests["long"].sequences[0]
    held = []
    while engine.has_unfinished_requests():
        position, decoding = seq.num_computed_tokens, not seq.in_prefill  # the step's first query
        engine.step()
        if seq.is_finished:
            break
        assert seq.num_released_blocks == max(position - WINDOW + 1, 0) // BLOCK  # released when scheduled
        if decoding:
            held.append(len(seq.held_blocks))
            assert engine.pool.num_used == len(seq.held_blocks)
    assert seq.output_token_ids == expected[0]
    assert len(held) == NEW_TOKENS - 2 and max(held) <= MOST_HELD
    assert div_ceil(len(seq.token_ids), BLOCK) > 5 * MOST_HELD  # what keeping every block would hold
    assert_idle(engine)


# What a sample holds at once with chunked prefill (windowed_llm's 16-token steps): the window's keys before
# a step's first query and the step's tokens, one block more where they straddle one (InputProcessor).
ONE_STEP_HELD = div_ceil(WINDOW - 1 + 16, BLOCK) + 1


def test_a_sample_longer_than_the_pool_is_admitted_and_equals_hf(checkpoints):
    """Admission counts the blocks a sample holds at once, not one per block of its length: every sample
    here needs more blocks than the pool has, and runs, alone and all at once (then with preemption)."""
    directory, expected = checkpoints["mistral"]
    assert min(div_ceil(len(p) + NEW_TOKENS, BLOCK) for p in PROMPTS) > ONE_STEP_HELD
    llm = windowed_llm(directory, num_kv_blocks=ONE_STEP_HELD)
    assert llm.engine.max_sequence_len == llm.engine.max_model_len
    assert [llm.generate([ids], GREEDY)[0].token_ids for ids in PROMPTS] == expected
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert_idle(llm.engine)


def test_cached_blocks_behind_the_window_are_not_counted_against_the_pool(checkpoints):
    """A prompt whose cached prefix (6 blocks) and first chunk (4 more) exceed the pool (7): the hits behind
    the window go straight back, so it needs only the 2 hits it keeps and the chunk's 4. Counting every hit,
    admission waited for 10 free blocks in a pool of 7, for ever."""
    directory, expected = checkpoints["mistral"]
    engine = windowed_llm(directory, num_kv_blocks=ONE_STEP_HELD).engine
    engine.add_request("prefix", _SHARED + [5], SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("hit", PROMPTS[1], GREEDY)
    seq = engine.requests["hit"].sequences[0]
    for _ in range(4 * NEW_TOKENS):  # a bound, so a stalled admission fails instead of hanging
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert seq.request.num_cached_tokens == len(_SHARED)
    assert seq.output_token_ids == expected[1]
    assert_idle(engine)


@pytest.mark.parametrize("family, config", [("mistral", {"enable_chunked_prefill": False}), ("gemma3", {})])
def test_a_sample_that_would_hold_more_than_the_pool_is_refused(checkpoints, family, config):
    """Without chunked prefill a preempted sample recomputes all its tokens in one step; Gemma 3's global
    layers keep every key. Either way the whole length must fit the pool, and the refusal names it."""
    directory, _ = checkpoints[family]
    llm = windowed_llm(directory, num_kv_blocks=ONE_STEP_HELD, **config)
    needs = div_ceil(len(PROMPTS[0]) + NEW_TOKENS, BLOCK)
    with pytest.raises(ValueError, match=f"needs {needs} KV blocks but the pool has only {ONE_STEP_HELD}"):
        llm.generate([PROMPTS[0]], GREEDY)
    assert_idle(llm.engine)


def test_preemption_under_pressure_gives_hfs_tokens(checkpoints):
    """Twelve requests in a pool that holds four windows' worth of blocks: admissions count the free
    blocks of the moment, and prefill chunks then need more than the released ones give back, so the
    newest are preempted and recomputed (from the prefix cache's released blocks where still there)."""
    directory, expected = checkpoints["mistral"]
    llm = windowed_llm(directory)
    outs = llm.generate(PROMPTS * 3, GREEDY)
    assert [o.token_ids for o in outs] == expected * 3
    assert llm.engine.stats()["preemptions"] > 0
    assert_idle(llm.engine)


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_tokens": 4, "adaptive": False},
        {"method": "draft", "num_tokens": 3, "draft_layers": 1, "adaptive": False},
    ],
)
def test_speculation_with_released_blocks(checkpoints, speculative):
    """Drafts (and the K/V of rejected ones) sit past the window's start: releasing behind it and rolling
    back rejected drafts never touch the same blocks."""
    directory, expected = checkpoints["mistral"]
    llm = windowed_llm(directory, speculative=speculative)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats()["spec_proposed_tokens"] > 0
    assert_idle(llm.engine)


def test_n_samples_fork_after_blocks_were_released(checkpoints):
    """The prompt is longer than the window, so the first sample has released blocks when it forks: the
    others share only the blocks it holds. Greedy samples all equal HF's tokens."""
    directory, expected = checkpoints["mistral"]
    llm = windowed_llm(directory, num_kv_blocks=3 * POOL)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 3
    assert_idle(llm.engine)


def test_abort_frees_what_is_held(checkpoints):
    directory, _ = checkpoints["mistral"]
    engine = windowed_llm(directory).engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    seq = engine.requests["a"].sequences[0]
    for _ in range(NEW_TOKENS // 2):  # mid-generation, past the prompt's windows
        engine.step()
    assert seq.num_released_blocks > 0 and not seq.is_finished
    engine.abort_request("a")
    assert_idle(engine)


def test_gemma3_with_global_layers_releases_nothing(checkpoints):
    directory, expected = checkpoints["gemma3"]
    assert read_hf_config(directory)[0].window_of_every_layer is None
    llm = windowed_llm(directory, num_kv_blocks=4 * POOL)
    engine = llm.engine
    assert engine.scheduler.window is None
    engine.add_request("long", PROMPTS[0], GREEDY)
    seq = engine.requests["long"].sequences[0]
    while engine.has_unfinished_requests():
        engine.step()
        assert seq.num_released_blocks == 0
        if not seq.is_finished:
            assert len(seq.held_blocks) == div_ceil(seq.num_computed_tokens, BLOCK)
    assert seq.output_token_ids == expected[0]
    assert_idle(engine)
