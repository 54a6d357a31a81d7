"""Speculative decoding on vs off (book §31.5): where proposing and verifying extra tokens pays, and where not.

Two workloads, chat-templated, greedy, exactly --max-tokens output tokens each (ignore_eos):
- copy: "Repeat the following passage exactly" with a ~150-token passage (its sentences rotated per
  request), so the continuation is mostly in the prompt: n-gram lookup's best case;
- open: open-ended writing prompts, where the continuation is not in the prompt.
Each at batch 1 (--solo-requests requests, one after another) and batch 16 (16 requests at once), with
no speculation, n-gram (k=4) and a self-draft (the target's first 12 layers, k=3), adaptive k on.
Each workload and batch loads a fresh engine per method (so acceptance and step-time estimates start
alike), warms each with one request too short to speculate, then gives every engine the same requests and
steps the engines in turn, each step timed alone: a change in the machine's speed then hits every method
alike. Run one after another, the same engine's speed moved between runs by more than the few per cent a
row is judged by (figures: benchmarks/RESULTS.md, "Zen 4 again"). Before the timed pass, the whole matrix
runs once untimed with --warmup-tokens outputs, so per-shape kernel preparation (bf16 on the CPU) is not
timed.

Per run: output tokens/s over the run's own steps, acceptance rate (accepted / proposed drafts),
mean tokens per target step for the sequences that verified drafts, the share of decode steps where the
cost model chose not to speculate, speedup in tokens/s over no speculation on the same workload and
batch, and how many outputs equal the non-speculative ones (bf16 verification batches tokens
differently, so near-ties may resolve differently; float32 matches exactly, see tests/test_spec_engine.py).

The whole matrix runs --rounds times; each row reports the medians over rounds, and its speedup is the
median of each round's ratio to that round's run without speculation (stepped beside it), with the
lowest and highest ratio beside it.

    python benchmarks/speculative.py                                  # dtype auto (bf16 here), 128 tokens
    python benchmarks/speculative.py --max-tokens 48 --solo-requests 1 --batch-sizes 1 16

Prints a markdown table; writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.engine.outputs import RequestOutput
from kvserve.model.registry import load_model
from kvserve.model.tokenizer import TokenizerWrapper

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram k=4": {"method": "ngram", "num_tokens": 4},
    "self-draft L=12 k=3": {"method": "draft", "num_tokens": 3, "draft_layers": 12},
}
PASSAGE = [
    "The lighthouse stood at the edge of the northern cliffs for more than two hundred years.",
    "Every evening the keeper climbed the spiral stairs, trimmed the wick and polished the great lens.",
    "Ships passing in the night relied on its steady beam to steer clear of the rocks below.",
    "In winter the storms were so fierce that waves reached the lantern room and rattled the glass.",
    "The keeper kept a logbook in which he recorded the weather, the ships and the birds he saw.",
    "When electricity finally arrived, the old oil lamp was replaced by a bulb and a small motor.",
    "The last keeper left in 1987, and since then the light has turned on and off by itself.",
    "Today visitors walk up the same stairs and read his logbook in a glass case by the door.",
]
TOPICS = [
    "a robot who learns to paint", "the first day at a new school", "a city under the sea", "a lost umbrella",
    "a dragon afraid of heights", "the last tree on Mars", "a talking cat detective", "a storm at a wedding",
    "an old clock that runs backwards", "a chef who cannot taste", "a library that never closes",
    "a friendship between a fox and a crow", "a train that skips stations", "the smell of rain",
    "a village without mirrors", "a map drawn by a child",
]  # fmt: skip


def workloads(tokenizer: TokenizerWrapper, count: int) -> dict[str, list[list[int]]]:
    def chat(text: str) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": text}])

    copy = [
        chat("Repeat the following passage exactly:\n\n" + " ".join(PASSAGE[i % 8 :] + PASSAGE[: i % 8]))
        for i in range(count)
    ]
    open_ended = [chat(f"Write a short story about {TOPICS[i % len(TOPICS)]}.") for i in range(count)]
    return {"copy": copy, "open": open_ended}


def run_cell(prompts: list[list[int]], batch: int, max_tokens: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every method of METHODS on the same requests at `batch`, one row each: the engines are stepped in
    turn and each step is timed alone, so a change in the machine's speed hits every method alike."""
    llms = {}
    for method, spec in METHODS.items():
        llm = LLM(MODEL, dtype=args.dtype, speculative=spec, num_kv_blocks=args.kv_blocks)
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2))  # warm-up: too short to speculate
        llms[method] = llm
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    groups = [[p] for p in prompts[: args.solo_requests]] if batch == 1 else [prompts[:batch]]
    seconds = dict.fromkeys(llms, 0.0)
    outputs: dict[str, list[RequestOutput]] = {method: [] for method in llms}
    for g, group in enumerate(groups):
        ids = [f"group{g}-{i}" for i in range(len(group))]
        finished: dict[str, dict[str, RequestOutput]] = {method: {} for method in llms}
        for llm in llms.values():
            for request_id, prompt in zip(ids, group, strict=True):
                llm.engine.add_request(request_id, prompt, params)
        while any(len(done) < len(ids) for done in finished.values()):
            for method, llm in llms.items():
                if len(finished[method]) == len(ids):
                    continue
                start = time.perf_counter()
                step_outputs = llm.engine.step()
                seconds[method] += time.perf_counter() - start
                finished[method].update((o.request_id, o) for o in step_outputs if o.finished)
        for method in llms:
            outputs[method] += [finished[method][request_id] for request_id in ids]
    rows = []
    for method, llm in llms.items():
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs[method])
        stats = llm.engine.stats()
        decode_steps = stats.get("spec_steps", 0) + stats.get("spec_skipped_steps", 0)
        rows.append(
            {
                "method": method,
                "output_tokens": tokens,
                "seconds": seconds[method],
                "tokens_per_s": tokens / seconds[method],
                "acceptance_rate": stats.get("spec_acceptance_rate"),
                "tokens_per_target_step": stats.get("spec_mean_tokens_per_step"),
                "skipped_share": stats.get("spec_skipped_steps", 0) / decode_steps if decode_steps else None,
                "acceptance_by_position": stats.get("spec_acceptance_by_position"),
                "dtype": stats["dtype"],
                "token_ids": [o.outputs[0].token_ids for o in outputs[method]],
            }
        )
    return rows


