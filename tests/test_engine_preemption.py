"""Continuous batching under KV pressure: a pool too small for all requests forces preemption, yet
every request finishes with exactly the tokens it produces alone, and every block is freed."""

from __future__ import annotations

import random

from kvserve import LLM, SamplingParams


def _workload(count: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 90))] for _ in range(count)]


def test_small_pool_preempts_and_matches_solo_outputs(llm_fp32):
    prompts = _workload(64)
    lengths = [4 + i % 9 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    solo = [llm_fp32.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]

    # 12 blocks of 16 tokens hold ~2 of these requests at once: admission and preemption must juggle 64.
    small = LLM(dtype="float32", num_kv_blocks=12, block_size=16, max_num_batched_tokens=64)
    outs = small.generate(prompts, params)

    assert [o.token_ids for o in outs] == solo
    assert all(o.finish_reason == "length" for o in outs)
    stats = small.engine.stats()
    assert stats["preemptions"] > 0
    assert stats["max_batch_size"] > 1
    assert small.engine.pool.num_free == small.engine.pool.num_blocks
    assert not small.engine.scheduler.running and not small.engine.scheduler.waiting


def test_chunked_prefill_keeps_decodes_running(llm_fp32):
    """A prompt longer than the token budget is split; decodes admitted earlier keep advancing."""
    engine = LLM(dtype="float32", max_num_batched_tokens=32).engine
    engine.add_request("short", [101, 102, 103], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # prefill of the short request
    engine.add_request("long", list(range(200, 400)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    steps_with_both = 0
    while engine.has_unfinished_requests():
        outputs = {o.request_id: o for o in engine.step()}
        long_seq = engine.requests.get("long")
        if long_seq and long_seq.sequences[0].in_prefill and "short" in outputs:
            steps_with_both += 1
        assert engine.counters.last_batch_tokens <= 32
    # 200 prompt tokens at <= 31 per step take several steps, and the short request decoded in each.
    assert steps_with_both >= 5
    assert engine.pool.num_free == engine.pool.num_blocks
