"""Reports, comparisons, plots and the CLI wiring, on the book's schedules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.bench.cli import register
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.records import load_schedule_csv
from kvserve.bench.report import compare, markdown
from kvserve.bench.results import build_results, load_results, records_of, save_results

WORKLOADS = BOOK_WORKLOADS


def book(schedule: str) -> dict:
    return build_results(load_schedule_csv(WORKLOADS / f"ch31-{schedule}-schedule.csv"), {"source": schedule})


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_results_json_round_trip_recomputes_the_same_summary(tmp_path: Path) -> None:
    res = book("continuous")
    save_results(res, tmp_path / "r.json")
    loaded = load_results(tmp_path / "r.json")
    assert loaded == json.loads(json.dumps(res))
    again = build_results(records_of(loaded), loaded["meta"])
    assert again["ttfts"] == res["ttfts"] and again["output_throughput"] == res["output_throughput"]


def test_markdown_states_windows_missing_tpot_and_goodput() -> None:
    text = markdown(book("continuous"))
    assert "| A | 0 | 100 | 50 | 200 | 3 | 50, 50 | length |" in text
    assert "TPOT missing (one output; excluded, not counted as zero): C." in text
    assert "| drain (first arrival → last completion) | 0.2 s | 6 | 30 | 15 |" in text
    assert "3 good of 3 completed" in text and "No violations." in text


def test_compare_gives_ratios_to_the_first_file() -> None:
    text = compare([book("serial"), book("continuous")], ["serial", "continuous"])
    assert "| output_throughput | 16.6667 | 30 (1.8×) |" in text
    assert "| mean_tpot_ms | 40 | 50 (1.25×) |" in text
    assert "| window | drain 360 ms | drain 200 ms |" in text


def test_compare_reads_vllm_bench_result_files() -> None:
    vllm = {"completed": 100, "duration": 20.0, "output_throughput": 500.0, "mean_ttft_ms": 90.0}
    text = compare([vllm, book("continuous")], ["vllm", "kvserve"])
    assert "| output_throughput | 500 | 30 (0.06×) |" in text
    assert "| gate violations | – | 0 |" in text


def test_cli_analyze_then_plot_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for schedule in ("serial", "continuous"):
        csv = WORKLOADS / f"ch31-{schedule}-schedule.csv"
        assert bench("analyze", str(csv), "--window-ms", "400", "--out", str(tmp_path / f"{schedule}.json")) == 0
    files = [str(tmp_path / "serial.json"), str(tmp_path / "continuous.json")]
    assert bench("plot", *files, "--labels", "Serial,Continuous", "--out-prefix", str(tmp_path / "fig")) == 0
    for name in ("fig-timeline.png", "fig-cdf.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert bench("compare", *files) == 0
    assert "| window output_throughput | 15 | 15 (1×) |" in capsys.readouterr().out
    # Re-analyzing a results file with a gate needs no re-run.
    assert bench("analyze", files[1], "--tpot-gate-ms", "45") == 0
    assert "| A | TPOT | 50 | 45 |" in capsys.readouterr().out


def test_cli_make_workload(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    assert bench("make-workload", "--kind", "shared-prefix", "--num-docs", "2", "--questions-per-doc", "3",
                 "--tenants", "2", "--rate", "4", "--out", str(out)) == 0  # fmt: skip
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6 and {line["cache_salt"] for line in lines} == {"tenant0", "tenant1"}


def test_every_subcommand_is_registered_with_a_handler() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="bench_command", required=True))
    for argv in (
        ["make-workload", "--out", "x"],
        ["analyze", "x.csv"],
        ["serve", "--base-url", "http://h", "--max-concurrency", "4", "--warmup", "2", "--quiet"],
        ["offline", "--max-num-seqs", "1", "--no-enable-prefix-caching"],
        ["plot", "a.json"],
        ["compare", "a.json", "b.json"],
    ):
        assert callable(parser.parse_args(argv).func)
