"""CPU performance, side by side in one run: kvserve offline, kvserve served over HTTP, HF transformers,
and any peer servers you have running (vLLM-CPU, llama.cpp's llama-server, set up outside this
repository), all on the same model, workload and dtype.

Rows:
- offline 64 x 128/128 (ignore EOS): kvserve LLM.generate vs HF generate() (benchmarks/offline_throughput.py);
- batch-1 decode: one 128-token prompt, 128 outputs: TPOT, and per-step time outside matrix products
  (the Python/op overhead, from the torch profiler over a few steps);
- bf16 vs float32 greedy agreement, kvserve's and HF's (benchmarks/dtype_agreement.py; always on the
  default model, which has a chat template: --model chooses the model of the other rows);
- served: `kvserve serve` started here, driven by kvserve's replay client (`kvserve bench serve`):
  100 requests 128/128 all at once; Poisson 2 req/s x 60; max-concurrency 1 x 6;
  the same client against every `--peer NAME=URL` (an OpenAI-compatible server, running already or
  started by `--peer-launch NAME=COMMAND` just for its own rows, so that servers never share the cores).
Prints a table of output tok/s, TTFT and TPOT p50/p99, failures, the replay client's own CPU seconds
and peak RSS, with ratios to kvserve; writes JSON.

    python benchmarks/cpu_performance.py [--model gemma3-270m] [--dtype bfloat16] [--skip-hf] [--skip-served]
        [--peer vllm=http://127.0.0.1:8001 --peer llamacpp=http://127.0.0.1:8002]
        [--peer-launch vllm="COMMAND that starts it" ...] [--served-only] [--repeat N]

With --repeat N the served rows run in N rounds (fresh prompts each round); each round runs every
engine's rows in turn, each server started for its round and stopped after it. The offline row runs N
rounds too, kvserve and HF taking turns (offline_throughput.py). This VM's memory speed
moves within minutes, so a ratio is taken within one round, between engines measured minutes apart,
and a second table gives each row's median tok/s and median ratio to kvserve.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dtype_agreement
import httpx
import torch
from offline_throughput import offline_rounds, print_rounds, random_prompts
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.bench.generators import LengthDist, random_workload
from kvserve.bench.metrics import summarize
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.kernels import cpu
from kvserve.model.registry import DEFAULT_MODEL

MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "kvserve::gemv_bf16")
SERVED_RUNS = {  # name: (requests, rate per second, max concurrency, seed)
    "served 100x128/128 all at once": (100, float("inf"), None, 1),
    "served Poisson 2 req/s x 60": (60, 2.0, None, 2),
    "served batch 1 (concurrency 1) x 6": (6, float("inf"), 1, 3),
}


def batch1_decode(dtype: str, model: str, prompt_len: int = 128, output_len: int = 128) -> dict[str, Any]:
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False)
    prompt = random_prompts(1, prompt_len, seed=5)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))[0]
    times = out.metrics.token_times
    tpot = (times[-1] - times[0]) / (len(times) - 1)

    engine = llm.engine
    engine.add_request("profiled", prompt[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for _ in range(4):
        engine.step()
    steps = 16
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    matmul_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "tpot_ms": tpot * 1000,
        "profiled_step_ms": wall * 1000,
        "matmul_ms_per_step": matmul_us / 1000,
        "overhead_ms_per_step": wall * 1000 - matmul_us / 1000,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def wait_until_ready(proc: subprocess.Popen, url: str, path: str, name: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited during start-up")
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{name} did not become ready in {timeout_s:.0f} s")


def start_kvserve(dtype: str, threads: int | None, model: str) -> tuple[subprocess.Popen, str]:
    # The first start after a kernel source change compiles them (~4 min on 2 cores): done here, so the
    # server finds them built and its start-up timeout measures only its own start-up.
    cpu.load()
    port = _free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", str(port), "--dtype", dtype]
    if threads:
        cmd += ["--num-threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(proc, url, "/health", "kvserve serve", 300)
    return proc, url


def kvserve_rows(dtype: str, threads: int | None, model: str, repeat: int) -> tuple[list[dict[str, Any]], float | None]:
    """One round of the served rows against a `kvserve serve` started for it, and the server's peak RSS."""
    proc, url = start_kvserve(dtype, threads, model)
    try:
        rows = served_rows("kvserve", url, served_model(url), repeat)
    finally:
        peak_rss_mb = _peak_rss_mb(proc.pid)
        proc.terminate()
        proc.wait(timeout=60)
    return rows, peak_rss_mb


