"""The book's experiment for real (§31.2, Table 31.2): one workload, served serially
(max_num_seqs=1) and with continuous batching, TTFT/TPOT per request from measured timestamps.

By default both runs use the in-process engine on the bundled model (`kvserve bench offline`'s
replay); with --serial-url/--continuous-url they replay against two live OpenAI-compatible servers
instead (start kvserve with --max-num-seqs 1 for the serial one). Every output runs to max_tokens
(ignore_eos), so both schedules emit the same token counts, as in Example 31.1.

    python benchmarks/serial_vs_continuous.py                       # the book's A, B, C
    python benchmarks/serial_vs_continuous.py --workload W.jsonl --window-ms 5000

Writes benchmarks/results/serial_vs_continuous-<time>.json (both results files, in full) and a
timeline PNG beside it (one panel per schedule, like Figure 31.1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvserve.bench import workload
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.offline import OfflineConfig, replay_offline
from kvserve.bench.plot import plot_timeline
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.bench.report import fmt
from kvserve.bench.results import build_results

ROOT = Path(__file__).resolve().parents[1]
BOOK_WORKLOAD = BOOK_WORKLOADS / "ch31-example.jsonl"


def run_schedule(name: str, requests: list[workload.WorkloadRequest], args: argparse.Namespace) -> dict[str, Any]:
    url = args.serial_url if name == "serial" else args.continuous_url
    if url:
        cfg = ReplayConfig(url, model=args.model, warmup=args.warmup, ignore_eos=True, quiet=True)
        records, meta = replay(requests, cfg)
    else:
        max_num_seqs = 1 if name == "serial" else args.max_num_seqs
        cfg = OfflineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=max_num_seqs,
            warmup=args.warmup,
            ignore_eos=True,
            quiet=True,
        )
        records, meta = replay_offline(requests, cfg)
    return build_results(records, {**meta, "schedule": name}, window_ms=args.window_ms)


def table_31_2(serial: dict[str, Any], continuous: dict[str, Any]) -> str:
    """Table 31.2's columns, measured (ms; TPOT missing for one output)."""

    def ms(value: float | None, missing: str = "missing") -> str:
        return missing if value is None else f"{value * 1000:.1f} ms"

    lines = ["Request\tSerial TTFT\tContinuous TTFT\tSerial TPOT\tContinuous TPOT"]
    for i, rid in enumerate(serial["ids"]):
        lines.append(
            "\t".join(
                [
                    rid,
                    ms(serial["ttfts"][i], "failed"),
                    ms(continuous["ttfts"][i], "failed"),
                    ms(serial["tpots"][i]),
                    ms(continuous["tpots"][i]),
                ]
            )
        )
    for name, res in (("serial", serial), ("continuous", continuous)):
        line = (
            f"{name}: drain window {fmt(res['duration'] * 1000)} ms, {res['total_output_tokens']} output tokens, "
            f"{fmt(res['output_throughput'])} tok/s; failed {res['failed']}"
        )
        window = res["window"]
        if window["kind"] == "fixed":
            line += f"; fixed {fmt(window['duration'] * 1000)} ms window: {fmt(window['output_throughput'])} tok/s"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=BOOK_WORKLOAD)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, help="continuous run's limit (default: the engine's)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--window-ms", type=float, help="also report a common fixed window")
    parser.add_argument("--serial-url", help="replay against this live server instead of the offline engine")
    parser.add_argument("--continuous-url", help="replay against this live server instead of the offline engine")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    requests = workload.load(args.workload)
    serial = run_schedule("serial", requests, args)
    continuous = run_schedule("continuous", requests, args)
    print(f"workload: {args.workload} ({len(requests)} requests); warmup {args.warmup} per run, excluded")
    print(table_31_2(serial, continuous))

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"serial_vs_continuous-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"workload": str(args.workload), "serial": serial, "continuous": continuous}, indent=1))
    plot_timeline([serial, continuous], ["Serial (max_num_seqs=1)", "Continuous batching"], out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
