"""Choosing an engine replica for a request: prefix affinity on a consistent-hash ring with bounded load.

Prefix caching only pays when a request lands on the replica that already holds its prefix's KV
blocks, so the router sends equal prefixes to the same replica: the key is the chained hash of the
prompt's first `prefix_blocks` full blocks under the tenant's cache salt (the same chain the engine's
prefix cache uses, prefix_cache.py), placed on a hash ring with `virtual_nodes` points per replica.
Adding or removing a replica moves only the keys of the ring arcs it gains or loses (about 1/N).

A hot prefix would pile onto one replica, so the load is bounded (consistent hashing with bounded
loads, Mirrokni et al. 2016): a replica may take a request only while its load + 1 stays within
load_factor x mean load (this request included) + load_slack; otherwise the request walks on along
the ring to the next replica under the bound. The walk order is fixed per key, so a hot prefix's
overflow also lands on the same second replica, which then caches it too. Some replica is always
under the bound (the least loaded is at or below the mean), so the walk always ends.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvserve.engine.prefix_cache import CacheKey, block_identity, extend_block_hashes

POLICIES = ("prefix_affinity", "random", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix_affinity"
    # Full blocks of the prompt that make the affinity key. More blocks tell more prefixes apart (a
    # shared system prompt then no longer pins every chat to one replica) but need longer prompts.
    prefix_blocks: int = 2
    virtual_nodes: int = 64
    load_factor: float = 1.25
    load_slack: int = 4
    seed: int = 0  # the random policy's generator (reproducible comparisons)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        if self.prefix_blocks < 1 or self.virtual_nodes < 1:
            raise ValueError("prefix_blocks and virtual_nodes must be >= 1")
        # load_slack >= 1 keeps the least-loaded replica under the bound, so the walk always ends.
        if self.load_factor < 1 or self.load_slack < 1:
            raise ValueError("load_factor must be >= 1 and load_slack >= 1")


def routing_key(token_ids: Sequence[int], cache_salt: str | None, block_size: int, prefix_blocks: int) -> bytes:
    """The hash of the prompt's first prefix_blocks full blocks under its salt. A prompt shorter than one
    block can share nothing, so it is keyed by all its tokens: such prompts spread over the ring."""
    # The engine mixes the model fingerprint in too; every replica serves one model, so it is left out.
    key_digest = CacheKey(model_fingerprint="", cache_salt=cache_salt).digest()
    full = min(len(token_ids) // block_size, prefix_blocks)
    if full == 0:
        return block_identity(None, key_digest, 0, list(token_ids)).hash
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(token_ids), full, block_size, key_digest)
    return hashes[-1]


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class HashRing:
    def __init__(self, replicas: Sequence[str], virtual_nodes: int) -> None:
        points = sorted((_point(f"{name}#{v}".encode()), name) for name in replicas for v in range(virtual_nodes))
        self._points = [p for p, _ in points]
        self._owners = [name for _, name in points]
        self.replicas = list(dict.fromkeys(replicas))

    def walk(self, key: bytes) -> Iterator[str]:
        """Every replica once, in ring order starting at the key's position."""
        start = bisect.bisect(self._points, _point(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.replicas):
                    return


class Router:
    def __init__(self, config: RoutingConfig, replicas: Sequence[str]) -> None:
        if not replicas:
            raise ValueError("the router needs at least one replica")
        self.config = config
        self.ring = HashRing(replicas, config.virtual_nodes)
        self._rng = random.Random(config.seed)
        self._turn = itertools.count()

    def choose(self, key: bytes, loads: Mapping[str, int]) -> str:
        """The replica for a request with this key. `loads`: requests in flight on each replica that
        may take work now (replicas that are down are left out); it must not be empty."""
        if not loads:
            raise ValueError("no replica is available")
        policy = self.config.policy
        if policy == "random":
            return self._rng.choice(sorted(loads))
        if policy == "round_robin":
            names = sorted(loads)
            return names[next(self._turn) % len(names)]
        least = min(loads, key=lambda name: (loads[name], name))
        if policy == "least_loaded":
            return least
        bound = self.config.load_factor * (sum(loads.values()) + 1) / len(loads) + self.config.load_slack
        return next((name for name in self.ring.walk(key) if name in loads and loads[name] + 1 <= bound), least)
