"""Book §31.3's A/B/C example at block size 1, on the real Scheduler and BlockPool (the model does not matter).

A = [10, 11, 12, 13], B = [10, 11, 12, 14], C = [20, 21]: B may reuse exactly A's first three positions,
and only once A has computed them; C shares nothing. Exact tokens at exact positions under one cache key
(model fingerprint, adapter, cache salt) are what match, never similar content.
"""

from __future__ import annotations

import pytest

from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.workload import load
from tests.prefix_cache_fakes import FakeEngine

WORKLOADS = BOOK_WORKLOADS
EXAMPLE = {r.id: r.input_ids or [] for r in load(WORKLOADS / "ch31-example.jsonl")}
A, B, C = EXAMPLE["A"], EXAMPLE["B"], EXAMPLE["C"]


def engine() -> FakeEngine:
    return FakeEngine(num_blocks=16, block_size=1)


def test_b_reuses_exactly_the_shared_prefix_once_a_computed_it() -> None:
    eng = engine()
    a = eng.add("A", A, max_tokens=3)
    eng.step()  # A's whole prompt is computed in this step, and only then indexed
    b = eng.add("B", B, max_tokens=2)
    eng.step()
    assert b.num_cached_tokens == 3
    assert b.sequences[0].block_table[:3] == a.sequences[0].block_table[:3]
    c = eng.add("C", C, max_tokens=1)
    eng.run_until_done()
    assert c.num_cached_tokens == 0
    assert eng.pool.stats.queries == len(A) + len(B) + len(C)
    assert eng.pool.stats.hits == 3


def test_b_reuses_the_prefix_after_a_finished() -> None:
    eng = engine()
    eng.add("A", A, max_tokens=3)
    eng.run_until_done()
    assert eng.pool.num_used == 0  # A's blocks are free but keep their hashes
    b = eng.add("B", B, max_tokens=2)
    eng.run_until_done()
    assert b.num_cached_tokens == 3


def test_b_arriving_while_a_is_being_computed_does_not_hit() -> None:
    eng = engine()
    eng.add("A", A, max_tokens=3)
    b = eng.add("B", B, max_tokens=2)  # admitted in the same step as A: nothing is written yet
    eng.run_until_done()
    assert b.num_cached_tokens == 0


def test_a_prefix_computed_in_an_earlier_chunk_is_reusable_before_a_finishes_its_prompt() -> None:
    """A budget of 3 tokens splits A's prompt: [10, 11, 12] now, [13] next step, when B is admitted."""
    eng = FakeEngine(num_blocks=16, block_size=1, max_num_batched_tokens=3)
    a = eng.add("A", A, max_tokens=1)
    eng.step()
    assert a.sequences[0].num_computed_tokens == 3
    b = eng.add("B", B, max_tokens=1)
    out = eng.step()
    assert [item.seq.request for item in out.scheduled] == [a, b]
    assert b.num_cached_tokens == 3


@pytest.mark.parametrize(
    "other",
    [
        [12, 11, 10, 13],  # the same ids in a different order
        [13, 10, 11, 12],  # A's first three ids, shifted one position
        [99, 10, 11, 12],
        C,
    ],
)
def test_other_orders_and_positions_miss(other: list[int]) -> None:
    eng = engine()
    eng.add("A", A, max_tokens=1)
    eng.run_until_done()
    other_request = eng.add("other", other, max_tokens=1)
    eng.run_until_done()
    assert other_request.num_cached_tokens == 0


@pytest.mark.parametrize(
    "a_key, b_key, hit",
    [
        ({}, {}, 3),
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, 3),
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, 0),
        ({"cache_salt": "tenant-a"}, {}, 0),  # no salt shares only with no salt
        ({}, {"cache_salt": "tenant-a"}, 0),
        ({}, {"cache_salt": "None"}, 0),  # a salt spelled "None" is still a salt
        ({"fingerprint": "weights-1"}, {"fingerprint": "weights-2"}, 0),
    ],
)
def test_cache_key_is_an_access_boundary(a_key: dict, b_key: dict, hit: int) -> None:
    eng = engine()
    eng.add("A", A, max_tokens=1, **a_key)
    eng.run_until_done()
    b = eng.add("B", B, max_tokens=1, **b_key)
    eng.run_until_done()
    assert b.num_cached_tokens == hit


def test_caching_disabled_never_hits_nor_indexes() -> None:
    eng = FakeEngine(num_blocks=16, block_size=1, enable_caching=False)
    eng.add("A", A, max_tokens=3)
    eng.run_until_done()
    b = eng.add("B", B, max_tokens=2)
    eng.run_until_done()
    assert b.num_cached_tokens == 0
    assert eng.pool.num_cached == 0
