"""Peak resident memory of `kvserve serve` under load, what it consists of, and llama.cpp's server beside it.

Each server is started on its own, serves 100 x 128/128 requests all at once, and its VmHWM is read before
it is stopped. kvserve's share is broken down from its own startup report (the "memory" row: the weights'
stored bytes, the KV pool, the process's RSS when ready) and from a bare process that imports what the
server imports (interpreter, torch and the server's libraries):

    import          python + torch + the server's libraries, before anything is loaded
    weights         the tensors the model holds, as stored (GGUF blocks or dense)
    KV pool         the preallocated K/V cache (--num-kv-blocks)
    rest at ready   RSS when ready minus the three above: the tokenizer, packed copies of weights, kernels,
                    what loading left resident
    under load      peak minus RSS when ready: activations and logits of the largest steps, allocator slack

    python benchmarks/server_memory.py [--quantization auto] [--num-kv-blocks 512] \\
        [--llamacpp-launch "exec llama-server -m FILE.gguf --port 18314 -t 2 -c 8192"] [--llamacpp-port 18314]

Same KV capacity for both: 512 blocks x 16 tokens = llama.cpp's `-c 8192`. Figures are MiB (VmHWM / 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpu_performance import free_port, peak_rss_mb, served_model, wait_until_ready

from kvserve.bench.generators import LengthDist, random_workload
from kvserve.bench.metrics import summarize
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.model.registry import DEFAULT_MODEL

_IMPORT_RSS = r"""
import kvserve.cli, kvserve.server.openai_api
from kvserve.engine.startup_report import process_memory_mib
print(process_memory_mib()[0])
"""
MEMORY_ROW = re.compile(
    r"memory:\s+weights (?P<weights>[\d.]+) MiB .*KV pool (?P<kv>[\d.]+) MiB; process RSS (?P<ready>\d+) MiB"
)


def all_at_once(url: str, model: str, requests: int) -> dict[str, Any]:
    lengths = LengthDist.parse("128"), LengthDist.parse("128")
    workload = random_workload(requests, float("inf"), *lengths, seed=1)
    records, _ = replay(workload, ReplayConfig(base_url=url, model=model, warmup=2, quiet=True, seed=1))
    s = summarize(records)
    return {"output_tok_s": s["output_throughput"], "failed": s["failed"]}


def import_rss_mb() -> float:
    return float(subprocess.run([sys.executable, "-c", _IMPORT_RSS], capture_output=True, text=True, check=True).stdout)


def kvserve_row(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--model", args.model,
               "--dtype", args.dtype, "--quantization", args.quantization,
               "--num-kv-blocks", str(args.num_kv_blocks)]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(proc, url, "/health", "kvserve serve", 300)
            load = all_at_once(url, served_model(url), args.requests)
            peak = peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        log.seek(0)
        text = log.read()
    if peak is None:
        raise RuntimeError("the peak RSS of kvserve serve could not be read")
    parts = breakdown(text, peak, import_rss_mb())
    return {"engine": f"kvserve {args.quantization} {args.dtype}", "peak_rss_mb": peak, "parts": parts, **load}


def breakdown(log: str, peak_mb: float, import_mb: float) -> dict[str, float]:
    """The peak's parts (MiB) from the server log's memory row, its peak and a bare import's RSS."""
    found = MEMORY_ROW.search(log)
    if found is None:
        raise RuntimeError("kvserve serve logged no memory row")
    weights, kv, ready = float(found["weights"]), float(found["kv"]), float(found["ready"])
    return {
        "import": import_mb,
        "weights": weights,
        "KV pool": kv,
        "rest at ready": ready - import_mb - weights - kv,
        "under load": peak_mb - ready,
    }


def llamacpp_row(launch: str, port: int, requests: int) -> dict[str, Any]:
    proc = subprocess.Popen(launch, shell=True, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, url, "/v1/models", "llama.cpp server", 600)
        load = all_at_once(url, served_model(url), requests)
        peak = peak_rss_mb(proc.pid)  # `exec` in the launch line: the shell's pid is the server's
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    return {"engine": "llama.cpp server", "peak_rss_mb": peak, **load}


def print_table(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["peak_rss_mb"]
    print("\n| engine | peak RSS MiB | ratio to kvserve | out tok/s | failed |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['engine']} | {row['peak_rss_mb']:.0f} | {row['peak_rss_mb'] / base:.2f} "
              f"| {row['output_tok_s']:.1f} | {row['failed']} |")  # fmt: skip
    print("\n| kvserve part | MiB |")
    print("|---|---|")
    for name, mb in rows[0]["parts"].items():
        print(f"| {name} | {mb:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--llamacpp-launch", help="a shell line starting llama.cpp's server (use `exec`)")
    parser.add_argument("--llamacpp-port", type=int, default=18314)
    parser.add_argument("--out", default="benchmarks/results/server_memory.json")
    args = parser.parse_args()
    rows = [kvserve_row(args)]
    if args.llamacpp_launch:
        rows.append(llamacpp_row(args.llamacpp_launch, args.llamacpp_port, args.requests))
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
