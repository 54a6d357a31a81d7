"""Do other clients notice a hostile one? TTFT of ordinary streaming requests and /health latency on one
`kvserve serve`, in three phases of one run: quiet; while a client keeps sending 10 MB prompts (refused
before tokenizing: over --max-prompt-chars); while a client keeps sending prompts just under that limit
(tokenized on the server's tokenizer threads, then refused as too many tokens). The outlier runs in a
process of its own.

Acceptance (issue 27): with an outlier, other requests' TTFT p99 grows by < 100 ms over the quiet
phase, and /health answers in < 100 ms.

    python benchmarks/hostile_outlier.py                       # 3 x 20 s, 4 clients, the outlier back to back
    python benchmarks/hostile_outlier.py --outlier-interval-s 1  # one outlier request a second
    python benchmarks/hostile_outlier.py --phase-s 5 --serve-args "--dtype float32"

Writes benchmarks/results/hostile_outlier.json. Figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import shlex
import socket
import subprocess
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.results import save_results

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def ordinary_client(client: httpx.AsyncClient, i: int, stop: asyncio.Event, ttfts: list[float]) -> None:
    n = 0
    while not stop.is_set():
        body = {"prompt": f"Client {i}, request {n}: tell me about the sea.", "max_tokens": 8, "stream": True}
        began = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            first = True
            async for line in response.aiter_lines():
                if first and line.startswith("data: "):
                    ttfts.append(time.perf_counter() - began)
                    first = False
        n += 1


async def health_poller(client: httpx.AsyncClient, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        latencies.append(time.perf_counter() - began)
        await asyncio.sleep(0.05)


def outlier_client(base: str, body: bytes, interval_s: float, stop: EventType, statuses: Queue) -> None:
    """Sends `body` again and again (`interval_s` after each answer), in a process of its own, so pushing
    megabytes through the socket does not stall the ordinary clients' event loop and skew their TTFT."""
    with httpx.Client(base_url=base, timeout=300) as client:
        while not stop.is_set():
            response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            statuses.put(response.status_code)
            stop.wait(interval_s)


async def phase(base: str, clients: int, seconds: float, outlier: bytes | None, interval_s: float) -> dict[str, Any]:
    ttfts: list[float] = []
    health: list[float] = []
    stop = asyncio.Event()
    outlier_stop, outlier_statuses = multiprocessing.Event(), multiprocessing.Queue()
    sender = multiprocessing.Process(
        target=outlier_client, args=(base, outlier, interval_s, outlier_stop, outlier_statuses)
    )
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(ordinary_client(client, i, stop, ttfts)) for i in range(clients)]
        tasks.append(asyncio.create_task(health_poller(client, stop, health)))
        if outlier is not None:
            sender.start()
        await asyncio.sleep(seconds)
        stop.set()
        outlier_stop.set()
        await asyncio.gather(*tasks)
    if outlier is not None:
        sender.join()
    statuses = []
    while not outlier_statuses.empty():
        statuses.append(outlier_statuses.get())
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
        "health_p50_ms": percentile(health, 0.5) * 1e3,
        "health_p99_ms": percentile(health, 0.99) * 1e3,
        "health_max_ms": max(health, default=float("nan")) * 1e3,
        "outlier_requests": len(statuses),
        "outlier_statuses": sorted(set(statuses)),
    }


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--log-level", "warning", *serve_args]
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvserve serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("kvserve serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4, help="ordinary clients, each one request at a time")
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--serve-args", default="", help="extra `kvserve serve` flags")
    parser.add_argument(
        "--outlier-interval-s", type=float, default=0.0, help="the outlier's pause after each answer (0: back to back)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/hostile_outlier.json")
    args = parser.parse_args()

    proc, base = start_server(shlex.split(args.serve_args))
    try:
        limit_error = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 10**7, "max_tokens": 1}).json()
        max_chars = int(limit_error["error"]["message"].split("at most ")[1].split()[0])  # the server's own limit
        outliers = {
            "quiet": None,
            "10 MB prompt (refused by length)": json.dumps({"prompt": "x" * 10**7, "max_tokens": 1}).encode(),
            f"{max_chars}-char prompt (tokenized, refused)": json.dumps(
                {"prompt": "hello world " * (max_chars // 12), "max_tokens": 1}
            ).encode(),
        }
        asyncio.run(phase(base, args.clients, 2.0, None, 0.0))  # warm-up
        results = {
            name: asyncio.run(phase(base, args.clients, args.phase_s, body, args.outlier_interval_s))
            for name, body in outliers.items()
        }
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()

    quiet = results["quiet"]
    header = f"{'phase':<44} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'dp99':>7} {'health p99':>11} {'max':>7}"
    print(header)
    for name, row in results.items():
        row["ttft_p99_increase_ms"] = row["ttft_p99_ms"] - quiet["ttft_p99_ms"]
        print(
            f"{name:<44} {row['requests']:>5} {row['ttft_p50_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} "
            f"{row['ttft_p99_increase_ms']:>7.1f} {row['health_p99_ms']:>11.1f} {row['health_max_ms']:>7.1f}"
        )
    print("(ms; dp99 = TTFT p99 - quiet TTFT p99; acceptance: dp99 < 100 and health < 100 with an outlier)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_results({"config": {k: str(v) for k, v in vars(args).items()}, "phases": results}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
