"""The engine's per-step record (kvserve/engine/step_trace.py): the ring is bounded, and each record
says what the step really did, checked against the engine's own outputs and counters on the real model
(chunked prefill with a small token budget, n-gram speculation, a prefix-cache hit)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvserve import EngineConfig, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.step_trace import SeqWork, StepRecord, StepTrace

BUDGET = 16  # max_num_batched_tokens: a 40-token prompt takes several steps
REPETITIVE = "one two three four one two three four one two three four one two three four one two three"
LONG = "The history of the printing press begins in the fifteenth century, when movable type changed how books were"


def fake_record(index: int) -> StepRecord:
    return StepRecord(index, time.time(), 0.001, (SeqWork("r", 0, 0, 1, 0),), 1, 1, 0, 9, 0, 0, 0, 0, 0, ())


def test_ring_keeps_the_newest_records_only() -> None:
    trace = StepTrace(capacity=3)
    assert trace.last_index == 0 and trace.since(0) == []
    for i in range(1, 11):
        trace.append(fake_record(i))
    assert [r.step for r in trace.since(0)] == [8, 9, 10]
    assert [r.step for r in trace.since(9)] == [10]
    assert trace.since(10) == [] and trace.last_index == 10
    with pytest.raises(ValueError, match="capacity"):
        StepTrace(capacity=0)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    config = EngineConfig(dtype="float32", max_num_batched_tokens=BUDGET, speculative={"method": "ngram"})
    yield LLMEngine(config)


def run(engine: LLMEngine, prompts: dict[str, str], max_tokens: int) -> dict[str, RequestOutput]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            final[output.request_id] = output
    return final


@pytest.mark.slow
def test_records_say_what_each_step_did(engine: LLMEngine) -> None:
    trace = engine.step_trace = StepTrace()
    try:
        outputs = run(engine, {"short": REPETITIVE, "long": LONG}, max_tokens=12)
        again = run(engine, {"again": LONG}, max_tokens=2)  # the long prompt's full blocks are cached now
    finally:
        engine.step_trace = None
    outputs.update(again)
    records = trace.since(0)
    assert [r.step for r in records] == list(range(1, engine.counters.steps + 1))
    for r in records:
        assert r.num_tokens == sum(s.prefill_tokens + s.decode_tokens for s in r.seqs) <= BUDGET
        assert all((s.prefill_tokens > 0) != (s.decode_tokens > 0) for s in r.seqs)
        assert all(s.accepted_drafts <= max(s.decode_tokens - 1, 0) for s in r.seqs)
        assert r.kv_blocks_used + r.kv_blocks_free == engine.pool.num_blocks
    assert any(any(s.prefill_tokens for s in r.seqs) and any(s.decode_tokens for s in r.seqs) for r in records), (
        "a prefill chunk shares a step with a decode"
    )
    assert records[-1].spec_accepted == engine.speculator.stats.accepted > 0

    for request_id, output in outputs.items():
        mine = [(r, s) for r in records for s in r.seqs if s.request_id == request_id]
        prefill = [s.prefill_tokens for _, s in mine if s.prefill_tokens]
        assert sum(prefill) == len(output.prompt_token_ids) - output.num_cached_tokens
        decodes = [s for _, s in mine if s.decode_tokens]
        # The last prefill chunk emits the first token; each decode step one more, plus the drafts it kept.
        assert 1 + sum(1 + s.accepted_drafts for s in decodes) == len(output.token_ids)
        finished = [(r, f) for r in records for f in r.finished if f.request_id == request_id]
        assert len(finished) == 1 and finished[0][0] is mine[-1][0], "reported once, in its last step"
        m = output.metrics
        assert finished[0][1].ttft_s == pytest.approx(m.first_token_time - m.arrival_time)
    assert len([p for r in records for s in r.seqs if s.request_id == "long" and (p := s.prefill_tokens)]) > 1
    assert outputs["again"].num_cached_tokens > 0
    assert records[-1].prefix_cache_hits == engine.pool.stats.hits >= outputs["again"].num_cached_tokens
