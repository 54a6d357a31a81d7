"""BlockPool and scheduler mechanics of prefix caching: identity checks, LRU eviction, counters."""

from __future__ import annotations

import pytest

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.prefix_cache import BlockIdentity, CacheKey, block_identity, extend_block_hashes, identity_at
from tests.prefix_cache_fakes import FakeEngine

KEY = CacheKey("fake-model").digest()


def chain(token_ids: list[int], block_size: int) -> list[BlockIdentity]:
    hashes: list[bytes] = []
    num_blocks = len(token_ids) // block_size
    extend_block_hashes(hashes, token_ids, num_blocks, block_size, KEY)
    return [identity_at(hashes, token_ids, i, block_size) for i in range(num_blocks)]


def cached_chain(pool: BlockPool, token_ids: list[int], block_size: int) -> list[int]:
    """Allocate, index and free a chain of blocks, as a finished request leaves them."""
    blocks = [pool.allocate() for _ in range(len(token_ids) // block_size)]
    for block, identity in zip(blocks, chain(token_ids, block_size), strict=True):
        pool.register(block, identity)
    pool.free_blocks(blocks)
    return blocks


def test_lookup_compares_tokens_not_only_the_hash() -> None:
    pool = BlockPool(4)
    [block] = cached_chain(pool, [1, 2], 2)
    real = pool.identity(block)
    assert real is not None and pool.lookup(real) == block
    forged = BlockIdentity(real.hash, real.parent, (1, 3))  # a hash collision with other tokens
    assert pool.lookup(forged) is None


def test_the_hash_covers_parent_position_tokens_and_key() -> None:
    base = block_identity(None, KEY, 0, [1, 2])
    assert block_identity(None, KEY, 1, [1, 2]).hash != base.hash
    assert block_identity(b"\1" * 32, KEY, 0, [1, 2]).hash != base.hash
    assert block_identity(None, KEY, 0, [2, 1]).hash != base.hash
    assert block_identity(None, CacheKey("fake-model", cache_salt="t").digest(), 0, [1, 2]).hash != base.hash
    assert block_identity(None, CacheKey("fake-model", adapter_id="lora").digest(), 0, [1, 2]).hash != base.hash
    assert block_identity(None, KEY, 0, [1, 2]) == base


def test_a_duplicate_block_stays_private_and_is_reused_first() -> None:
    pool = BlockPool(4)
    [first] = cached_chain(pool, [1, 2], 2)
    duplicate = pool.allocate()
    pool.register(duplicate, chain([1, 2], 2)[0])
    assert pool.identity(duplicate) is None and pool.num_cached == 1
    pool.free(duplicate)
    assert pool.allocate() == duplicate  # identity-less free blocks go before cached ones
    assert pool.lookup(chain([1, 2], 2)[0]) == first


def test_eviction_is_lru_and_takes_a_chains_tail_before_its_head() -> None:
    pool = BlockPool(4)
    old = cached_chain(pool, [1, 2, 3, 4], 2)
    new = cached_chain(pool, [5, 6, 7, 8], 2)
    # The 4 blocks are reused in this order: the older chain first, each chain tail first.
    assert [pool.allocate() for _ in range(4)] == [old[1], old[0], new[1], new[0]]
    assert pool.stats.evictions == 4 and pool.num_cached == 0


def test_a_hit_revives_a_free_block_out_of_the_free_list() -> None:
    pool = BlockPool(2)
    [block] = cached_chain(pool, [1, 2], 2)
    pool.incref(block)
    assert not pool.is_free(block) and pool.num_free == 1
    assert pool.allocate() != block
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()


def test_double_free_is_refused() -> None:
    pool = BlockPool(2)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(block)


def test_retained_cached_blocks_never_keep_a_new_request_out() -> None:
    eng = FakeEngine(num_blocks=8, block_size=2)
    eng.add("old", list(range(15)), max_tokens=1)
    eng.run_until_done()
    assert eng.pool.num_cached == 7 and eng.pool.num_free == 8
    new = eng.add("new", list(range(100, 115)), max_tokens=1)
    eng.run_until_done()
    assert new.num_cached_tokens == 0 and eng.pool.stats.evictions == 7


def test_counters_count_each_request_once_even_while_it_waits_for_blocks() -> None:
    eng = FakeEngine(num_blocks=8, block_size=1)
    eng.add("A", [1, 2, 3, 4, 5, 6], max_tokens=2)
    eng.step()
    eng.add("B", [1, 2, 3, 9], max_tokens=1)  # needs 1 new block + the watermark: waits for A
    eng.step()
    assert eng.scheduler.waiting
    eng.run_until_done()
    assert eng.pool.stats.queries == 6 + 4
    assert eng.pool.stats.hits == 3
