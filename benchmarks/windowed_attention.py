"""Sliding-window layers on the compiled CPU attention kernel (decode_attention.cpp with the layer's
window) against the torch path they took before it had one (SDPA, or the tiled kernel past
TILED_FROM_TOTAL_KEYS keys in the batch; the compiled decode step off), in one process on one model.

- batch-1 decode: one request of --prompt-len random tokens; once it decodes, engine steps alternate
  between the two paths, so a change in this VM's speed hits both: median step time of each;
- offline N x 128/128 (ignore EOS): whole LLM.generate batches, the two paths taking turns for --repeat
  rounds: output tok/s of each.
Only the windowed layers' attention differs between the two; the global layers run the kernel in both.

    python benchmarks/windowed_attention.py [--model gemma3-270m] [--prompt-len 128] [--steps 60]
        [--num-requests 64] [--repeat 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from offline_throughput import random_prompts

from kvserve import LLM, SamplingParams
from kvserve.bench.results import save_results
from kvserve.kernels.attention_cpu import cpu_attention
from kvserve.kernels.backends import AttentionBackend, torch_cpu_attention
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.model.registry import GEMMA3_270M


def windows_on_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The CPU backend as it was before the compiled kernel took windows: windowed layers on torch ops."""
    if window is None:
        return cpu_attention(q, k_cache, v_cache, meta, scale)
    return torch_cpu_attention(q, k_cache, v_cache, meta, scale, window)


WINDOWS_ON_TORCH = AttentionBackend("windows_on_torch", windows_on_torch, windows=True, decode_rows_on_cpu_kernel=False)


class Paths:
    """Switches an engine's runner between the two paths: "kernel" (as loaded) and "torch"."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.loaded = (self.runner.attention, self.runner.compiled_decode)
        assert self.runner.attention is not WINDOWS_ON_TORCH

    def use(self, path: str) -> None:
        self.runner.attention, self.runner.compiled_decode = (
            self.loaded if path == "kernel" else (WINDOWS_ON_TORCH, WINDOWS_ON_TORCH.compiled_decode)
        )


PATHS = ("kernel", "torch")


def batch1_steps(llm: LLM, paths: Paths, prompt_len: int, steps: int) -> dict[str, float]:
    """Median ms per decode step of one request on each path, steps alternating."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    engine.add_request("batch1", random_prompts(1, prompt_len, seed=5)[0], params)
    while engine.scheduler.waiting or min(len(s.output_token_ids) for s in engine.scheduler.running) < 5:
        engine.step()
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for step in range(steps):
        path = PATHS[step % 2]
        paths.use(path)
        start = time.perf_counter()
        engine.step()
        times[path].append((time.perf_counter() - start) * 1e3)
    paths.use("kernel")
    while engine.has_unfinished_requests():
        engine.step()
    return {path: statistics.median(t) for path, t in times.items()}


def offline_rounds(llm: LLM, paths: Paths, num_requests: int, repeat: int) -> list[dict[str, float]]:
    """Output tok/s of each path per round, the paths taking turns (kernel first)."""
    prompts = random_prompts(num_requests, 128)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rounds = []
    for _ in range(repeat):
        row = {}
        for path in PATHS:
            paths.use(path)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            row[path] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
        rounds.append(row)
    paths.use("kernel")
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=GEMMA3_270M)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128], help="batch-1 prompt lengths")
    parser.add_argument("--steps", type=int, default=60, help="measured batch-1 decode steps, both paths")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="offline rounds, each path once per round")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "windowed_attention.json")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    llm.generate(random_prompts(2, 16, seed=99), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    paths = Paths(llm)
    windows = sorted({w for w in llm.engine.model.layer_windows if w is not None})
    print(f"{args.model} {args.dtype}, windows {windows}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    batch1 = []
    print("| batch-1 prompt | kernel ms/step | torch ms/step | torch / kernel |\n|---|---|---|---|")
    for prompt_len in args.prompt_len:
        median = batch1_steps(llm, paths, prompt_len, args.steps)
        batch1.append({"prompt_len": prompt_len, **median})
        kernel, on_torch = median["kernel"], median["torch"]
        print(f"| {prompt_len} | {kernel:.2f} | {on_torch:.2f} | {on_torch / kernel:.3f} |")
    rounds = offline_rounds(llm, paths, args.num_requests, args.repeat)
    print(f"\n| offline {args.num_requests} x 128/128 round | kernel tok/s | torch tok/s | kernel / torch |")
    print("|---|---|---|---|")
    for i, row in enumerate(rounds):
        print(f"| {i + 1} | {row['kernel']:.1f} | {row['torch']:.1f} | {row['kernel'] / row['torch']:.3f} |")
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "windows": windows}
    save_results({"env": env, "model": args.model, "batch1": batch1, "offline": rounds}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
