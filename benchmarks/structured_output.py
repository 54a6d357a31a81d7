"""Constrained vs unconstrained decoding: what the grammar mask costs per decode step.

The same chat prompts ("describe <thing> as JSON") run twice per batch size, in one process: free
(no constraint) and constrained by a JSON schema (tests/schema_corpus.py's "a product"), greedy, with
ignore_eos off. To compare steps of equal shape, the free run is given the same number of output tokens
per request as the constrained answer had (max_tokens = that length, ignore_eos), so both runs take the
same number of decode steps at the same batch size; the difference in wall time per step is the cost of
computing masks, applying them and advancing the matchers.

Reported per batch size: decode steps, ms per step free and constrained, the mask's cost per step (ms
and % of the free step) and output tokens/s. Goal (issue 30): <= 10 % of decode throughput at batch 32,
<= 1 ms per step at batch 1.

    python benchmarks/structured_output.py                      # batch 1 and 32
    python benchmarks/structured_output.py --batch-sizes 1 4 --dtype float32

Prints a markdown table; writes benchmarks/results/structured_output.json (kvserve.bench.results).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.bench.results import save_results
from kvserve.structured.grammar import StructuredOutput

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "price", "in_stock", "tags"],
    "additionalProperties": False,
}
THINGS = ["a laptop", "a bicycle", "a teapot", "a novel", "a guitar", "a tent", "a camera", "a lamp"]


def run(llm: LLM, batch: int) -> dict[str, Any]:
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": f"Describe {THINGS[i % len(THINGS)]} as JSON."}])
        for i in range(batch)
    ]
    structured = StructuredOutput("json_schema", SCHEMA)
    constrained_params = SamplingParams(temperature=0, max_tokens=200, structured=structured)
    llm.generate(prompts[:1], constrained_params)  # warm-up: compiles kernels and the tokenizer index
    start, steps = time.perf_counter(), llm.engine.counters.steps
    constrained = llm.generate(prompts, constrained_params)
    constrained_s, constrained_steps = time.perf_counter() - start, llm.engine.counters.steps - steps
    lengths = [len(o.token_ids) for o in constrained]
    free_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start, steps = time.perf_counter(), llm.engine.counters.steps
    llm.generate(prompts, free_params)
    free_s, free_steps = time.perf_counter() - start, llm.engine.counters.steps - steps
    free_ms, constrained_ms = 1e3 * free_s / free_steps, 1e3 * constrained_s / constrained_steps
    return {
        "batch": batch,
        "output_tokens": sum(lengths),
        "steps_free": free_steps,
        "steps_constrained": constrained_steps,
        "ms_per_step_free": free_ms,
        "ms_per_step_constrained": constrained_ms,
        "mask_ms_per_step": constrained_ms - free_ms,
        "mask_share": (constrained_ms - free_ms) / free_ms,
        "tok_s_free": sum(lengths) / free_s,
        "tok_s_constrained": sum(lengths) / constrained_s,
        "all_stopped": all(o.finish_reason == "stop" for o in constrained),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/structured_output.json"))
    args = parser.parse_args()
    # No prefix caching: the second run of the same prompts would skip the prefill the first one paid.
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    rows = [run(llm, batch) for batch in args.batch_sizes]
    print("| batch | steps | ms/step free | ms/step constr. | mask ms/step | mask % | tok/s free | tok/s constr. |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['steps_constrained']} | {r['ms_per_step_free']:.2f} | "
            f"{r['ms_per_step_constrained']:.2f} | {r['mask_ms_per_step']:.2f} | {100 * r['mask_share']:.1f} | "
            f"{r['tok_s_free']:.1f} | {r['tok_s_constrained']:.1f} |"
        )
    meta = {"benchmark": "structured_output", "dtype": str(llm.engine.dtype), "schema": SCHEMA}
    save_results({"meta": meta, "runs": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
