"""benchmarks/server_memory.py reads kvserve's breakdown from the server log's memory row: the row the
startup report writes for a real engine parses back into the figures it states, and the parts add up to
the peak."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.startup_report import engine_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import server_memory  # noqa: E402  (benchmark scripts, importable from their folder)


def test_the_breakdown_comes_from_the_logged_memory_row() -> None:
    engine = LLMEngine(EngineConfig(num_kv_blocks=8, quantization="auto"))
    log = "\n".join(["INFO some earlier line", *engine_report(engine).lines(), "INFO listening"])
    row = engine_report(engine).rows["memory"]
    weights_mib = float(row.split("weights ")[1].split(" MiB")[0])
    kv_mib = engine.cache.tensor.nbytes / 2**20
    ready_mib = float(row.split("process RSS ")[1].split(" MiB")[0])
    parts = server_memory.breakdown(log, peak_mb=ready_mib + 40.0, import_mb=200.0)
    assert parts["weights"] == weights_mib and parts["KV pool"] == pytest.approx(kv_mib, abs=0.05)
    assert parts["under load"] == pytest.approx(40.0)
    assert sum(parts.values()) == pytest.approx(ready_mib + 40.0)


def test_a_log_without_the_row_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no memory row"):
        server_memory.breakdown("INFO listening", peak_mb=500.0, import_mb=200.0)
