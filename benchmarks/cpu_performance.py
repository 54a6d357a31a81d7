"""CPU performance, side by side in one run: kvserve offline, kvserve served over HTTP, HF transformers,
and any peer servers you have running (vLLM-CPU, llama.cpp's llama-server, set up outside this
repository), all on the same model, workload and dtype.

Rows:
- offline 64 x 128/128 (ignore EOS): kvserve LLM.generate vs HF generate() (benchmarks/offline_throughput.py,
  which runs vLLM's LLM.generate too);
- batch-1 decode: one 128-token prompt, 128 outputs: TPOT, and per-step time outside matrix products
  (the Python/op overhead, from the torch profiler over a few steps);
- roofs: this machine's GEMM rates and stream bandwidth, probed in this run for every CPU path it executes
  (roofs.py), and each row's share of its roof on the path kvserve ran (row_roofs.py: batch-1 TPOT, the
  offline and all-at-once rows' tok/s; Poisson arrivals have none), each engine's roof from the bytes and
  FLOPs of its own weights: kvserve's as it ran, HF's dense in the dtype, a peer's as --peer-weights
  NAME=bf16|fp32|gguf says (gguf: the GGUF file's tensors as stored); a peer without one has no roof, and
  its share is printed n/a;
- bf16 vs float32 greedy agreement, kvserve's and HF's (benchmarks/dtype_agreement.py; always on the
  default model, which has a chat template: --model chooses the model of the other rows);
- served: `kvserve serve` started here, driven by kvserve's replay client (`kvserve bench serve`):
  100 requests 128/128 all at once; Poisson 2 req/s x 60; max-concurrency 1 x 6;
  the same client against every `--peer NAME=URL` (an OpenAI-compatible server, running already or
  started by `--peer-launch NAME=COMMAND` just for its own rows, so that servers never share the cores).
Prints a table of output tok/s, TTFT and TPOT p50/p99, failures, the replay client's own CPU seconds
and peak RSS, with ratios to kvserve; writes JSON.

    python benchmarks/cpu_performance.py [--model gemma3-270m] [--dtype bfloat16] [--quantization auto]
        [--cpu-path avx2] [--skip-hf] [--skip-served] [--served-only | --batch1-only] [--repeat N]
        [--peer vllm=http://127.0.0.1:8001 --peer llamacpp=http://127.0.0.1:8002]
        [--peer-launch vllm="COMMAND that starts it" ...] [--peer-weights vllm=bf16 --peer-weights llamacpp=gguf]

--cpu-path forces kvserve's own rows onto one CPU path (KVSERVE_CPU_ISA; default: the CPU's best): the
server it starts, and this process's in-process rows, whose torch is capped to the path (isa.cap_torch)
before it computes anything, as kvserve's CLI does. Peers and the roof probes run in an environment
without it.

With --repeat N the served rows run in N rounds (fresh prompts each round); each round runs every
engine's rows in turn, each server started for its round and stopped after it. The offline row runs N
rounds too, kvserve and HF taking turns (offline_throughput.py). This VM's memory speed
moves within minutes, so a ratio is taken within one round, between engines measured minutes apart,
and a second table gives each row's median tok/s and median ratio to kvserve.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
import roofs
import row_roofs
import torch
from cpu_performance_tables import print_tables
from offline_throughput import attach_shares as attach_offline_shares
from offline_throughput import offline_rounds, random_prompts
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.bench.generators import LengthDist, random_workload
from kvserve.bench.metrics import summarize
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.config import QUANTIZATIONS
from kvserve.engine.platform import keeps_quantized
from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model.decode_cost import DecodeCost
from kvserve.model.registry import DEFAULT_MODEL

MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "kvserve::gemv_bf16", "kvserve::quant_gemv")
PROMPT_LEN = OUTPUT_LEN = 128  # every row's
OFFLINE_REQUESTS = 64
SERVED_RUNS = {  # name: (requests, rate per second, max concurrency, seed)
    "served 100x128/128 all at once": (100, float("inf"), None, 1),
    "served Poisson 2 req/s x 60": (60, 2.0, None, 2),
    "served batch 1 (concurrency 1) x 6": (6, float("inf"), 1, 3),
}


def batch1_decode(dtype: str, model: str, quantization: str) -> dict[str, Any]:
    llm = LLM(model=model, dtype=dtype, quantization=quantization, enable_prefix_caching=False)
    prompt_len, output_len = PROMPT_LEN, OUTPUT_LEN
    prompt = random_prompts(1, prompt_len, seed=5)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))[0]
    times = out.metrics.token_times
    tpot = (times[-1] - times[0]) / (len(times) - 1)
    # The median interval too: one burst of other work on the shared cores moves the mean, not the median.
    tpot_p50 = statistics.median(later - earlier for earlier, later in itertools.pairwise(times))

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
        "tpot_p50_ms": tpot_p50 * 1000,
        "profiled_step_ms": wall * 1000,
        "matmul_ms_per_step": matmul_us / 1000,
        "overhead_ms_per_step": wall * 1000 - matmul_us / 1000,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class StartError(RuntimeError):
    """A server exited, or did not answer, during start-up."""


def wait_until_ready(proc: subprocess.Popen, url: str, path: str, name: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:  # a negative code is the signal's number (-4: SIGILL)
            raise StartError(f"{name} exited during start-up (exit code {proc.returncode})")
        time.sleep(1)
    proc.kill()
    raise StartError(f"{name} did not become ready in {timeout_s:.0f} s")


def start_kvserve(
    dtype: str, threads: int | None, model: str = DEFAULT_MODEL, quantization: str = "none"
) -> tuple[subprocess.Popen, str]:
    # The first start after a kernel source change compiles them (~4 min on 2 cores): done here, so the
    # server finds them built and its start-up timeout measures only its own start-up.
    cpu.load()
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", str(port), "--dtype", dtype,
           "--quantization", quantization]  # fmt: skip
    if threads:
        cmd += ["--num-threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(proc, url, "/health", "kvserve serve", 300)
    return proc, url


def kvserve_rows(
    dtype: str, threads: int | None, model: str, quantization: str, repeat: int
) -> tuple[list[dict[str, Any]], float | None]:
    """One round of the served rows against a `kvserve serve` started for it, and the server's peak RSS."""
    proc, url = start_kvserve(dtype, threads, model, quantization)
    try:
        rows = served_rows("kvserve", url, served_model(url), repeat)
    finally:
        peak_mb = peak_rss_mb(proc.pid)
        proc.terminate()
        proc.wait(timeout=60)
    return rows, peak_mb


