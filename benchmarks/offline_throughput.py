"""Offline throughput: N requests of random token ids (default 64 x 128 in / 128 out, ignore EOS)
through kvserve's LLM.generate and through HF transformers' generate() on the same model, dtype and
batch, in one run. Prints output tokens/s for both and the ratio; writes JSON.

    python benchmarks/offline_throughput.py [--num-requests 64] [--input-len 128] [--output-len 128]
        [--dtype bfloat16|float32] [--skip-hf] [--out benchmarks/results/offline_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.registry import bundled_gguf_path


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 32000) for _ in range(length)] for _ in range(count)]


def run_kvserve(prompts: list[list[int]], output_len: int, dtype: str) -> dict:
    llm = LLM(dtype=dtype, enable_prefix_caching=False)
    llm.generate(random_prompts(2, 16, seed=99), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = llm.engine.stats()
    return {
        "engine": "kvserve",
        "dtype": stats["dtype"],
        "attention_backend": stats["attention_backend"],
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "mean_batch_size": stats["mean_batch_size"],
        "steps": stats["steps"],
    }


@torch.inference_mode()
def run_hf(prompts: list[list[int]], output_len: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    path = bundled_gguf_path()
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    # All prompts have the same length, so one padded batch is exact (no padding tokens at all).
    input_ids = torch.tensor(prompts)
    model.generate(input_ids[:2, :16], max_new_tokens=4, do_sample=False)  # warm-up
    start = time.perf_counter()
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len, do_sample=False
    )
    elapsed = time.perf_counter() - start
    tokens = int(out[:, input_ids.shape[1] :].numel())
    return {
        "engine": "hf-transformers",
        "dtype": dtype,
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    prompts = random_prompts(args.num_requests, args.input_len)
    rows = [run_kvserve(prompts, args.output_len, args.dtype)]
    if not args.skip_hf:
        rows.append(run_hf(prompts, args.output_len, args.dtype))
    base = rows[0]["output_tok_s"]
    print(
        f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| engine | output tok/s | seconds | kvserve / engine |")
    print("|---|---|---|---|")
    for row in rows:
        row["kvserve_ratio"] = base / row["output_tok_s"]
        print(f"| {row['engine']} | {row['output_tok_s']:.1f} | {row['seconds']:.2f} | {row['kvserve_ratio']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
