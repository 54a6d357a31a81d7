"""A fixed pool of KV blocks: reference counts, an LRU free list, and the prefix-cache index.

Invariants:
- a block is in `_free` exactly when its reference count is 0;
- `_cached[h] == b` implies `_identity[b].hash == h` and block b's K/V were written for that identity;
  a block is only written while it has one owner and no identity (full shared blocks are read-only;
  a shared partial block is copied before a write, see Scheduler), so cached contents never change;
- a free block keeps its identity until it is handed out again (eviction), so a later request can
  still hit it; blocks with no identity sit at the front of the free list and are reused first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.engine.prefix_cache import BlockIdentity


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from cached blocks
    evictions: int = 0  # cached blocks whose identity was dropped to reuse them

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._identity: list[BlockIdentity | None] = [None] * num_blocks
        # Eviction order: first key is evicted first (least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV block pool exhausted (the scheduler must check num_free first)")
        block, _ = self._free.popitem(last=False)
        self._evict(block)
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        count = self._ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"double free of KV block {block}")
        self._ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
            if self._identity[block] is None:
                self._free.move_to_end(block, last=False)

    def free_blocks(self, blocks: list[int]) -> None:
        # Tail first: a chain's last blocks become older in the LRU order and are evicted before its head.
        for block in reversed(blocks):
            self.free(block)

    def lookup(self, identity: BlockIdentity) -> int | None:
        """The block holding exactly this identity, or None. Never returns a block whose tokens differ."""
        block = self._cached.get(identity.hash)
        if block is None or self._identity[block] != identity:
            return None
        return block

    def register(self, block: int, identity: BlockIdentity) -> None:
        """Offer a full block whose K/V have been written to the cache index."""
        if not self.enable_caching or self._identity[block] is not None:
            return
        if identity.hash in self._cached:
            return  # an identical block is already indexed; this one stays private
        self._identity[block] = identity
        self._cached[identity.hash] = block

    def identity(self, block: int) -> BlockIdentity | None:
        return self._identity[block]

    def _evict(self, block: int) -> None:
        identity = self._identity[block]
        if identity is not None:
            self._identity[block] = None
            if self._cached.get(identity.hash) == block:
                del self._cached[identity.hash]
                self.stats.evictions += 1