def peer_rows(
    name: str, url: str, model: str | None, launch: str | None, env: dict[str, str], repeat: int
) -> list[dict[str, Any]]:
    """One round of the served rows against a peer; with `launch` (a shell line, run in `env`) the peer is
    started just before and stopped just after, so no two servers share the cores while either is measured."""
    proc = None
    if launch:
        proc = subprocess.Popen(launch, shell=True, start_new_session=True, env=env, stdout=subprocess.DEVNULL,
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


def served_rows(name: str, url: str, model: str, repeat: int) -> list[dict[str, Any]]:
    """SERVED_RUNS in order, one row each, tagged with the round `repeat`. This VM's memory speed moves 2x
    within a session, so each engine's rows carry the stream bandwidth (roofs.py) measured just before them."""
    machine = roofs.stream_read(2**30, huge_pages=True)["gb_s"]
    rows = []
    for run, (count, rate, concurrency, run_seed) in SERVED_RUNS.items():
        # Fresh prompts per run and repeat (a different seed): none is served from a warm prefix cache.
        seed = run_seed + 1000 * repeat
        lengths = LengthDist.parse(str(PROMPT_LEN)), LengthDist.parse(str(OUTPUT_LEN))
        workload = random_workload(count, rate, *lengths, seed=seed)
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


def attach_shares(
    results: dict[str, Any], path_roofs: dict[str, Any], costs: dict[str, tuple[row_roofs.Weights, DecodeCost]]
) -> None:
    """Each batch-1 and served row's roof on kvserve's path and its share of it (row_roofs.py), from the
    weights and cost of the row's own engine (`costs`, by engine name). An engine missing from `costs` gets
    no roof: its rows' share is None, and "roof_weights" None says why (n/a, not a row without a roof)."""
    results["row_roofs"] = {}
    for engine, (weights, cost) in costs.items():
        gemm, gemm_kind = row_roofs.gemm_rate(path_roofs, weights)
        results["row_roofs"][engine] = {
            "weights": dataclasses.asdict(weights),
            "gemm": gemm_kind,
            "weight_bytes_per_step": cost.weight_bytes,
            "batch1": row_roofs.batch1_roof(cost, path_roofs, gemm, PROMPT_LEN, OUTPUT_LEN),
        }
        for count, rate, concurrency, _ in SERVED_RUNS.values():
            if rate == float("inf") and concurrency is None:
                roof = row_roofs.batch_roof(cost, path_roofs, gemm, count, PROMPT_LEN, OUTPUT_LEN)
                results["row_roofs"][engine][f"{count} at once"] = roof
    if "batch1" in results:
        roof = results["row_roofs"]["kvserve"]["batch1"]
        results["batch1"]["share_of_roof"] = roof["tpot_ms"] / results["batch1"]["tpot_p50_ms"]
    for row in results["served"]:
        engine_roofs = results["row_roofs"].get(row["engine"])
        row["roof_weights"] = None if engine_roofs is None else engine_roofs["weights"]
        row["share_of_roof"] = None if engine_roofs is None else _served_share(row, engine_roofs)


def _served_share(row: dict[str, Any], engine_roofs: dict[str, Any]) -> float | None:
    count, rate, concurrency, _ = SERVED_RUNS[row["run"]]
    if concurrency == 1:
        return engine_roofs["batch1"]["tpot_ms"] / row["tpot_p50_ms"] if row["tpot_p50_ms"] else None
    if rate == float("inf"):
        return row["output_tok_s"] / engine_roofs[f"{count} at once"]["output_tok_s"]
    return None  # arrivals over time: no single batch, no roof


def engine_costs(
    model: str, dtype: str, quantization: str, peer_weights: dict[str, str]
) -> dict[str, tuple[row_roofs.Weights, DecodeCost]]:
    """kvserve's weights and cost as its rows ran, and each peer's named in `peer_weights` (NAME: a key of
    row_roofs.PEER_WEIGHTS)."""
    held = {"kvserve": row_roofs.kvserve_weights(dtype, quantization)}
    held |= {name: row_roofs.PEER_WEIGHTS[kind] for name, kind in peer_weights.items()}
    return {name: (weights, row_roofs.model_cost(model, weights)) for name, weights in held.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the bundled model kvserve's own rows run")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--quantization", default="none", choices=QUANTIZATIONS, help="kvserve's own rows' (as serve's)"
    )
    parser.add_argument(
        "--cpu-path", default=None, choices=[isa.name for isa in build_config.executable_isas()],
        help="force kvserve's own rows onto this CPU path (default: the CPU's best)",
    )  # fmt: skip
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--served-only", action="store_true", help="skip the offline, batch-1 and dtype rows")
    rows.add_argument("--batch1-only", action="store_true", help="only the roofs and the batch-1 row")
    parser.add_argument("--server-threads", type=int, default=None, help="torch threads of the kvserve server")
    parser.add_argument("--peer", action="append", default=[], help="NAME=URL of a running OpenAI-compatible server")
    parser.add_argument("--peer-model", default=None, help="model name the peers serve (default: ask /v1/models)")
    parser.add_argument(
        "--peer-launch", action="append", default=[],
        help="NAME=COMMAND: start peer NAME with this shell line right before its rows, stop it after",
    )  # fmt: skip
    parser.add_argument(
        "--peer-weights", action="append", default=[],
        help=f"NAME=WEIGHTS, one of {sorted(row_roofs.PEER_WEIGHTS)}: what peer NAME reads per step, for its "
        "share of roof (gguf: the GGUF file's tensors as stored); a peer without it has no share (n/a)",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="run the served rows in this many rounds, every engine once per round (this VM's speed moves "
        "within minutes); the table then adds each row's median",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/cpu_performance.json")
    args = parser.parse_args()
    peer_weights = dict(item.split("=", 1) for item in args.peer_weights)
    peer_names = {peer.partition("=")[0] for peer in args.peer}
    for name, kind in peer_weights.items():
        if name not in peer_names or kind not in row_roofs.PEER_WEIGHTS:
            kinds = sorted(row_roofs.PEER_WEIGHTS)
            parser.error(f"--peer-weights {name}={kind}: NAME must be a --peer's, WEIGHTS one of {kinds}")

    # The peers' and the roof probes' environment: without this run's forced path.
    base_env = dict(os.environ)
    if args.cpu_path:
        os.environ[cpu_isa.ENV] = args.cpu_path
    path = cpu_isa.selected()
    cpu_isa.cap_torch(path)  # nothing here has computed with torch yet
    results: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "quantized": keeps_quantized(args.quantization, torch.device("cpu")),
        "cpu_path": path.describe(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "roofs": roofs.measure_every_path(base_env),
        "peer_start_failures": [],
    }
    # The served rows run first, before this process loads and frees engines and HF models of its own.
    # Run after the bf16-vs-fp32 agreement rows, kvserve's first served run (all at once) was markedly
    # slower than after nothing or after the offline, HF or batch-1 rows alone (figures:
    # benchmarks/RESULTS.md, "Figures behind the code's rules"). Which resource of the VM that churn ties up was not
    # found (no CPU is used meanwhile); a server should not pay for its benchmark client's history.
    served: list[dict[str, Any]] = []
    if not (args.skip_served or args.batch1_only):
        launches = dict(launch.split("=", 1) for launch in args.peer_launch)
        peak_rss: list[float] = []
        for repeat in range(args.repeat):
            rows_, peak_rss_mb = kvserve_rows(args.dtype, args.server_threads, args.model, args.quantization, repeat)
            served += rows_
            peak_rss += [peak_rss_mb] if peak_rss_mb is not None else []
            for peer in args.peer:
                name, _, peer_url = peer.partition("=")
                try:
                    served += peer_rows(name, peer_url, args.peer_model, launches.get(name), base_env, repeat)
                except StartError as error:  # a peer that cannot start loses its own rows, not the run's
                    print(f"{error}: its rows are left out", file=sys.stderr)
                    results["peer_start_failures"].append({"engine": name, "round": repeat, "error": str(error)})
        results["kvserve_server_peak_rss_mb"] = max(peak_rss, default=None)
    results["served"] = served

    if not args.served_only:
        if not args.batch1_only:
            prompts = random_prompts(OFFLINE_REQUESTS, PROMPT_LEN)
            results["offline"] = offline_rounds(
                prompts, OUTPUT_LEN, args.dtype, args.repeat, not args.skip_hf, args.model, (args.quantization,)
            )
        results["batch1"] = batch1_decode(args.dtype, args.model, args.quantization)
        if not args.batch1_only:
            results["bf16_vs_fp32"] = dtype_agreement.measure(with_hf=not args.skip_hf)

    path_roofs = next(r for r in results["roofs"] if r["path"] == path.isa.name)
    attach_shares(results, path_roofs, engine_costs(args.model, args.dtype, args.quantization, peer_weights))
    if "offline" in results:
        attach_offline_shares(results["offline"], path_roofs)
    print_tables(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
