"""Chapter 31's figures, derived from the book's shipped schedules (Table 31.1 as CSV files)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvserve.bench.cli import register
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.metrics import Gates
from kvserve.bench.records import load_schedule_csv
from kvserve.bench.results import build_results

WORKLOADS = BOOK_WORKLOADS


def analyzed(schedule: str, **kwargs) -> dict:
    records = load_schedule_csv(WORKLOADS / f"ch31-{schedule}-schedule.csv")
    return build_results(records, {"source": schedule}, **kwargs)


def by_id(res: dict, key: str) -> dict:
    return dict(zip(res["ids"], res[key], strict=True))


def ms(values: dict) -> dict:
    return {k: None if v is None else round(v * 1000, 6) for k, v in values.items()}


@pytest.mark.parametrize(
    "schedule, ttft, tpot",
    [
        ("serial", {"A": 100, "B": 240, "C": 320}, {"A": 40, "B": 40, "C": None}),
        ("continuous", {"A": 100, "B": 130, "C": 140}, {"A": 50, "B": 50, "C": None}),
    ],
)
def test_table_31_2(schedule: str, ttft: dict, tpot: dict) -> None:
    res = analyzed(schedule)
    assert ms(by_id(res, "ttfts")) == ttft
    assert ms(by_id(res, "tpots")) == tpot


@pytest.mark.parametrize("schedule, mean_tpot", [("serial", 40), ("continuous", 50)])
def test_tpot_of_c_is_missing_and_excluded_from_averages(schedule: str, mean_tpot: float) -> None:
    res = analyzed(schedule)
    assert res["tpot_missing"] == ["C"]
    # A zero for C would give 80/3 or 100/3; the average covers A and B only.
    assert res["mean_tpot_ms"] == mean_tpot
    assert res["median_tpot_ms"] == mean_tpot


@pytest.mark.parametrize("schedule, duration, rate", [("serial", 0.360, 6 / 0.360), ("continuous", 0.200, 30.0)])
def test_example_31_4_drain_window(schedule: str, duration: float, rate: float) -> None:
    res = analyzed(schedule)
    assert res["duration"] == pytest.approx(duration)
    assert res["total_output_tokens"] == 6
    assert res["output_throughput"] == pytest.approx(rate)
    assert round(res["output_throughput"], 3) == {"serial": 16.667, "continuous": 30.0}[schedule]


@pytest.mark.parametrize("schedule", ["serial", "continuous"])
@pytest.mark.parametrize("window_ms, rate", [(400, 15.0), (500, 12.0)])  # Example 31.4; exercise 2
def test_fixed_window_gives_both_schedules_the_same_rate(schedule: str, window_ms: float, rate: float) -> None:
    res = analyzed(schedule, window_ms=window_ms)
    window = res["window"]
    assert (window["kind"], window["start_ms"], window["end_ms"]) == ("fixed", 0, window_ms)
    assert window["output_tokens"] == 6
    assert window["output_throughput"] == pytest.approx(rate)
    # The drain-window figure is still reported beside it, with its own denominator.
    assert res["output_throughput"] == pytest.approx(6 / res["duration"])


def test_a_window_shorter_than_the_drain_counts_only_tokens_inside_it() -> None:
    # Serial in [0, 300] ms: A's 100/140/180 and B's 260/300 (the end is inclusive); C's 360 is out.
    window = analyzed("serial", window_ms=300)["window"]
    assert (window["output_tokens"], window["completed"]) == (5, 2)
    assert window["output_throughput"] == pytest.approx(5 / 0.3)


@pytest.mark.parametrize(
    "schedule, dollars, per_1k",
    [("serial", 0.0002, 0.033333), ("continuous", 0.000111111, 0.018519)],
)
def test_cost_over_each_drain_window(schedule: str, dollars: float, per_1k: float) -> None:
    cost = analyzed(schedule, price_per_hour=2.0)["cost"]
    assert cost["dollars"] == pytest.approx(2 * {"serial": 0.360, "continuous": 0.200}[schedule] / 3600)
    assert round(cost["dollars"], 9) == dollars
    assert round(cost["per_1k_output_tokens"], 6) == per_1k


@pytest.mark.parametrize(
    "schedule, e2e", [("serial", {"A": 180, "B": 280, "C": 320}), ("continuous", {"A": 200, "B": 180, "C": 140})]
)
def test_exercise_1_complete_request_durations(schedule: str, e2e: dict) -> None:
    assert ms(by_id(analyzed(schedule), "e2els")) == e2e


def test_exercise_6_a_gate_violation_is_reported_not_traded() -> None:
    """Continuous drains faster (30 vs 16.667 tok/s) but widens A's and B's token spacing: under a
    45 ms TPOT bound it violates the contract, and more throughput does not buy that back."""
    gates = Gates(tpot_ms=45)
    serial, continuous = analyzed("serial", gates=gates), analyzed("continuous", gates=gates)
    assert continuous["output_throughput"] > serial["output_throughput"]
    assert serial["gates"]["violations"] == []
    assert [(v["id"], v["metric"], v["value_ms"]) for v in continuous["gates"]["violations"]] == [
        ("A", "tpot", 50),
        ("B", "tpot", 50),
    ]
    # Throughput is reported unchanged beside the violation; goodput counts only C (missing TPOT
    # cannot violate a pace bound).
    assert continuous["output_throughput"] == pytest.approx(30)
    assert continuous["goodput"]["good_ids"] == ["C"]
    assert continuous["request_goodput"] == pytest.approx(1 / 0.2)


def test_ttft_gate_at_exactly_the_bound_passes() -> None:
    res = analyzed("continuous", gates=Gates(ttft_ms=130))
    assert [v["id"] for v in res["gates"]["violations"]] == ["C"]  # B's 130 ms meets a 130 ms bound


def test_cli_analyze_prints_the_book_figures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "serial.json"
    args = parser.parse_args(
        ["analyze", str(WORKLOADS / "ch31-serial-schedule.csv"), "--window-ms", "400", "--price-per-hour", "2",
         "--ttft-gate-ms", "200", "--out", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "| C | 40 | 320 | missing | 320 | 1 | – | length |" in text
    assert "| drain (first arrival → last completion) | 0.36 s | 6 | 16.6667 |" in text
    assert "| fixed [0, 400] ms | 0.4 s | 6 | 15 |" in text
    assert "| B | TTFT | 240 | 200 |" in text
    assert out.exists() and out.with_suffix(".md").exists()
