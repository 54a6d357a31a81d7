"""benchmarks/roofs.py: run as cpu_performance.py runs it (`--json`, a process per CPU path), at small sizes,
every roof is a positive finite figure, each process runs the path it was set up for, and the huge-page
buffer is on huge pages where the kernel grants them (the 4 KiB one never). No timing is asserted.

benchmarks/row_roofs.py and cpu_performance.py's shares: each engine's bytes per step are those of its own
weights, against the GGUF file's tensors read directly; a served row's share is taken against its own
engine's roof, and an engine whose weights are not given has none (n/a), on synthetic roofs and rows."""

from __future__ import annotations

import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from kvserve.kernels.cpu import build_config
from kvserve.model.registry import DEFAULT_MODEL, bundled_gguf_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_performance  # noqa: E402  (benchmark scripts, importable from their folder)
import cpu_performance_tables  # noqa: E402
import roofs  # noqa: E402
import row_roofs  # noqa: E402

# A machine with no native bf16 whose stream and GEMM rate are round figures.
SYNTHETIC_ROOFS: dict[str, Any] = {
    "native_bf16": False,
    "stream_huge": {"gb_s": 20.0},
    "gemm_bf16": {"flop_s": 1e9},
    "gemm_fp32": {"flop_s": 1e11},
}


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