def peer_rows(name: str, url: str, model: str | None, launch: str | None, repeat: int) -> list[dict[str, Any]]:
    """One round of the served rows against a peer; with `launch` (a shell line) the peer is started just
    before and stopped just after, so no two servers share the cores while either is measured."""
    proc = None
    if launch:
        proc = subprocess.Popen(launch, shell=True, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        wait_until_ready(proc, url, "/v1/models", name, 600)
    try:
        return served_rows(name, url, model or served_model(url), repeat)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)


def served_model(url: str) -> str:
    """The model name the OpenAI-compatible server at `url` serves (its first)."""
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def memory_gb_s() -> float:
    """This machine's memory read speed now: two threads summing 270 MB of bf16 (the model's weights).
    Every row here is memory-bound and this VM's figure moves 2x within a session, so each engine's
    rows carry the figure measured just before them."""
    x = torch.ones(135_000_000, dtype=torch.bfloat16)
    x.sum()
    start = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.numel() * 2 / (time.perf_counter() - start) / 1e9


def served_rows(name: str, url: str, model: str, repeat: int) -> list[dict[str, Any]]:
    """SERVED_RUNS in order, one row each, tagged with the round `repeat`."""
    machine = memory_gb_s()
    rows = []
    for run, (count, rate, concurrency, run_seed) in SERVED_RUNS.items():
        # Fresh prompts per run and repeat (a different seed): none is served from a warm prefix cache.
        seed = run_seed + 1000 * repeat
        workload = random_workload(count, rate, LengthDist.parse("128"), LengthDist.parse("128"), seed=seed)
        cfg = ReplayConfig(base_url=url, model=model, max_concurrency=concurrency, warmup=2, quiet=True, seed=seed)
        started_at = time.time()
        client_cpu_start = time.process_time()
        records, _ = replay(workload, cfg)
        # The client shares the cores with the server it measures. A lockstep engine on two threads
        # loses about one wall-ms per CPU-ms taken from it, and every engine serves the same events,
        # so this figure should be about the same for all of them.
        client_cpu_s = time.process_time() - client_cpu_start
        s = summarize(records)
        rows.append(
            {
                "engine": name,
                "run": run,
                "repeat": repeat,
                "started_at_unix_s": started_at,
                "output_tok_s": s["output_throughput"],
                "ttft_p50_ms": s["median_ttft_ms"],
                "ttft_p99_ms": s["p99_ttft_ms"],
                "tpot_p50_ms": s["median_tpot_ms"],
                "tpot_p99_ms": s["p99_tpot_ms"],
                "failed": s["failed"],
                "machine_memory_gb_s": machine,
                "client_cpu_s": client_cpu_s,
                # Why requests failed, so that a failure in a long run can be traced afterwards.
                "failures": [f"{r.id}: {r.error or 'no tokens'}" for r in records if not r.ok],
            }
        )
    return rows


