"""Offline throughput: N requests of random token ids (default 64 x 128 in / 128 out, ignore EOS) through
kvserve's LLM.generate (dense, or with --quantization auto in the GGUF's blocks, or both), HF transformers'
generate() and vLLM-CPU's LLM.generate, on the same model, prompts and batch, in one run. Prints each
engine's output tokens/s, its share of its roofs, and every ratio kvserve / peer; writes JSON.

vLLM runs in a process of its own under its own Python (--vllm-python: vLLM-CPU is installed outside this
repository, as the peers' README says), through the peers' script bench_vllm_offline.py (--vllm-script). It
loads the model, warms up, times one LLM.generate of N prompts and prints `RESULT {json}`; its prompts are
`random.Random(seed)`'s draws of ids in [100, 49152) (PEER_SCRIPT_IDS), and this script gives every engine
the very same draw. vLLM gets as many OpenMP threads, bound one to a core, as kvserve has torch threads,
and a 4 GiB K/V pool (VLLM_ENV; the environment overrides them).

Roofs: this machine's stream bandwidth and GEMM rate are probed in this run on this process's CPU path
(roofs.py), and each engine's bytes and FLOPs come from how it holds the model (row_roofs.Weights: kvserve
as loaded, HF and vLLM dense in their dtype). A row's share of the step-bytes roof is its tok/s over
output tokens / (bytes every step reads / stream); its share of the roofline takes the slower of that and
FLOPs / GEMM rate (row_roofs.batch_roof).

Each engine is loaded once (vLLM once per round, in its own process); with --repeat N they then take turns,
N rounds of one timed batch each, and every ratio is taken within a round. This VM's speed moves between
minutes (kvserve gave 1,410-1,515 tok/s in single runs on one day), so one pair of runs can land on either
side of a line that the median of several rounds does not.

    python benchmarks/offline_throughput.py [--num-requests 64] [--input-len 128] [--output-len 128]
        [--dtype bfloat16|float32] [--quantization none --quantization auto] [--skip-hf]
        [--vllm-dtype float32 --vllm-dtype bfloat16 --vllm-script PATH/bench_vllm_offline.py]
        [--repeat 3] [--out benchmarks/results/offline_throughput.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import roofs
import row_roofs
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import QUANTIZATIONS
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model.registry import DEFAULT_MODEL, bundled_gguf_path

# One timed batch: (prompts, output_len) -> {seconds, output_tokens, and whatever else the engine reports}.
TimedBatch = Callable[[list[list[int]], int], dict[str, Any]]

# The ids bench_vllm_offline.py draws its prompts from (SmolLM2's specials are below 100; its vocab is 49152).
PEER_SCRIPT_IDS = range(100, 49152)
PEERS = Path(os.environ.get("PEERS", Path.home() / "kvserve-peers"))
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{torch.get_num_threads() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
VLLM_WEIGHTS = {"bfloat16": "bf16", "float32": "fp32"}  # vLLM's --dtype -> its dense weights' name


def random_prompts(count: int, length: int, seed: int = 0, ids: range = range(1000, 32000)) -> list[list[int]]:
    """`count` prompts of `length` ids drawn uniformly from `ids`, prompt after prompt."""
    rng = random.Random(seed)
    return [[rng.randrange(ids.start, ids.stop) for _ in range(length)] for _ in range(count)]


def kvserve_name(quantization: str) -> str:
    return "kvserve" if quantization == "none" else "kvserve-q"


def load_kvserve(
    dtype: str, model: str = DEFAULT_MODEL, quantization: str = "none"
) -> tuple[TimedBatch, Callable[[], dict]]:
    """kvserve's engine, loaded and warmed up: its timed batch, and the engine facts to report."""
    llm = LLM(model=model, dtype=dtype, quantization=quantization, enable_prefix_caching=False)
    llm.generate(random_prompts(2, 16, seed=99), SamplingParams(temperature=0, max_tokens=4))  # warm-up

    def timed(prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return {"seconds": time.perf_counter() - start, "output_tokens": sum(len(o.token_ids) for o in outputs)}

    def facts() -> dict:
        stats = llm.engine.stats()
        keys = ("dtype", "attention_backend", "mean_batch_size", "steps")  # steps: summed over the rounds
        return {key: stats[key] for key in keys}

    return timed, facts


def load_hf(dtype: str, model: str = DEFAULT_MODEL) -> TimedBatch:
    """HF transformers on the same GGUF file, loaded and warmed up: its timed batch."""
    from transformers import AutoModelForCausalLM

    path = bundled_gguf_path(model)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    # Loaded outside torch.inference_mode(), as a user loads it: loaded inside, its parameters are inference
    # tensors, and bf16 generate() then runs much slower, mostly in aten::copy_ (see the correction note
    # at the top of benchmarks/RESULTS.md).
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def generate(input_ids: torch.Tensor, output_len: int) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return hf.generate(input_ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False)

    generate(torch.tensor(random_prompts(2, 16, seed=99)), 4)  # warm-up

    def timed(prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        # All prompts have the same length, so one padded batch is exact (no padding tokens at all).
        input_ids = torch.tensor(prompts)
        start = time.perf_counter()
        out = generate(input_ids, output_len)
        return {"seconds": time.perf_counter() - start, "output_tokens": int(out[:, input_ids.shape[1] :].numel())}

    return timed


def parse_vllm_result(stdout: str) -> dict[str, Any]:
    """The peers' script's `RESULT {json}` line (its last), with its `SANITY` lines under "sanity"."""
    lines = stdout.splitlines()
    results = [line.removeprefix("RESULT ") for line in lines if line.startswith("RESULT ")]
    if not results:
        raise ValueError("the vLLM script printed no RESULT line")
    return {**json.loads(results[-1]), "sanity": [line for line in lines if line.startswith("SANITY")]}


@dataclasses.dataclass(frozen=True)
class VllmRunner:
    python: Path  # vLLM-CPU's own interpreter
    script: Path  # the peers' bench_vllm_offline.py
    model: Path  # the model as an HF directory vLLM loads

    def timed(self, dtype: str, seed: int) -> TimedBatch:
        """vLLM's timed batch at `dtype`: a process of its own per batch (loading the model each time),
        on the prompts the script draws from `seed`, which must be the prompts it is given."""

        def timed(prompts: list[list[int]], output_len: int) -> dict[str, Any]:
            count, length = len(prompts), len(prompts[0])
            if prompts != random_prompts(count, length, seed, PEER_SCRIPT_IDS):
                raise ValueError(f"vLLM's script draws its prompts from seed {seed}: give every engine that draw")
            sizes = ["--n", str(count), "--in-len", str(length), "--out-len", str(output_len), "--seed", str(seed)]
            cmd = [str(self.python), str(self.script), "--model", str(self.model), "--dtype", dtype, *sizes]
            out = subprocess.run(cmd, env={**VLLM_ENV, **os.environ}, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"vLLM ({dtype}) exited with {out.returncode}:\n{out.stderr[-3000:]}")
            result = parse_vllm_result(out.stdout)
            return {"seconds": result["elapsed_s"], "output_tokens": result["output_tokens"],
                    "load_s": result["load_s"], "sanity": result["sanity"]}  # fmt: skip

        return timed


def offline_rounds(
    prompts: list[list[int]],
    output_len: int,
    dtype: str,
    repeat: int = 1,
    with_hf: bool = True,
    model: str = DEFAULT_MODEL,
    quantizations: tuple[str, ...] = ("none",),
    vllm: VllmRunner | None = None,
    vllm_dtypes: tuple[str, ...] = (),
    seed: int = 0,
) -> dict:
    """kvserve (at each of `quantizations`) and HF loaded once, vLLM (at each of `vllm_dtypes`) run by
    `vllm` in a process per batch; then `repeat` rounds of one timed batch each, kvserve first. Returns the
    rounds ({engine: {seconds, output_tokens, output_tok_s, ...}} each), every engine's weights
    (row_roofs.Weights) and kvserve's facts, and each round's ratio of every kvserve engine to every peer."""
    if vllm_dtypes and vllm is None:
        raise ValueError("vllm_dtypes need a VllmRunner")
    engines: dict[str, TimedBatch] = {}
    weights: dict[str, row_roofs.Weights] = {}
    facts: dict[str, Callable[[], dict]] = {}
    for quantization in quantizations:
        name = kvserve_name(quantization)
        engines[name], facts[name] = load_kvserve(dtype, model, quantization)
        weights[name] = row_roofs.kvserve_weights(dtype, quantization)
    if with_hf:
        engines["hf-transformers"] = load_hf(dtype, model)
        weights["hf-transformers"] = row_roofs.Weights(dtype, False, dtype)
    if vllm is not None:
        for vllm_dtype in vllm_dtypes:
            name = f"vllm-cpu {VLLM_WEIGHTS[vllm_dtype]}"
            engines[name] = vllm.timed(vllm_dtype, seed)
            weights[name] = row_roofs.PEER_WEIGHTS[VLLM_WEIGHTS[vllm_dtype]]
    rounds = []
    for _ in range(repeat):
        row = {}
        for name, timed in engines.items():
            measured = timed(prompts, output_len)
            row[name] = {**measured, "output_tok_s": measured["output_tokens"] / measured["seconds"]}
        rounds.append(row)
    return {
        "model": model,
        "dtype": dtype,
        "num_requests": len(prompts),
        "input_len": len(prompts[0]),
        "output_len": output_len,
        "engines": {
            name: {"weights": dataclasses.asdict(weights[name]), **({"facts": facts[name]()} if name in facts else {})}
            for name in engines
        },
        "rounds": rounds,
        "ratios": round_ratios(rounds),
    }


def round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{"KVSERVE / PEER": {per_round, median}} for every kvserve engine and every other engine, each ratio
    of output tok/s taken within one round."""
    names = list(rounds[0])
    ratios = {}
    for ours in (n for n in names if n.startswith("kvserve")):
        for peer in (n for n in names if not n.startswith("kvserve")):
            per_round = [r[ours]["output_tok_s"] / r[peer]["output_tok_s"] for r in rounds]
            ratios[f"{ours} / {peer}"] = {"per_round": per_round, "median": statistics.median(per_round)}
    return ratios


def attach_shares(result: dict, path_roofs: dict[str, Any]) -> None:
    """Each engine's roofs on `path_roofs` from its own weights (row_roofs.batch_roof) into
    result["engines"], and every row's share of them."""
    for engine in result["engines"].values():
        weights = row_roofs.Weights(**engine["weights"])
        gemm, gemm_kind = row_roofs.gemm_rate(path_roofs, weights)
        cost = row_roofs.model_cost(result["model"], weights)
        sizes = result["num_requests"], result["input_len"], result["output_len"]
        roof = row_roofs.batch_roof(cost, path_roofs, gemm, *sizes)
        engine["roof"] = {**roof, "gemm": gemm_kind, "weight_bytes_per_step": cost.weight_bytes}
    for row in result["rounds"]:
        for name, measured in row.items():
            roof = result["engines"][name]["roof"]
            measured["share_of_step_bytes_roof"] = measured["output_tok_s"] / roof["memory_tok_s"]
            measured["share_of_roofline"] = measured["output_tok_s"] / roof["output_tok_s"]


def print_rounds(result: dict) -> None:
    """The rows (with their shares once attach_shares ran), each engine's roofs, and the ratios."""
    shares = "share_of_roofline" in result["rounds"][0][next(iter(result["rounds"][0]))]
    print("| round | engine | seconds | out tok/s |" + (" share of step-bytes roof | share of roofline |" * shares))
    print("|---|---|---|---|" + "---|---|" * shares)
    for i, row in enumerate(result["rounds"]):
        for name, r in row.items():
            cells = f"| {i + 1} | {name} | {r['seconds']:.1f} | {r['output_tok_s']:.1f} |"
            if shares:
                cells += f" {r['share_of_step_bytes_roof']:.1%} | {r['share_of_roofline']:.1%} |"
            print(cells)
    if shares:
        print("\n| engine | weights (dtype, GGUF blocks, K/V) | MB read per step | step-bytes roof tok/s "
              "| FLOPs roof tok/s (GEMM) | roofline tok/s |\n|---|---|---|---|---|---|")  # fmt: skip
        for name, engine in result["engines"].items():
            w, roof = engine["weights"], engine["roof"]
            print(
                f"| {name} | {w['dtype']}, {'yes' if w['quantized'] else 'no'}, {w['kv_dtype']} | "
                f"{roof['weight_bytes_per_step'] / 1e6:.1f} | {roof['memory_tok_s']:.0f} | "
                f"{roof['compute_tok_s']:.0f} ({roof['gemm']}) | {roof['output_tok_s']:.0f} ({roof['bound']}) |"
            )
    if result["ratios"]:
        print("\n| ratio | per round | median |\n|---|---|---|")
        for pair, ratio in result["ratios"].items():
            rounds = " / ".join(f"{r:.2f}x" for r in ratio["per_round"])
            print(f"| {pair} | {rounds} | {ratio['median']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a bundled model's name (kvserve and HF read its GGUF)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the prompts' (every engine's, vLLM's script's too)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="kvserve's and HF's")
    parser.add_argument(
        "--quantization", action="append", choices=QUANTIZATIONS,
        help="kvserve's, as serve's; repeat it for one kvserve engine each (default: none)",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3, help="rounds, each engine timed once per round")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--vllm-dtype", action="append", default=[], choices=list(VLLM_WEIGHTS),
        help="run vLLM-CPU at this dtype; repeat it for each",
    )  # fmt: skip
    parser.add_argument("--vllm-python", type=Path, default=PEERS / "vllm/bin/python")
    parser.add_argument(
        "--vllm-script", type=Path, default=Path(__file__).resolve().parents[2] / "shared/peers/bench_vllm_offline.py"
    )
    parser.add_argument("--vllm-model", type=Path, default=PEERS / "smol-hf", help="the model as an HF directory")
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    # Before any engine loads: the probes run in a process of their own, on this process's path.
    path_roofs = roofs.measure_path(cpu_isa.selected().isa.name, dict(os.environ))
    prompts = random_prompts(args.num_requests, args.input_len, args.seed, PEER_SCRIPT_IDS)
    vllm = VllmRunner(args.vllm_python, args.vllm_script, args.vllm_model) if args.vllm_dtype else None
    quantizations = tuple(args.quantization or ["none"])
    result = offline_rounds(
        prompts, args.output_len, args.dtype, args.repeat, not args.skip_hf, args.model, quantizations,
        vllm, tuple(args.vllm_dtype), args.seed,
    )  # fmt: skip
    attach_shares(result, path_roofs)
    print(
        f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out, kvserve and HF {args.dtype}, "
        f"{torch.get_num_threads()} threads, vLLM env { {k: {**VLLM_ENV, **os.environ}[k] for k in VLLM_ENV} }"
    )
    print(
        f"roofs ({path_roofs['describe']}): stream {path_roofs['stream_huge']['gb_s']:.1f} GB/s on huge pages, "
        f"GEMM bf16 {path_roofs['gemm_bf16']['flop_s'] / 1e9:.1f} / fp32 {path_roofs['gemm_fp32']['flop_s'] / 1e9:.1f} "
        "GFLOP/s"
    )
    print_rounds(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "roofs": path_roofs, **result}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
