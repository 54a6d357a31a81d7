"""The replica router (no Ray needed): affinity keys, the hash ring, bounded load, stats aggregation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.server.replica_metrics import aggregate_stats
from kvserve.server.routing import Router, RoutingConfig, routing_key

BLOCK = 16


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [routing_key([rng.randrange(1000) for _ in range(40)], None, BLOCK, 2) for _ in range(n)]


def idle(names: list[str]) -> dict[str, int]:
    return dict.fromkeys(names, 0)


def test_key_covers_only_the_first_blocks_and_the_salt() -> None:
    prefix = list(range(2 * BLOCK))
    assert routing_key(prefix + [1, 2, 3], None, BLOCK, 2) == routing_key(prefix + [9], None, BLOCK, 2)
    assert routing_key(prefix, None, BLOCK, 2) != routing_key(prefix, "tenant-a", BLOCK, 2)
    assert routing_key(prefix, "tenant-a", BLOCK, 1) == routing_key(prefix[:BLOCK] + [7] * BLOCK, "tenant-a", BLOCK, 1)
    # Shorter than a block: nothing can be shared, so the whole prompt is the key (such prompts spread).
    assert routing_key([1, 2, 3], None, BLOCK, 2) != routing_key([1, 2, 4], None, BLOCK, 2)


def test_equal_keys_go_to_one_replica_and_keys_spread_evenly() -> None:
    names = [f"engine-{i}" for i in range(4)]
    router = Router(RoutingConfig(), names)
    sample = keys(2000)
    placed = [router.choose(k, idle(names)) for k in sample]
    assert placed == [router.choose(k, idle(names)) for k in sample]
    shares = Counter(placed)
    assert set(shares) == set(names)
    assert all(0.15 < shares[name] / len(sample) < 0.35 for name in names), shares


def test_adding_a_replica_moves_only_the_keys_it_takes_over() -> None:
    four = [f"engine-{i}" for i in range(4)]
    five = four + ["engine-4"]
    before, after = Router(RoutingConfig(), four), Router(RoutingConfig(), five)
    sample = keys(2000, seed=1)
    moved = [k for k in sample if before.choose(k, idle(four)) != after.choose(k, idle(five))]
    assert all(after.choose(k, idle(five)) == "engine-4" for k in moved)
    assert 0.1 < len(moved) / len(sample) < 0.3  # about 1/5


def test_a_replica_that_is_down_hands_its_keys_to_the_next_one_only() -> None:
    names = [f"engine-{i}" for i in range(3)]
    router = Router(RoutingConfig(), names)
    up = {"engine-0": 0, "engine-2": 0}
    for key in keys(500, seed=2):
        home = router.choose(key, idle(names))
        if home != "engine-1":
            assert router.choose(key, up) == home


def test_a_hot_key_overflows_within_the_load_bound() -> None:
    names = [f"engine-{i}" for i in range(4)]
    config = RoutingConfig(load_factor=1.25, load_slack=2)
    router = Router(config, names)
    hot = keys(1)[0]
    home = router.choose(hot, idle(names))
    loads = idle(names)
    for _ in range(40):
        chosen = router.choose(hot, loads)
        bound = config.load_factor * (sum(loads.values()) + 1) / len(loads) + config.load_slack
        assert loads[chosen] + 1 <= bound
        loads[chosen] += 1
    # The home replica fills up to the bound first, then the overflow goes elsewhere, never all of it.
    assert loads[home] == max(loads.values())
    assert loads[home] < 40 and max(loads.values()) - min(loads.values()) <= 1.25 * 40 / 4 + 2


def test_baseline_policies() -> None:
    names = ["a", "b", "c"]
    loads = {"a": 3, "b": 1, "c": 2}
    key = keys(1)[0]
    assert Router(RoutingConfig(policy="least_loaded"), names).choose(key, loads) == "b"
    rr = Router(RoutingConfig(policy="round_robin"), names)
    assert [rr.choose(key, loads) for _ in range(4)] == ["a", "b", "c", "a"]
    rand = [Router(RoutingConfig(policy="random", seed=3), names).choose(key, loads) for _ in range(2)]
    assert rand[0] == rand[1]  # seeded: reproducible comparisons


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig(policy="sticky")
    with pytest.raises(ValueError, match="load_factor"):
        RoutingConfig(load_factor=0.9)
    with pytest.raises(ValueError, match="no replica"):
        Router(RoutingConfig(), ["a"]).choose(b"k", {})


def test_aggregate_stats_sums_counters_and_recomputes_ratios() -> None:
    a = {"model": "m", "prefix_cache_hits": 3, "prefix_cache_queries": 4, "prefix_cache_hit_rate": 0.75}
    b = {"model": "m", "prefix_cache_hits": 0, "prefix_cache_queries": 4, "prefix_cache_hit_rate": 0.0}
    a |= {"steps": 10, "mean_batch_size": 2.0, "max_batch_size": 3}
    b |= {"steps": 30, "mean_batch_size": 4.0, "max_batch_size": 5}
    total = aggregate_stats([a, b])
    assert total["model"] == "m"
    assert total["prefix_cache_hits"] == 3 and total["prefix_cache_queries"] == 8
    assert total["prefix_cache_hit_rate"] == pytest.approx(3 / 8)
    assert total["mean_batch_size"] == pytest.approx((2 * 10 + 4 * 30) / 40)
    assert total["max_batch_size"] == 5 and total["steps"] == 40
