"""Stop-string check per token against the output length: kvserve's incremental matcher (one KMP automaton
per stop, engine/stop_matcher.py) beside the suffix scan it replaced (every prefix stop[:k] copied and
compared on every token, kept here as the baseline).

The output grows to --output-chars characters of "a", --chars-per-token at a time. Half the stop strings
are "b" + "a" * (L - 1) (no prefix ever matches: the suffix scan tries every k), the other half, listed
after them, "a" * (L - 1) + "b" (the automaton's state climbs to L - 1 and stays there: the most text
held back). L is --stop-chars;
longer than the output, so the baseline's work grows with every character. kvserve's time is the mean
over all tokens within each output-length bucket; the baseline's, one check at the bucket's end (it
would take minutes to stream).

    python benchmarks/stop_strings.py                  # 20 stops of 8,192 characters, 8,000-character output
    python benchmarks/stop_strings.py --baseline-repeats 1 --output-chars 2000

Writes benchmarks/results/stop_strings.json. Figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kvserve.bench.results import save_results
from kvserve.engine.stop_matcher import StopMatcher, failure_table

ROOT = Path(__file__).resolve().parents[1]


def suffix_scan_held_back(text: str, stops: list[str]) -> int:
    """The replaced check: the longest suffix of text that is a proper prefix of a stop, by trying every k."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stops", type=int, default=20)
    parser.add_argument("--stop-chars", type=int, default=8192)
    parser.add_argument("--output-chars", type=int, default=8000)
    parser.add_argument("--chars-per-token", type=int, default=4)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--baseline-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/stop_strings.json")
    args = parser.parse_args()

    length = args.stop_chars
    half = args.stops // 2
    stops = ["b" + "a" * (length - 1)] * half + ["a" * (length - 1) + "b"] * (args.stops - half)
    tables = [failure_table(stop) for stop in stops]  # built once per request, at its first token
    matcher = StopMatcher(stops, tables)
    bucket_chars = args.output_chars // args.buckets
    per_bucket: list[list[float]] = [[] for _ in range(args.buckets)]
    text = ""
    while len(text) < args.output_chars:
        start, text = len(text), text + "a" * args.chars_per_token
        began = time.perf_counter()
        hit = matcher.feed(text, start)
        held = matcher.held_back
        elapsed = time.perf_counter() - began
        assert hit is None and held == min(len(text), length - 1)
        per_bucket[min((len(text) - 1) // bucket_chars, args.buckets - 1)].append(elapsed)

    rows = []
    print(f"{args.stops} stops of {length} characters, {args.chars_per_token} characters a token")
    print(f"{'output chars':>14} {'kvserve us/token':>17} {'suffix scan us/token':>21}")
    for i, times in enumerate(per_bucket):
        end = (i + 1) * bucket_chars
        baseline = []
        for _ in range(args.baseline_repeats):
            began = time.perf_counter()
            suffix_scan_held_back("a" * end, stops)
            baseline.append(time.perf_counter() - began)
        row = {
            "output_chars": end,
            "kvserve_us_per_token": statistics.mean(times) * 1e6,
            "suffix_scan_us_per_token": statistics.median(baseline) * 1e6 if baseline else None,
        }
        rows.append(row)
        scan = f"{row['suffix_scan_us_per_token']:21.0f}" if baseline else f"{'-':>21}"
        print(f"{end:14d} {row['kvserve_us_per_token']:17.2f} {scan}")
    first, last = rows[0]["kvserve_us_per_token"], rows[-1]["kvserve_us_per_token"]
    print(f"kvserve: last bucket / first bucket = {last / first:.2f} (flat = 1)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_results({"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