def test_each_peer_weights_reads_the_gguf_files_tensors_at_its_own_size() -> None:
    """The reference: the bundled GGUF's tensors, read from the file. Dense weights read every element at
    their dtype's width, gguf ones each tensor's stored bytes; the LM head, tied to the embedding table
    where the file has no output.weight, is read once a step, the table otherwise one row a token."""
    tensors = {t.name: t for t in gguf.GGUFReader(bundled_gguf_path(DEFAULT_MODEL)).tensors}
    table = tensors["token_embd.weight"]
    untied = "output.weight" in tensors
    elements = sum(int(t.n_elements) for t in tensors.values()) - (int(table.n_elements) if untied else 0)
    stored = sum(int(t.n_bytes) for t in tensors.values()) - (int(table.n_bytes) if untied else 0)
    row_elements, vocab = (int(n) for n in table.shape)  # GGUF's shapes list the row's length first
    expected = {"bf16": (2 * elements, 2 * row_elements), "fp32": (4 * elements, 4 * row_elements),
                "gguf": (stored, int(table.n_bytes) // vocab)}  # fmt: skip
    for name, weights in row_roofs.PEER_WEIGHTS.items():
        cost = row_roofs.model_cost(DEFAULT_MODEL, weights)
        assert (cost.weight_bytes, cost.embedding_row_bytes) == expected[name], name
    gguf_cost = row_roofs.model_cost(DEFAULT_MODEL, row_roofs.PEER_WEIGHTS["gguf"])
    assert gguf_cost.weight_bytes < expected["bf16"][0] / 2  # the bug this guards: blocks counted as bf16


def _served_row(engine: str, run: str, tok_s: float, tpot_ms: float) -> dict:
    return {"engine": engine, "run": run, "output_tok_s": tok_s, "tpot_p50_ms": tpot_ms}


def test_every_served_row_takes_its_own_engines_roof_and_an_unknown_engine_has_none() -> None:
    at_once, poisson, batch1 = cpu_performance.SERVED_RUNS
    engines = ("kvserve", "llamacpp", "mystery")
    results = {"served": [_served_row(e, run, 100.0, 20.0) for e in engines for run in (at_once, poisson, batch1)]}
    weights = {"kvserve": row_roofs.kvserve_weights("bfloat16", "none"), "llamacpp": row_roofs.PEER_WEIGHTS["gguf"]}
    costs = {name: (w, row_roofs.model_cost(DEFAULT_MODEL, w)) for name, w in weights.items()}
    cpu_performance.attach_shares(results, SYNTHETIC_ROOFS, costs)
    share = {(r["engine"], r["run"]): r["share_of_roof"] for r in results["served"]}

    stream = SYNTHETIC_ROOFS["stream_huge"]["gb_s"] * 1e9
    prompt, output = cpu_performance.PROMPT_LEN, cpu_performance.OUTPUT_LEN
    requests = cpu_performance.SERVED_RUNS[at_once][0]
    for engine, (_, cost) in costs.items():
        # Batch 1 here is memory-bound (a step's bytes at 20 GB/s take longer than its FLOPs at 100 GFLOP/s):
        # its roof is the mean step's bytes over the stream.
        roof_s = statistics.fmean(cost.step_bytes([n]) / stream for n in range(prompt + 1, prompt + output))
        assert share[(engine, batch1)] == pytest.approx(roof_s * 1000 / 20.0)
        # All at once: the roofline of this engine's own bytes and FLOPs (row_roofs.batch_roof).
        gemm, _ = row_roofs.gemm_rate(SYNTHETIC_ROOFS, weights[engine])
        roof = row_roofs.batch_roof(cost, SYNTHETIC_ROOFS, gemm, requests, prompt, output)
        assert share[(engine, at_once)] == pytest.approx(100.0 / roof["output_tok_s"])
        assert share[(engine, poisson)] is None
    # The same TPOT against about a third of kvserve bf16's bytes: about a third of its share.
    assert share[("llamacpp", batch1)] < share[("kvserve", batch1)] / 2
    assert all(share[("mystery", run)] is None for run in (at_once, poisson, batch1))

    cells = {(r["engine"], r["run"]): cpu_performance_tables._served_share(r) for r in results["served"]}
    assert cells[("mystery", at_once)] == cells[("mystery", batch1)] == "n/a"
    assert cells[("kvserve", poisson)] == cells[("llamacpp", poisson)] == "–"
    assert cells[("llamacpp", batch1)] == f"{share[('llamacpp', batch1)]:.0%}"


def test_a_peer_that_dies_at_start_up_is_reported_with_its_exit_code_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A peer killed by a signal during start-up (as llama.cpp's server by SIGILL on one CPU) costs its own
    rows only: wait_until_ready raises StartError naming the signal, and the tables name the lost peer."""
    proc = cpu_performance.subprocess.Popen(["sh", "-c", "kill -ILL $$"])
    with pytest.raises(cpu_performance.StartError, match=r"^llamacpp exited during start-up \(exit code -4\)$"):
        cpu_performance.wait_until_ready(proc, "http://127.0.0.1:9", "/v1/models", "llamacpp", 30)
    failures = [{"engine": "llamacpp", "round": 0, "error": "exited (exit code -4)"}]
    cpu_performance_tables.print_start_failures(failures)
    assert "no rows for llamacpp (round 1): exited (exit code -4)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "native_bf16, bf16_rate, weights, kind",
    [
        (True, 1e12, row_roofs.Weights("bfloat16", False, "bfloat16"), "bf16"),
        # kvserve's `auto` with bf16 activations: panels dequantized to bf16 and multiplied as such.
        (True, 1e12, row_roofs.Weights("bfloat16", True, "bfloat16"), "bf16"),
        # Native bf16 slower than float32 FMAs (Intel without AMX): bf16 operands widened, at the fp32 rate.
        (True, 1e10, row_roofs.Weights("bfloat16", False, "bfloat16"), "fp32"),
        (False, 1e12, row_roofs.Weights("bfloat16", True, "bfloat16"), "fp32"),
        (False, 1e12, row_roofs.Weights("bfloat16", False, "bfloat16"), "fp32"),
        (True, 1e12, row_roofs.PEER_WEIGHTS["gguf"], "fp32"),
        (True, 1e12, row_roofs.PEER_WEIGHTS["fp32"], "fp32"),
    ],
)
def test_the_gemm_roof_is_the_rate_the_products_run_at(native_bf16, bf16_rate, weights, kind):
    roofs = {**SYNTHETIC_ROOFS, "native_bf16": native_bf16, "gemm_bf16": {"flop_s": bf16_rate}}
    rate, named = row_roofs.gemm_rate(roofs, weights)
    assert named == kind and rate == roofs[f"gemm_{kind}"]["flop_s"]
