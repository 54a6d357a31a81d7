"""The tables benchmarks/cpu_performance.py prints from its results: the roofs, the offline and batch-1
rows, the bf16-vs-fp32 agreement and the served rows, each row with its share of its roof."""

from __future__ import annotations

import statistics
from typing import Any

import dtype_agreement
import roofs
from offline_throughput import print_rounds


def _fmt(value: Any, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def print_tables(results: dict[str, Any]) -> None:
    roofs.print_table(results["roofs"])
    print(
        f"\nkvserve ran {results['cpu_path']}, {results['dtype']}, quantization {results['quantization']} "
        f"({'weights in GGUF blocks' if results['quantized'] else 'dense weights'}); rows' roofs take this path's "
        "huge-page stream and the GEMM rate each engine's weights can reach on it:"
    )
    for engine, roof in results["row_roofs"].items():
        w = roof["weights"]
        print(
            f"- {engine}: {w['dtype']}{', matrices in GGUF blocks' if w['quantized'] else ''}, K/V {w['kv_dtype']}: "
            f"a decode step reads {roof['weight_bytes_per_step'] / 1e6:.1f} MB of weights; {roof['gemm']} GEMM"
        )
    peers = {r["engine"] for r in results["served"]} - set(results["row_roofs"])
    if peers:
        print(f"- {', '.join(sorted(peers))}: weights not given (--peer-weights), share n/a")
    if "offline" in results:
        print_offline_rows(results)
    if "batch1" in results:
        print_batch1(results["batch1"], results["row_roofs"]["kvserve"]["batch1"])
    if "bf16_vs_fp32" in results:
        dtype_agreement.print_table(results["bf16_vs_fp32"])
    if results["served"]:
        print_served_rows(results, results["served"])
    print_start_failures(results.get("peer_start_failures", []))


def print_start_failures(failures: list[dict[str, Any]]) -> None:
    for failure in failures:
        print(f"no rows for {failure['engine']} (round {failure['round'] + 1}): {failure['error']}")


def print_offline_rows(results: dict[str, Any]) -> None:
    print(f"\n## offline 64 x 128/128, {results['dtype']}, {results['threads']} threads")
    print_rounds(results["offline"])


def print_batch1(b1: dict[str, Any], roof: dict[str, Any]) -> None:
    print(
        f"\n## batch-1 decode: TPOT p50 {b1['tpot_p50_ms']:.1f} ms (mean {b1['tpot_ms']:.1f}), "
        f"roof {roof['tpot_ms']:.1f} ms ({roof['bound']}-bound): {_share(b1['share_of_roof'])} of the roof; "
        f"per step {b1['profiled_step_ms']:.1f} ms under the profiler, of which matmuls "
        f"{b1['matmul_ms_per_step']:.1f} ms, everything else {b1['overhead_ms_per_step']:.1f} ms"
    )


def print_served_rows(results: dict[str, Any], served: list[dict[str, Any]]) -> None:
    print("\n## served (kvserve replay client, token-id prompts, ignore EOS)")
    print(
        "| run | engine | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | failed | kvserve tok/s ratio "
        "| share of roof | machine GB/s before | client CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {(r["run"], r["repeat"]): r["output_tok_s"] for r in served if r["engine"] == "kvserve"}
    repeats = 1 + max(r["repeat"] for r in served)
    for r in served:
        ratio = base.get((r["run"], r["repeat"]), 0) / r["output_tok_s"] if r["output_tok_s"] else None
        label = r["run"] + (f" #{r['repeat'] + 1}" if repeats > 1 else "")
        print(
            f"| {label} | {r['engine']} | {_fmt(r['output_tok_s'])} | {_fmt(r['ttft_p50_ms'])} / "
            f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['tpot_p50_ms'])} / {_fmt(r['tpot_p99_ms'])} | {r['failed']} | "
            f"{_fmt(ratio, 2)} | {_served_share(r)} | {_fmt(r['machine_memory_gb_s'])} | "
            f"{r['client_cpu_s']:.2f} |"
        )
    print(
        "share of roof: out tok/s of the all-at-once row against row_roofs.batch_roof, the batch-1 row's TPOT p50 "
        "against the batch-1 roof; every engine against its own weights' roof on kvserve's path (n/a: its weights "
        "not given); Poisson rows have none"
    )
    if repeats > 1:
        print_served_medians(served, base)
    print(f"\nkvserve server peak RSS: {_fmt(results.get('kvserve_server_peak_rss_mb'))} MB")


def _served_share(row: dict[str, Any]) -> str:
    """A served row's share of its roof: n/a where its engine's weights are unknown, – where it has no roof."""
    return "n/a" if row["roof_weights"] is None else _share(row["share_of_roof"])


def print_served_medians(served: list[dict[str, Any]], base: dict[tuple[str, int], float]) -> None:
    """Per run and engine, the median over repeats of tok/s and of the ratio kvserve / engine (each
    ratio within one repeat)."""
    print("\n| run | engine | median out tok/s | median kvserve tok/s ratio | repeats |\n|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in served:
        groups.setdefault((r["run"], r["engine"]), []).append(r)
    for (run, engine), rows in groups.items():
        ratios = [base[(run, r["repeat"])] / r["output_tok_s"] for r in rows if r["output_tok_s"]]
        tok_s = statistics.median(r["output_tok_s"] for r in rows)
        ratio = statistics.median(ratios) if ratios else None
        print(f"| {run} | {engine} | {tok_s:.1f} | {_fmt(ratio, 2)} | {len(rows)} |")
