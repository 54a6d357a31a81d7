"""The offline replay through the real engine on the bundled model: the book's workload."""

from __future__ import annotations

import pytest

from kvserve.bench import workload
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.offline import OfflineConfig, replay_offline
from kvserve.bench.results import build_results

WORKLOADS = BOOK_WORKLOADS


@pytest.mark.slow
def test_book_workload_through_the_engine_gives_complete_consistent_records() -> None:
    requests = workload.load(WORKLOADS / "ch31-example.jsonl")
    records, meta = replay_offline(requests, OfflineConfig(ignore_eos=True, warmup=1, quiet=True))
    res = build_results(records, meta)
    assert (res["completed"], res["failed"]) == (3, 0)
    for record, request in zip(records, requests, strict=True):
        assert record.id == request.id and record.error is None
        assert record.output_len == request.max_tokens and record.finish_reason == "length"
        assert record.input_len == len(request.input_ids)
        assert record.arrival == pytest.approx(request.arrival_ms / 1000, abs=1e-6)
        assert record.token_times == sorted(record.token_times) and record.token_times[0] > record.arrival
    assert res["tpot_missing"] == ["C"]
    assert res["total_output_tokens"] == 6
    assert meta["engine_counters"]["generated_tokens"] == 6  # warmup excluded
