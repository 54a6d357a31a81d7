"""Metrics beyond the book's figures: chunked emissions, failures, goodput with accept criteria."""

from __future__ import annotations

import pytest

from kvserve.bench.metrics import Gates, emission_gaps, fixed_window, request_metrics, summarize
from kvserve.bench.records import RequestRecord


def rec(id: str, arrival_ms: float, emissions_ms: list[float], **kw) -> RequestRecord:
    return RequestRecord(id=id, arrival=arrival_ms / 1000, token_times=[t / 1000 for t in emissions_ms], **kw)


def test_tokens_in_one_chunk_are_one_emission_for_itl_but_count_for_tpot() -> None:
    # Four tokens: one at 100 ms, then three delivered together at 160 ms (e.g. accepted drafts).
    m = request_metrics(rec("a", 0, [100, 160, 160, 160]))
    assert emission_gaps([0.1, 0.16, 0.16, 0.16]) == pytest.approx([0.06])
    assert m.itls == [0.06]
    assert m.tpot == pytest.approx(0.02)  # (160 - 100) / (4 - 1)
    assert (m.ttft, m.e2el) == (0.1, 0.16)


def test_failed_requests_are_counted_and_excluded_from_latencies() -> None:
    records = [rec("ok", 0, [50, 70]), rec("bad", 10, [], error="HTTP 500"), rec("cut", 10, [60], error="reset")]
    s = summarize(records)
    assert (s["completed"], s["failed"]) == (1, 2)
    assert s["errors"] == ["", "HTTP 500", "reset"]
    assert s["ttfts"] == [0.05, None, None]
    assert s["mean_ttft_ms"] == 50
    assert s["total_output_tokens"] == 2  # a failed request's partial output is not throughput
    assert s["duration"] == pytest.approx(0.07)


def test_goodput_needs_an_acceptable_answer_and_every_gate() -> None:
    refund = {"contains": "750"}
    records = [
        rec("right", 0, [100, 120], text="750 yuan", accept=refund),
        rec("wrong", 0, [100, 120], text="600 yuan", accept=refund),
        rec("slow", 0, [400, 420], text="750 yuan", accept=refund),
        rec("free", 0, [100, 110], text="anything"),  # no criterion: acceptable once complete
    ]
    s = summarize(records, gates=Gates(ttft_ms=300), price_per_hour=3.6)
    g = s["goodput"]
    assert (g["with_criterion"], g["accepted"], g["within_gates"], g["good"]) == (3, 3, 3, 2)
    assert g["good_ids"] == ["right", "free"] and g["rejected_ids"] == ["wrong"]
    assert [v["id"] for v in s["gates"]["violations"]] == ["slow"]
    assert s["request_goodput"] == pytest.approx(2 / 0.42)
    # Raw throughput still counts all eight tokens: goodput sits beside it, not inside it.
    assert s["output_throughput"] == pytest.approx(8 / 0.42)
    assert s["cost"]["dollars"] == pytest.approx(3.6 * 0.42 / 3600)
    assert s["cost"]["per_acceptable_answer"] == pytest.approx(s["cost"]["dollars"] / 2)


def test_fixed_window_with_its_own_start() -> None:
    records = [rec("a", 0, [100, 200, 300]), rec("b", 250, [350, 450])]
    s = summarize(records, window=fixed_window(records, 0.2, start_s=0.15))
    w = s["window"]
    assert (w["start_ms"], w["end_ms"]) == (150, 350)
    assert w["output_tokens"] == 3  # 200, 300, 350
    assert w["completed"] == 1  # a ends at 300; b at 450, outside
    assert s["goodput"]["good_ids"] == ["a"]


def test_vllm_field_names_and_per_request_arrays_are_present() -> None:
    s = summarize([rec("a", 0, [10, 20], input_len=4)])
    for name in (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ):
        assert name in s
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99", "min", "max"):
            assert f"{stat}_{metric}_ms" in s
    for array in ("ttfts", "tpots", "itls", "e2els", "output_lens", "input_lens", "errors", "generated_texts"):
        assert len(s[array]) == 1
    assert s["total_token_throughput"] == pytest.approx(6 / 0.02)


def test_an_empty_run_has_no_rates_rather_than_a_division_by_zero() -> None:
    s = summarize([rec("bad", 0, [], error="refused")])
    assert (s["completed"], s["output_throughput"], s["mean_ttft_ms"]) == (0, None, None)
