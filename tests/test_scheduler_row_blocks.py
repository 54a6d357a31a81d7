"""Decode-only steps kept in whole row blocks (Scheduler._defer_partial_row_block): which sequences sit a
step out, that they take turns, and that nothing else changes (the fake engine checks every K/V read and
the pool's bookkeeping each step; the real model gives the same tokens with and without)."""

from __future__ import annotations

import collections

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kernels import cpu
from tests.prefix_cache_fakes import FakeEngine

BLOCK = 32


def decoding_engine(num_seqs: int, max_tokens: int = 40, row_block: int | None = BLOCK) -> FakeEngine:
    """num_seqs requests of 4-token prompts, all prefilled by the first step."""
    engine = FakeEngine(num_blocks=8 * num_seqs, block_size=16, max_num_batched_tokens=4096, max_num_seqs=256,
                        row_block=row_block)  # fmt: skip
    for i in range(num_seqs):
        engine.add(f"r{i}", [1, 2, 3, 100 + i], max_tokens=max_tokens)
    first = engine.step()
    assert len(first.scheduled) == num_seqs and all(item.num_new_tokens == 4 for item in first.scheduled)
    return engine


@pytest.mark.parametrize(
    ("num_seqs", "rows"), [(100, 96), (104, 96), (36, 32), (33, 32), (105, 105), (64, 64), (20, 20)]
)
def test_a_few_rows_past_a_whole_block_wait_for_the_next_step(num_seqs, rows) -> None:
    engine = decoding_engine(num_seqs)
    assert engine.step().num_tokens == rows
    engine.check_invariants()


def test_without_row_blocks_every_decoder_runs() -> None:
    engine = decoding_engine(100, row_block=None)
    assert engine.step().num_tokens == 100


def test_left_out_sequences_take_turns_and_all_finish_their_tokens() -> None:
    engine = decoding_engine(100, max_tokens=40)
    requests = list(engine.requests.values())
    left_out = collections.Counter()
    for _ in range(25):  # 100 sequences, 4 left out a step: each once in 25 steps
        running = {id(seq) for seq in engine.scheduler.running}
        out = engine.step()
        engine.check_invariants()
        assert out.num_tokens == 96
        ran = {id(item.seq) for item in out.scheduled}
        left_out.update(running - ran)
    assert sorted(left_out.values()) == [1] * 100
    assert engine.scheduler.num_row_block_deferrals == 100
    engine.run_until_done()  # the fake engine checks each K/V read against what was written
    assert all(seq.num_output_tokens == 40 for request in requests for seq in request.sequences)


def test_steps_with_prefill_or_first_tokens_are_not_trimmed() -> None:
    engine = decoding_engine(96)
    engine.scheduler.max_num_batched_tokens = 96 + 38
    engine.add("late", list(range(1, 40)), max_tokens=3)
    with_prefill = engine.step()  # 96 decodes and 38 of the newcomer's 39 prompt tokens
    assert len(with_prefill.scheduled) == 97 and with_prefill.num_tokens == 96 + 38
    # Next: 97 one-token rows, the newcomer's the last of its prompt, whose logits give its first token.
    out = engine.step()
    engine.check_invariants()
    assert out.num_tokens == 96
    assert "late" in {item.seq.request.request_id for item in out.scheduled}


needs_amx = pytest.mark.skipif(
    cpu.load() is None or not cpu.load().amx_available(), reason="row blocks need linear_amx"
)


@needs_amx
def test_real_model_gives_the_same_tokens_with_row_blocks() -> None:
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    scheduler = llm.engine.scheduler
    assert scheduler.row_block == BLOCK
    prompts = [f"Item {i}: the colour of the sky is" for i in range(36)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch_rows = []
    schedule = scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        batch_rows.append(out.num_tokens)
        return out

    scheduler.schedule = recording_schedule
    with_blocks = [o.token_ids for o in llm.generate(prompts, params)]
    deferrals = llm.engine.stats()["row_block_deferrals"]
    assert deferrals >= 4  # 36 decoding sequences: 4 left out of each decode step
    scheduler.row_block = None
    without = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats()["row_block_deferrals"] == deferrals
    assert 32 in batch_rows and 36 in batch_rows  # trimmed with blocks, not without
    assert with_blocks == without
