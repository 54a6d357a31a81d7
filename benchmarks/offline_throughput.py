"""Offline throughput: N requests of random token ids (default 64 x 128 in / 128 out, ignore EOS)
through kvserve's LLM.generate and through HF transformers' generate() on the same model, dtype and
batch, in one run. Prints output tokens/s for both and the ratio; writes JSON.

Each engine is loaded once; with --repeat N the two then take turns, N rounds of one timed batch each,
and the ratio is taken within each round. This VM's speed moves between minutes (kvserve gave 1,410-1,515
tok/s in single runs on one day), so one pair of runs can land on either side of a line that the median
of several rounds does not.

    python benchmarks/offline_throughput.py [--num-requests 64] [--input-len 128] [--output-len 128]
        [--dtype bfloat16|float32] [--repeat 3] [--skip-hf] [--out benchmarks/results/offline_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.registry import DEFAULT_MODEL, bundled_gguf_path

# One timed batch: (prompts, output_len) -> (seconds, output tokens).
TimedBatch = Callable[[list[list[int]], int], tuple[float, int]]


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 32000) for _ in range(length)] for _ in range(count)]


def load_kvserve(
    dtype: str, model: str = DEFAULT_MODEL, quantization: str = "none"
) -> tuple[TimedBatch, Callable[[], dict]]:
    """kvserve's engine, loaded and warmed up: its timed batch, and the engine facts to report."""
    llm = LLM(model=model, dtype=dtype, quantization=quantization, enable_prefix_caching=False)
    llm.generate(random_prompts(2, 16, seed=99), SamplingParams(temperature=0, max_tokens=4))  # warm-up

    def timed(prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)

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

    def timed(prompts: list[list[int]], output_len: int) -> tuple[float, int]:
        # All prompts have the same length, so one padded batch is exact (no padding tokens at all).
        input_ids = torch.tensor(prompts)
        start = time.perf_counter()
        out = generate(input_ids, output_len)
        return time.perf_counter() - start, int(out[:, input_ids.shape[1] :].numel())

    return timed


def offline_rounds(
    prompts: list[list[int]],
    output_len: int,
    dtype: str,
    repeat: int = 1,
    with_hf: bool = True,
    model: str = DEFAULT_MODEL,
    quantization: str = "none",
) -> dict:
    """Both engines loaded once, then `repeat` rounds of one timed batch each, kvserve first. Returns the
    rounds ({engine: {seconds, output_tokens, output_tok_s}} each), kvserve's engine facts and, with HF,
    each round's ratio kvserve / HF and their median."""
    engines: dict[str, TimedBatch] = {}
    engines["kvserve"], kvserve_facts = load_kvserve(dtype, model, quantization)
    if with_hf:
        engines["hf-transformers"] = load_hf(dtype, model)
    rounds = []
    for _ in range(repeat):
        row = {}
        for name, timed in engines.items():
            seconds, tokens = timed(prompts, output_len)
            row[name] = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}
        rounds.append(row)
    result: dict = {"model": model, "dtype": dtype, "kvserve": kvserve_facts(), "rounds": rounds}
    if with_hf:
        ratios = [r["kvserve"]["output_tok_s"] / r["hf-transformers"]["output_tok_s"] for r in rounds]
        result["ratios_kvserve_to_hf"] = ratios
        result["median_ratio_kvserve_to_hf"] = statistics.median(ratios)
    return result


def print_rounds(result: dict) -> None:
    engines = list(result["rounds"][0])
    print("| round | " + " | ".join(f"{e} tok/s" for e in engines) + " | kvserve / HF |")
    print("|---" * (len(engines) + 2) + "|")
    ratios = result.get("ratios_kvserve_to_hf")
    for i, row in enumerate(result["rounds"]):
        cells = " | ".join(f"{row[e]['output_tok_s']:.1f}" for e in engines)
        ratio = f"{ratios[i]:.2f}x" if ratios else "-"
        print(f"| {i + 1} | {cells} | {ratio} |")
    if ratios:
        print(f"median kvserve / HF over {len(ratios)} rounds: {result['median_ratio_kvserve_to_hf']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a bundled model's name (both engines read its GGUF)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeat", type=int, default=3, help="rounds, each engine timed once per round")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    prompts = random_prompts(args.num_requests, args.input_len)
    result = offline_rounds(prompts, args.output_len, args.dtype, args.repeat, not args.skip_hf, args.model)
    print(
        f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print_rounds(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), **result}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
