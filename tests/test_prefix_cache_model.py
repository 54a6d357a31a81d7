"""Prefix caching on the real model (float32): outputs with the cache equal outputs without it.

Each test builds its own small engines (the weights are loaded once per process), so cache state
never leaks between tests. Prompts are token ids, taken as they are. Outputs are short: the first
token reads the cached K/V, the second also the K/V its decode step wrote (into a copied block where
a partial block was shared), and every forward pass costs seconds on a busy CPU.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.workload import load
from kvserve.config import EngineConfig
from kvserve.engine import engine as engine_module
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.model.registry import load_model

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
FIRST_TOKEN = dataclasses.replace(GREEDY, max_tokens=1)  # enough where only admission matters
WORKLOADS = BOOK_WORKLOADS


def engines(**config: object) -> tuple[LLM, LLM]:
    """The same engine with prefix caching on and off."""
    options = {"dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 64, **config}
    return LLM(**options, enable_prefix_caching=True), LLM(**options, enable_prefix_caching=False)


def tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def ids(start: int, length: int) -> list[int]:
    """Distinct ordinary token ids (SmolLM2 keeps its special tokens below 17)."""
    return [1000 + (start + 37 * i) % 30000 for i in range(length)]


def test_book_example_at_block_size_1() -> None:
    example = {r.id: r.input_ids or [] for r in load(WORKLOADS / "ch31-example.jsonl")}
    a, b, c = example["A"], example["B"], example["C"]
    together, _ = engines(block_size=1)
    assert [o.num_cached_tokens for o in together.generate([a, b], FIRST_TOKEN)] == [0, 0]  # nothing written yet
    after, _ = engines(block_size=1)
    after.generate([a], FIRST_TOKEN)
    assert [o.num_cached_tokens for o in after.generate([b, c], FIRST_TOKEN)] == [3, 0]


def test_many_requests_sharing_a_prefix_that_ends_mid_block() -> None:
    doc = ids(0, 5 * BLOCK + 5)  # 5 full blocks, then 5 tokens of a block the questions complete
    prompts = [doc + ids(100 * q + 1, 3 + q) for q in range(6)]
    on, off = engines()
    first = on.generate(prompts[:1], GREEDY)
    rest = on.generate(prompts[1:], GREEDY)
    assert [o.num_cached_tokens for o in first + rest] == [0] + [5 * BLOCK] * 5
    assert tokens(first + rest) == tokens(off.generate(prompts, GREEDY))
    stats = on.engine.stats()
    assert stats["prefix_cache_hits"] == 5 * 5 * BLOCK
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts)) - 5 * 5 * BLOCK
    assert off.engine.stats()["prefix_cache_hits"] == 0


def test_cache_salt_separates_tenants() -> None:
    prompt = ids(7, 3 * BLOCK + 1)
    on, _ = engines()
    on.generate([prompt], FIRST_TOKEN, cache_salt="tenant-a")
    outputs = on.generate([prompt, prompt, prompt], FIRST_TOKEN, cache_salt=["tenant-b", None, "tenant-a"])
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 3 * BLOCK]
    assert len({tuple(o.token_ids) for o in outputs}) == 1


def test_hits_after_eviction_pressure_and_preemption_give_the_same_outputs() -> None:
    """An 11-block pool holds one 6-block request (40 prompt tokens + 1 decoded) with room to spare,
    not two at full length."""
    docs = [ids(1000 * d, 4 * BLOCK + 6) for d in range(3)]
    # d0; d1 + d2 together (one is preempted and recomputed; d0 is evicted); d2 again (a hit);
    # d0 again (a miss: evicted); d0 once more (a hit).
    waves = [[docs[0]], [docs[1], docs[2]], [docs[2]], [docs[0]], [docs[0]]]
    prompts = [[doc + ids(7 * i + 50 * w, 2) for i, doc in enumerate(wave)] for w, wave in enumerate(waves)]
    on, off = engines(num_kv_blocks=11)
    outputs = [out for wave in prompts for out in on.generate(wave, GREEDY)]
    stats = on.engine.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["preemptions"] > 0
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 4 * BLOCK, 0, 4 * BLOCK]
    assert tokens(outputs) == tokens(off.generate([p for wave in prompts for p in wave], GREEDY))


def test_forks_share_the_partial_last_prompt_block_copy_on_write() -> None:
    prompt = ids(3, 2 * BLOCK + 5)
    greedy_n = SamplingParams(n=3, temperature=0.0, max_tokens=3, ignore_eos=True)
    sampled_n = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True)
    on, off = engines()
    greedy, sampled = on.generate([prompt, prompt], [greedy_n, sampled_n])
    reference, sampled_off = off.generate([prompt, prompt], [dataclasses.replace(greedy_n, n=1), sampled_n])
    assert tokens([greedy]) == [[reference.token_ids] * 3]
    assert tokens([sampled]) == tokens([sampled_off])
    assert len({tuple(t) for t in tokens([sampled])[0]}) > 1  # the samples do differ from each other
    [again] = on.generate([prompt], sampled_n)  # served from the cache this time
    assert again.num_cached_tokens == 2 * BLOCK
    assert tokens([again]) == tokens([sampled])
    assert on.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "change",
    [{"rope_theta": 20_000.0}, {"rope_scaling": (("factor", 2.0), ("type", "linear"))}],
)
def test_fingerprint_covers_positional_settings(monkeypatch: pytest.MonkeyPatch, change: dict) -> None:
    """Same weights, other RoPE: a new fingerprint, hence a new cache key for every block hash."""
    config = EngineConfig(dtype="float32", num_kv_blocks=2)
    base = LLMEngine(config).fingerprint
    loaded = load_model(config.model)
    changed = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, **change))
    monkeypatch.setattr(engine_module, "load_model", lambda _: changed)
    assert LLMEngine(config).fingerprint != base
