"""Where a served run's CPU goes: the same 100 x 128/128 requests, all at once, streamed and not streamed,
against one `kvserve serve`, with the CPU seconds of each server thread and of the client.

Why: on two cores the engine's two threads work in lockstep (each parallel region waits for both), so every
CPU-ms another thread takes -- the server's HTTP thread, the benchmark client -- costs the engine about a
wall-ms. This script measures those shares, so the gap between offline and served throughput can be
accounted for rather than guessed. Threads are read from /proc (Linux); the server's main thread runs the
engine loop (kvserve/server/launch.py), the others are listed by CPU, largest first.

    python benchmarks/served_cpu_split.py [--repeats 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
from cpu_performance import start_kvserve

from kvserve.bench.generators import LengthDist, random_workload
from kvserve.bench.replay import ReplayConfig, payload_for, replay

REQUESTS, PROMPT_LEN, OUTPUT_LEN = 100, 128, 128


def thread_cpu_s(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of `pid`."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def run_once(url: str, model: str, stream: bool, seed: int) -> tuple[float, int]:
    """One run: streamed through the replay client that cpu_performance.py drives the servers with, or
    the same request bodies not streamed. Returns wall seconds and completion tokens."""
    # Fresh prompts per run (a different seed): nothing comes from the prefix cache.
    prompt_len, output_len = LengthDist.parse(str(PROMPT_LEN)), LengthDist.parse(str(OUTPUT_LEN))
    workload = random_workload(REQUESTS, float("inf"), prompt_len, output_len, seed=seed)
    cfg = ReplayConfig(base_url=url, model=model, quiet=True, seed=seed)
    if stream:
        start = time.perf_counter()
        records, _ = replay(workload, cfg)
        if failed := [f"{r.id}: {r.error}" for r in records if not r.ok]:
            raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
        return time.perf_counter() - start, sum(len(r.token_times) for r in records)
    bodies = [payload_for(r, cfg) | {"stream": False, "stream_options": None} for r in workload]
    start = time.perf_counter()
    tokens = asyncio.run(post_all(cfg.url, bodies))
    return time.perf_counter() - start, tokens


async def post_all(url: str, bodies: list[dict[str, Any]]) -> int:
    """POST all bodies at once; return the completion tokens the server reports."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        responses = await asyncio.gather(*(client.post(url, json=body) for body in bodies))
    for response in responses:
        response.raise_for_status()
    return sum(response.json()["usage"]["completion_tokens"] for response in responses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="streamed and non-streamed runs, alternating")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "served_cpu_split.json")
    args = parser.parse_args()
    proc, url = start_kvserve("bfloat16", None)
    rows = []
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        run_once(url, model, True, seed=0)  # warm-up
        for repeat in range(args.repeats):
            for stream in (True, False):
                server_before, client_before = thread_cpu_s(proc.pid), time.process_time()
                wall, tokens = run_once(url, model, stream, seed=1 + 2 * repeat + stream)
                client = time.process_time() - client_before
                server = {t: s - server_before.get(t, 0.0) for t, s in thread_cpu_s(proc.pid).items()}
                others = sorted((s for t, s in server.items() if t != proc.pid), reverse=True)
                rows.append(
                    {
                        "streamed": stream, "wall_s": wall, "output_tok_s": tokens / wall, "client_cpu_s": client,
                        "engine_main_thread_cpu_s": server.get(proc.pid, 0.0),
                        "other_server_threads_cpu_s": [s for s in others if s >= 0.01],
                    }
                )  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"100 x {PROMPT_LEN}/{OUTPUT_LEN} all at once, bf16; CPU seconds per run")
    print("| streamed | wall s | out tok/s | engine main thread | other server threads | client |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        others = ", ".join(f"{s:.2f}" for s in r["other_server_threads_cpu_s"])
        print(
            f"| {'yes' if r['streamed'] else 'no'} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | "
            f"{r['engine_main_thread_cpu_s']:.2f} | {others} | {r['client_cpu_s']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