def run_all(
    prompts: dict[str, list[list[int]]], max_tokens: int, args: argparse.Namespace, quiet: bool
) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for workload, wl_prompts in prompts.items():
        for batch in args.batch_sizes:
            rows = run_cell(wl_prompts, batch, max_tokens, args)
            baseline = rows[0]  # METHODS' first: no speculation
            for result in rows:
                result.update(workload=workload, batch=batch)
                result["speedup"] = result["tokens_per_s"] / baseline["tokens_per_s"]
                result["same_outputs"] = sum(
                    a == b for a, b in zip(result["token_ids"], baseline["token_ids"], strict=True)
                )
                runs.append(result)
                if not quiet:
                    print(
                        f"# {workload} batch {batch} {result['method']}: {result['tokens_per_s']:.1f} tok/s", flush=True
                    )
    return runs


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def median_over_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (workload, batch, method): the last round's row with its figures replaced by their
    medians over rounds (a figure a round lacks, such as acceptance without drafts, stays None)."""
    merged = []
    for rows in zip(*rounds, strict=True):
        row = dict(rows[-1])
        for key in ("tokens_per_s", "speedup", "acceptance_rate", "tokens_per_target_step", "skipped_share"):
            values = [r[key] for r in rows if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        row["speedup_range"] = (min(r["speedup"] for r in rows), max(r["speedup"] for r in rows))
        row["rounds"] = len(rows)
        merged.append(row)
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--solo-requests", type=int, default=2, help="requests run one at a time at batch 1")
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--warmup-tokens", type=int, default=16, help="untimed first pass of every run (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="times the matrix runs; rows report medians")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speculative.json")
    args = parser.parse_args()

    prompts = workloads(load_model(MODEL).tokenizer, max(*args.batch_sizes, args.solo_requests))
    if args.warmup_tokens:
        # CPU bf16 kernels are prepared once per matrix shape; speculation feeds many new shapes.
        run_all(prompts, args.warmup_tokens, args, quiet=True)
    runs = median_over_rounds([run_all(prompts, args.max_tokens, args, quiet=False) for _ in range(args.rounds)])

    print(f"\ndtype {runs[0]['dtype']}, {args.max_tokens} output tokens per request, greedy, adaptive k, ", end="")
    print(f"medians of {args.rounds} rounds\n")
    columns = ["out tokens", "tok/s", "speedup (range)", "acceptance", "tokens/step", "skipped", "same"]
    print("| workload | batch | method | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        low, high = r["speedup_range"]
        print(
            f"| {r['workload']} | {r['batch']} | {r['method']} | {r['output_tokens']} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f} ({low:.2f}-{high:.2f}) | {_cell(r['acceptance_rate'])} | "
            f"{_cell(r['tokens_per_target_step'])} | {_cell(r['skipped_share'])} | "
            f"{r['same_outputs']}/{len(r['token_ids'])} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": runs}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