def _fmt(value: Any, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the bundled model kvserve's own rows run")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--served-only", action="store_true", help="skip the offline, batch-1 and dtype rows")
    parser.add_argument("--server-threads", type=int, default=None, help="torch threads of the kvserve server")
    parser.add_argument("--peer", action="append", default=[], help="NAME=URL of a running OpenAI-compatible server")
    parser.add_argument("--peer-model", default=None, help="model name the peers serve (default: ask /v1/models)")
    parser.add_argument(
        "--peer-launch", action="append", default=[],
        help="NAME=COMMAND: start peer NAME with this shell line right before its rows, stop it after",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="run the served rows in this many rounds, every engine once per round (this VM's speed moves "
        "within minutes); the table then adds each row's median",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/cpu_performance.json")
    args = parser.parse_args()

    results: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    # The served rows run first, before this process loads and frees engines and HF models of its own.
    # Run after the bf16-vs-fp32 agreement rows, kvserve's first served run (all at once) was markedly
    # slower than after nothing or after the offline, HF or batch-1 rows alone (figures:
    # benchmarks/RESULTS.md, "Figures behind the code's rules"). Which resource of the VM that churn ties up was not
    # found (no CPU is used meanwhile); a server should not pay for its benchmark client's history.
    served: list[dict[str, Any]] = []
    if not args.skip_served:
        launches = dict(launch.split("=", 1) for launch in args.peer_launch)
        peak_rss: list[float] = []
        for repeat in range(args.repeat):
            rows, peak_rss_mb = kvserve_rows(args.dtype, args.server_threads, args.model, repeat)
            served += rows
            peak_rss += [peak_rss_mb] if peak_rss_mb is not None else []
            for peer in args.peer:
                name, _, peer_url = peer.partition("=")
                served += peer_rows(name, peer_url, args.peer_model, launches.get(name), repeat)
        results["kvserve_server_peak_rss_mb"] = max(peak_rss, default=None)
    results["served"] = served

    if not args.served_only:
        prompts = random_prompts(64, 128)
        results["offline"] = offline_rounds(prompts, 128, args.dtype, args.repeat, not args.skip_hf, args.model)
        results["batch1"] = batch1_decode(args.dtype, args.model)
        results["bf16_vs_fp32"] = dtype_agreement.measure(with_hf=not args.skip_hf)

    if "offline" in results:
        print_offline_rows(results, args.dtype)
    if served:
        print_served_rows(results, served)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def print_offline_rows(results: dict[str, Any], dtype: str) -> None:
    print(f"\n## offline 64 x 128/128, {dtype}, {results['threads']} threads")
    print_rounds(results["offline"])
    b1 = results["batch1"]
    print(
        f"\n## batch-1 decode: TPOT {b1['tpot_ms']:.1f} ms; per step {b1['profiled_step_ms']:.1f} ms under the "
        f"profiler, of which matmuls {b1['matmul_ms_per_step']:.1f} ms, "
        f"everything else {b1['overhead_ms_per_step']:.1f} ms"
    )
    dtype_agreement.print_table(results["bf16_vs_fp32"])


def print_served_rows(results: dict[str, Any], served: list[dict[str, Any]]) -> None:
    if served:
        print("\n## served (kvserve replay client, token-id prompts, ignore EOS)")
        print(
            "| run | engine | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | failed | kvserve tok/s ratio "
            "| machine GB/s before | client CPU s |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        base = {(r["run"], r["repeat"]): r["output_tok_s"] for r in served if r["engine"] == "kvserve"}
        repeats = 1 + max(r["repeat"] for r in served)
        for r in served:
            ratio = base.get((r["run"], r["repeat"]), 0) / r["output_tok_s"] if r["output_tok_s"] else None
            label = r["run"] + (f" #{r['repeat'] + 1}" if repeats > 1 else "")
            print(
                f"| {label} | {r['engine']} | {_fmt(r['output_tok_s'])} | {_fmt(r['ttft_p50_ms'])} / "
                f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['tpot_p50_ms'])} / {_fmt(r['tpot_p99_ms'])} | {r['failed']} | "
                f"{_fmt(ratio, 2)} | {_fmt(r['machine_memory_gb_s'])} | {r['client_cpu_s']:.2f} |"
            )
        if repeats > 1:
            print_served_medians(served, base)
        print(f"\nkvserve server peak RSS: {_fmt(results.get('kvserve_server_peak_rss_mb'))} MB")


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


if __name__ == "__main__":
    main()
