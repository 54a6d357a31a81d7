"""benchmarks/roofs.py: run as cpu_performance.py runs it (`--json`, a process per CPU path), at small sizes,
every roof is a positive finite figure, each process runs the path it was set up for, and the huge-page
buffer is on huge pages where the kernel grants them (the 4 KiB one never). No timing is asserted."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from kvserve.kernels.cpu import build_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import roofs  # noqa: E402  (a benchmark script, importable from its folder)


@pytest.mark.parametrize("path", [isa.name for isa in build_config.executable_isas()])
def test_every_roof_of_every_path_is_a_positive_finite_figure(path: str) -> None:
    measured = roofs.measure_path(path, dict(os.environ), gemm_n=256, stream_mib=8)
    assert measured["path"] == path
    figures = [measured[g]["flop_s"] for g in ("gemm_bf16", "gemm_fp32")]
    figures += [measured[s]["gb_s"] for s in ("stream_huge", "stream_4k")]
    assert all(math.isfinite(f) and f > 0 for f in figures), figures
    assert measured["gemm_fp32"]["n"] <= 256
    if measured["transparent_huge_pages"] in ("always", "madvise"):
        assert measured["stream_huge"]["huge_page_share"] > 0.5
    assert measured["stream_4k"]["huge_page_share"] in (0.0, None)


def test_a_forced_path_caps_torch_and_the_best_path_runs_unforced() -> None:
    executable = build_config.executable_isas()
    best = roofs.path_environment(executable[-1].name, {"KVSERVE_CPU_ISA": executable[-1].name})
    assert "KVSERVE_CPU_ISA" not in best
    generic = roofs.path_environment("generic", {})
    if len(executable) > 1:
        assert generic["KVSERVE_CPU_ISA"] == "generic"
        assert generic["ATEN_CPU_CAPABILITY"] == "default"
