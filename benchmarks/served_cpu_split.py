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
import random
import time
from pathlib import Path
from typing import Any

import httpx
from cpu_performance import start_kvserve

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


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], stream: bool) -> int:
    """Send one request; return the completion tokens the server reports."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_LEN, "stream": stream}
    body |= {"ignore_eos": True, "temperature": 0}
    if not stream:
        response = await client.post(url + "/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # parsed as the replay client does
            if line.startswith("data:") and line != "data: [DONE]":
                tokens = (json.loads(line[5:]).get("usage") or {}).get("completion_tokens", tokens)
    return tokens


async def run_once(url: str, model: str, stream: bool, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)  # fresh prompts per run: nothing comes from the prefix cache
    prompts = [[rng.randrange(1000, 32000) for _ in range(PROMPT_LEN)] for _ in range(REQUESTS)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one_request(client, url, model, p, stream) for p in prompts))
        return time.perf_counter() - start, sum(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="streamed and non-streamed runs, alternating")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "served_cpu_split.json")
    args = parser.parse_args()
    proc, url = start_kvserve("bfloat16", None)
    rows = []
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(run_once(url, model, True, seed=0))  # warm-up
        for repeat in range(args.repeats):
            for stream in (True, False):
                server_before, client_before = thread_cpu_s(proc.pid), time.process_time()
                wall, tokens = asyncio.run(run_once(url, model, stream, seed=1 + 2 * repeat + stream))
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
