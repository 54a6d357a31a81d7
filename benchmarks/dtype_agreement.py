"""How closely bf16 greedy outputs follow float32 ones, for kvserve and for HF transformers beside it.

Greedy decoding on 16 chat prompts x 64 tokens, the free-running and the teacher-forced measures of
kvserve/bench/agreement.py for each engine (the teacher-forced one: at each position, is bf16's greedy
token float32's when both see float32's output so far?).
HF transformers' own bf16-vs-float32 figures on the same prompts show how much of the difference comes
from bf16 itself rather than from kvserve's kernels.

    python benchmarks/dtype_agreement.py [--skip-hf] [--out benchmarks/results/dtype_agreement.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.agreement import free_running, greedy_agreement
from kvserve.model.registry import bundled_gguf_path

TOPICS = ["the sea", "a city at night", "photosynthesis", "the moon", "trains", "coffee", "rain", "chess"]
DTYPES = ("float32", "bfloat16")


def conversations(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write {n} sentences about {TOPICS[i % len(TOPICS)]}."}]
        for i, n in enumerate(range(2, 2 + count))
    ]


def kvserve_agreement(bf16: LLM, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    reference = [o.token_ids for o in LLM(dtype="float32").generate(prompts, greedy)]
    return greedy_agreement(bf16, prompts, reference)


def hf_agreement(prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    path = bundled_gguf_path()
    load = AutoModelForCausalLM.from_pretrained
    models = {dtype: load(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval() for dtype in DTYPES}
    runs: dict[str, list[list[int]]] = {dtype: [] for dtype in DTYPES}
    matches = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for dtype, model in models.items():  # one prompt at a time: no padding in the way
                out = model.generate(
                    ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
                )
                runs[dtype].append(out[0, len(prompt) :].tolist())
            reference = runs["float32"][-1]
            logits = models["bfloat16"](torch.tensor([prompt + reference])).logits[0]
            predicted = logits[len(prompt) - 1 : len(prompt) - 1 + output_len].argmax(-1)
            matches += int((predicted == torch.tensor(reference)).sum())
    return {
        **free_running(runs["float32"], runs["bfloat16"]),
        "teacher_forced_token_agreement": matches / (len(prompts) * output_len),
    }


def measure(num_prompts: int = 16, output_len: int = 64, with_hf: bool = True) -> dict[str, dict[str, float]]:
    """{engine: its three figures}."""
    bf16 = LLM(dtype="bfloat16")
    prompts = [bf16.tokenizer.encode_chat(conversation) for conversation in conversations(num_prompts)]
    results = {"kvserve": kvserve_agreement(bf16, prompts, output_len)}
    if with_hf:
        results["hf-transformers"] = hf_agreement(prompts, output_len)
    return results


def print_table(
    results: dict[str, dict[str, float]], title: str = "bf16 vs float32 greedy, 16 chat prompts x 64 tokens"
) -> None:
    print(f"\n## {title}")
    print("| engine | requests identical | tokens before first difference | teacher-forced token agreement |")
    print("|---|---|---|---|")
    for engine, r in results.items():
        print(
            f"| {engine} | {r['requests_identical']:.0%} | {r['tokens_before_first_divergence']:.0%} "
            f"| {r['teacher_forced_token_agreement']:.1%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/dtype_agreement.json")
    args = parser.parse_args()
    results = measure(with_hf=not args.skip_hf)
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
