"""Decode steps on the GGUF's own quantized blocks (`--quantization auto`) against the same weights
dequantized (`none`, the default), in one process, on the bundled model.

Both engines are loaded; for each batch size N, N requests of 128 random prompt tokens are admitted to
each and stepped until all are decoding; then the two engines take alternate steps, so a change in the
machine's speed hits both. Prints the median step time of each and their ratio; writes JSON.

    python benchmarks/quantized_decode.py [--batch-sizes 1 8 32] [--steps 60] [--dtype bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.results import save_results
from kvserve.engine.engine import LLMEngine

QUANTIZATIONS = ("none", "auto")


def admit(engine: LLMEngine, batch: int, steps: int, rng: random.Random) -> None:
    """N decoding requests that outlast the measured steps."""
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(128)]
        params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while engine.scheduler.waiting or min(len(s.output_token_ids) for s in engine.scheduler.running) < 5:
        engine.step()


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per batch size and engine")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quantized_decode.json")
    args = parser.parse_args()
    engines = {q: LLM(dtype=args.dtype, quantization=q, enable_prefix_caching=False).engine for q in QUANTIZATIONS}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; ms per decode step (median)")
    print(f"{'batch':>5} {'none':>9} {'auto':>9} {'none/auto':>10}")
    rows = []
    for batch in args.batch_sizes:
        for engine in engines.values():
            admit(engine, batch, args.steps, random.Random(batch))
        times: dict[str, list[float]] = {q: [] for q in QUANTIZATIONS}
        for _ in range(args.steps):
            for quantization, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                times[quantization].append((time.perf_counter() - start) * 1e3)
        for engine in engines.values():
            drain(engine)
        median = {q: statistics.median(t) for q, t in times.items()}
        ratio = median["none"] / median["auto"]
        rows.append({"batch": batch, **{f"{q}_ms": m for q, m in median.items()}, "none_over_auto": ratio})
        print(f"{batch:>5} {median['none']:>9.2f} {median['auto']:>9.2f} {ratio:>10.3f}", flush=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype}
    save_results({"env": env, "rows": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
