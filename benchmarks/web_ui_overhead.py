"""What the web page's live view costs the server: served throughput with the page open against closed,
A/B in one run on one `kvserve serve` (which records every step either way; `--no-web-ui` turns that off).

Each round runs the workload twice, once with a viewer following /v1/engine/events and once without, in
alternating order (closed-open, open-closed, ...), each with fresh prompts so that no run is served from
a warm prefix cache. The viewer is the page itself in headless Chromium (`--viewer browser`: its
rendering shares the cores, as it would on a desktop) or a process that reads and decodes the stream as
the page does (`--viewer events`). The workload is the replay client's (`kvserve bench serve`): N
requests of fixed input/output lengths, all at once, ignoring EOS. Prints one row per run (with the CPU
seconds the viewer's processes used during it), each round's open/closed throughput ratio, the median
ratio and the spread of the closed runs; writes JSON (kvserve.bench.results.save_results).

    python benchmarks/web_ui_overhead.py [--rounds 4] [--requests 64] [--input-len 128] [--output-len 128]
        [--viewer browser|events] [--dtype bfloat16] [--out benchmarks/results/web_ui_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import time
from multiprocessing.sharedctypes import Synchronized as Value
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
from cpu_performance import start_kvserve

from kvserve.bench.generators import LengthDist, random_workload
from kvserve.bench.metrics import summarize
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.bench.results import save_results
from kvserve.server.testing import CHROMIUM, CHROMIUM_ARGS

# Long enough for headless Chromium to load the page and subscribe before the workload starts.
BROWSER_SETTLE_S = 5.0


def tree_cpu_s(root_pid: int) -> float:
    """CPU seconds (user + system) used so far by root_pid and its live descendants, from /proc (a
    descendant that has exited is not counted: the viewers' processes live as long as the viewer)."""
    children: dict[int, list[int]] = {}
    cpu_s: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while listed
            continue
        fields = text[text.rindex(")") + 2 :].split()  # from field 3 (state) on: ppid, ..., utime, stime
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu_s[pid] = (int(fields[11]) + int(fields[12])) / ticks
    total, todo = 0.0, [root_pid]
    while todo:
        pid = todo.pop()
        total += cpu_s.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def follow_events(url: str, stop: EventType, steps: Value) -> None:
    """Reads /v1/engine/events until `stop`, decoding every event as the page does; counts the steps."""
    with httpx.stream("GET", f"{url}/v1/engine/events", timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if stop.is_set():
                return
            if line.startswith("data: "):
                steps.value += len(json.loads(line[6:]).get("steps", []))


class EventsViewer:
    """Follows /v1/engine/events in a process of its own (as a browser would be), so decoding the feed
    does not share the load generator's interpreter and skew its timings."""

    def __init__(self, url: str) -> None:
        self._stop = multiprocessing.Event()
        self._steps = multiprocessing.Value("l", 0)
        self._process = multiprocessing.Process(target=follow_events, args=(url, self._stop, self._steps))
        self.cpu_s = 0.0  # the reader's CPU seconds while it was open

    @property
    def steps(self) -> int:
        return self._steps.value

    def __enter__(self) -> EventsViewer:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process.pid is not None
        self.cpu_s = tree_cpu_s(self._process.pid)
        self._stop.set()
        self._process.join(10)
        if self._process.is_alive():  # blocked on a feed that went quiet: nothing more to count
            self._process.terminate()
            self._process.join()


class BrowserViewer:
    """The page at / in headless Chromium, from start to stop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.steps = None  # the page keeps its count to itself
        self.cpu_s = 0.0  # Chromium's CPU seconds (all its processes) from the end of the settling on
        self._proc: subprocess.Popen | None = None
        self._settled_cpu_s = 0.0

    def __enter__(self) -> BrowserViewer:
        cmd = [CHROMIUM, *CHROMIUM_ARGS, f"{self.url}/"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(BROWSER_SETTLE_S)
        self._settled_cpu_s = tree_cpu_s(self._proc.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self.cpu_s = tree_cpu_s(self._proc.pid) - self._settled_cpu_s
        self._proc.terminate()
        self._proc.wait(30)


def run_once(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    lengths_in, lengths_out = LengthDist.parse(str(args.input_len)), LengthDist.parse(str(args.output_len))
    workload = random_workload(args.requests, float("inf"), lengths_in, lengths_out, seed=seed)
    cfg = ReplayConfig(base_url=url, warmup=2, quiet=True, seed=seed, ignore_eos=True)
    records, _ = replay(workload, cfg)
    s = summarize(records)
    return {
        "output_tok_s": s["output_throughput"],
        "ttft_p50_ms": s["median_ttft_ms"],
        "tpot_p50_ms": s["median_tpot_ms"],
        "failed": s["failed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--viewer", default="browser", choices=["browser", "events"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--server-threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/web_ui_overhead.json")
    args = parser.parse_args()
    if args.viewer == "browser" and CHROMIUM is None:
        raise SystemExit("--viewer browser needs Debian's chromium (apt-get install chromium); or --viewer events")
    viewer_of = {"browser": BrowserViewer, "events": EventsViewer}[args.viewer]

    proc, url = start_kvserve(args.dtype, args.server_threads)
    rows: list[dict[str, Any]] = []
    try:
        for round_index in range(args.rounds):
            order = ("closed", "open") if round_index % 2 == 0 else ("open", "closed")
            for page in order:
                seed = 1 + 1000 * round_index + (page == "open")
                started = time.perf_counter()
                if page == "open":
                    with viewer_of(url) as viewer:
                        started = time.perf_counter()
                        row = run_once(url, args, seed)
                    row["viewer_steps_received"] = viewer.steps
                    row["viewer_cpu_s"] = viewer.cpu_s
                else:
                    row = run_once(url, args, seed)
                row["wall_s"] = time.perf_counter() - started
                rows.append({"round": round_index, "page": page, **row})
                viewer_cpu = f", viewer {row['viewer_cpu_s']:.2f} CPU s" if page == "open" else ""
                print(
                    f"round {round_index} page {page:6s} {row['output_tok_s']:8.1f} tok/s in {row['wall_s']:.1f} s"
                    f"{viewer_cpu}",
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    ratios = []
    for round_index in range(args.rounds):
        by_page = {r["page"]: r["output_tok_s"] for r in rows if r["round"] == round_index}
        ratios.append(by_page["open"] / by_page["closed"] if by_page["closed"] else float("nan"))
    print(
        f"\n## served throughput, page open vs closed ({args.viewer} viewer), {args.requests} x "
        f"{args.input_len}/{args.output_len} all at once"
    )
    print("| round | page | output tok/s | TTFT p50 ms | TPOT p50 ms | failed | viewer CPU s (share of the run) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        viewer_cpu = f"{r['viewer_cpu_s']:.2f} ({r['viewer_cpu_s'] / r['wall_s']:.1%})" if "viewer_cpu_s" in r else ""
        print(
            f"| {r['round']} | {r['page']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.1f} | {r['failed']} | {viewer_cpu} |"
        )
    closed = [r["output_tok_s"] for r in rows if r["page"] == "closed"]
    print("open / closed per round: " + ", ".join(f"{x:.3f}" for x in ratios))
    print(f"median open / closed: {statistics.median(ratios):.3f}")
    print(
        f"closed runs: {min(closed):.1f}-{max(closed):.1f} tok/s, spread (max - min) / median "
        f"{(max(closed) - min(closed)) / statistics.median(closed):.1%}"
    )
    meta = {
        "benchmark": "web_ui_overhead",
        "viewer": args.viewer,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "requests": args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    save_results({"meta": meta, "runs": rows, "open_over_closed": ratios}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
