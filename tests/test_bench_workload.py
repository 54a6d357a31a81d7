"""Workload files and generators: validation, round trips, determinism, rates."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from kvserve.bench import generators, workload
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.generators import LengthDist
from kvserve.bench.workload import SAFE_TOKEN_RANGE, WorkloadRequest

WORKLOADS = BOOK_WORKLOADS


def test_the_books_workload_loads() -> None:
    requests = workload.load(WORKLOADS / "ch31-example.jsonl")
    assert [(r.id, r.arrival_ms, r.input_ids, r.max_tokens) for r in requests] == [
        ("A", 0, [10, 11, 12, 13], 3),
        ("B", 20, [10, 11, 12, 14], 2),
        ("C", 40, [20, 21], 1),
    ]


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    requests = [
        WorkloadRequest("a", 5.5, 4, prompt="hi", tenant="t1", cache_salt="t1", accept={"contains": "x"}),
        WorkloadRequest("b", 0, 2, input_len=7, ignore_eos=True),
    ]
    workload.save(requests, tmp_path / "w.jsonl")
    assert workload.load(tmp_path / "w.jsonl") == sorted(requests, key=lambda r: r.arrival_ms)


@pytest.mark.parametrize(
    "line, message",
    [
        ({"id": "a", "arrival_ms": 0, "max_tokens": 1}, "exactly one of"),
        ({"id": "a", "arrival_ms": 0, "max_tokens": 1, "prompt": "x", "input_len": 3}, "exactly one of"),
        ({"id": "a", "arrival_ms": -1, "max_tokens": 1, "prompt": "x"}, "arrival_ms"),
        ({"id": "a", "arrival_ms": 0, "max_tokens": 0, "prompt": "x"}, "max_tokens"),
        ({"id": "a", "arrival_ms": 0, "max_tokens": 1, "input_ids": []}, "input_ids"),
        ({"id": "a", "arrival_ms": 0, "max_tokens": 1, "prompt": "x", "colour": 1}, "unknown fields"),
        ({"id": "a", "arrival_ms": 0, "max_tokens": 1, "prompt": "x", "accept": {"regex": "("}}, "regex"),
        ({"arrival_ms": 0, "max_tokens": 1, "prompt": "x"}, "missing field 'id'"),
    ],
)
def test_invalid_lines_are_rejected_with_their_line_number(tmp_path: Path, line: dict, message: str) -> None:
    import json

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        workload.load(path)
    assert ":1:" in str(info.value)


def test_duplicate_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        workload.validate([WorkloadRequest("a", 0, 1, prompt="x"), WorkloadRequest("a", 1, 1, prompt="y")])


def test_input_len_ids_are_seeded_per_request_and_in_the_safe_range() -> None:
    a, b = WorkloadRequest("a", 0, 1, input_len=50), WorkloadRequest("b", 0, 1, input_len=50)
    ids = workload.token_ids_for(a, seed=3)
    assert ids == workload.token_ids_for(a, seed=3) and len(ids) == 50
    assert ids != workload.token_ids_for(b, seed=3) and ids != workload.token_ids_for(a, seed=4)
    assert all(SAFE_TOKEN_RANGE[0] <= t < SAFE_TOKEN_RANGE[1] for t in ids)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_arrivals_have_the_requested_rate_and_burstiness(cv: float) -> None:
    times = generators.arrival_times_ms(4000, rate=20.0, cv=cv, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0
    assert statistics.mean(gaps) == pytest.approx(50.0, rel=0.1)  # 1000 ms / 20 per s
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert generators.arrival_times_ms(3, float("inf")) == [0.0, 0.0, 0.0]


def test_length_distributions() -> None:
    import random

    rng = random.Random(0)
    assert LengthDist.parse("64").sample(rng) == 64
    assert all(10 <= LengthDist.parse("uniform:10:20").sample(rng) <= 20 for _ in range(100))
    assert all(LengthDist.parse("normal:3:50").sample(rng) >= 1 for _ in range(100))
    for bad in ("0", "uniform:5:2", "zipf:1:2", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: generators.random_workload(20, 5.0, LengthDist("uniform", 8, 16), LengthDist("fixed", 4), 2, seed),
        lambda seed: generators.shared_prefix_workload(3, 4, 5.0, LengthDist.parse("8"), num_tenants=2, seed=seed),
        lambda seed: generators.copy_workload(6, 5.0, seed=seed),
    ],
)  # fmt: skip
def test_generators_are_deterministic_by_seed(make) -> None:
    assert make(7) == make(7)
    assert make(7) != make(8)
    workload.validate(make(7))


def test_shared_prefix_workload_shares_documents_within_tenants_only() -> None:
    requests = generators.shared_prefix_workload(2, 6, 10.0, LengthDist.parse("8"), num_tenants=3, seed=0)
    assert len(requests) == 12
    assert {r.tenant for r in requests} == {"tenant0", "tenant1", "tenant2"}
    assert all(r.cache_salt == r.tenant for r in requests)
    doc0 = [r.prompt for r in requests if r.id.startswith("d0")]
    prefix = doc0[0].split("\n\nQuestion")[0]
    assert all(p.startswith(prefix) for p in doc0)


def test_copy_workload_asks_for_text_from_the_prompt() -> None:
    for r in generators.copy_workload(4, 1.0, passage_words=30, seed=2):
        assert r.accept is not None and r.max_tokens >= 45
        if r.prompt.startswith("Repeat"):
            assert r.accept["contains"] in r.prompt
