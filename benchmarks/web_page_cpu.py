"""What the web page costs the browser: the CPU seconds of headless Chromium (all its processes, from
/proc) while the page follows a synthetic engine, without a model, so that the figure depends on the
page and the feed only, not on how fast a loaded machine serves.

The synthetic engine (kvserve.server.testing.StandInEngine behind the real app) runs `--batch` requests
at once, a step every `--step-ms`; each request lives 128 steps (a 128-token prefill, then decode
tokens) and they are staggered, so some finish every few steps and the histograms and the table change.
Chromium opens the page (window 1400 x 1000), settles, and its CPU time over `--seconds` is measured;
`--blank` measures Chromium on about:blank instead (its floor).

    python benchmarks/web_page_cpu.py [--batch 64] [--step-ms 50] [--seconds 20] [--blank]
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time

from web_ui_overhead import BROWSER_SETTLE_S, tree_cpu_s

from kvserve.engine.step_trace import FinishedRequest, SeqWork, StepRecord, StepTrace
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.openai_api import build_app
from kvserve.server.testing import CHROMIUM, CHROMIUM_ARGS, ServerThread, StandInEngine

LIFETIME_STEPS = 128
PREFILL_TOKENS = 128


def synthetic_step(index: int, batch: int, step_s: float) -> StepRecord:
    """Step `index` of `batch` staggered requests: request r is (index + 2r) % LIFETIME_STEPS steps old."""
    seqs, finished = [], []
    for r in range(batch):
        age = (index + 2 * r) % LIFETIME_STEPS
        request_id = f"cmpl-{(index + 2 * r) // LIFETIME_STEPS:04d}{r:04d}"
        prefill = PREFILL_TOKENS if age == 0 else 0
        seqs.append(SeqWork(request_id, 0, prefill, 0 if prefill else 1, 0))
        if age == LIFETIME_STEPS - 1:
            finished.append(FinishedRequest(request_id, 0.5 + r / 100, step_s))
    tokens = sum(s.prefill_tokens + s.decode_tokens for s in seqs)
    return StepRecord(index, time.time(), step_s, tuple(seqs), tokens, 300, 20, 700, 3, 0, 0, 0, 0, tuple(finished))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--blank", action="store_true")
    args = parser.parse_args()
    if CHROMIUM is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    step_s = args.step_ms / 1000
    engine = StandInEngine()
    engine.step_trace = StepTrace()
    stop = threading.Event()

    def engine_loop() -> None:
        index = 0
        while not stop.wait(step_s):
            index += 1
            assert engine.step_trace is not None
            engine.step_trace.append(synthetic_step(index, args.batch, step_s))

    with ServerThread(build_app(AsyncEngine(engine))) as server:
        stepper = threading.Thread(target=engine_loop, daemon=True)
        stepper.start()
        url = "about:blank" if args.blank else f"{server.base_url}/"
        cmd = [CHROMIUM, *CHROMIUM_ARGS, "--window-size=1400,1000", url]
        browser = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(BROWSER_SETTLE_S)
            cpu_s, started = tree_cpu_s(browser.pid), time.perf_counter()
            time.sleep(args.seconds)
            cpu_s, wall_s = tree_cpu_s(browser.pid) - cpu_s, time.perf_counter() - started
        finally:
            browser.terminate()
            browser.wait(30)
            stop.set()
    page = "about:blank" if args.blank else "the page"
    print(
        f"Chromium with {page}, {args.batch} requests, a step every {args.step_ms:g} ms: {cpu_s:.2f} CPU s in "
        f"{wall_s:.1f} s = {cpu_s / wall_s:.1%} of a core"
    )


if __name__ == "__main__":
    main()
