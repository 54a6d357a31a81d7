"""The compiled decode step (kernels/cpu/decode_layers.cpp: all layers in one C++ call) against the
Python layer loop it replaces, on the real model in bf16, at several batch sizes.

For each batch size N, N requests of 128 random prompt tokens are admitted and stepped until all are
decoding; then engine steps alternate between the two paths (`runner.compiled_decode` on and off), so
a change in this VM's speed hits both. Prints the median step time of each and their ratio; writes JSON.

    python benchmarks/compiled_decode.py [--batch-sizes 1 8 32 64 100] [--steps 60] [--out PATH]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 100])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per batch size, both paths")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compiled_decode.json")
    args = parser.parse_args()
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per decode step (median)")
    print(f"{'batch':>5} {'compiled':>9} {'python':>8} {'python/compiled':>16}")
    rows = []
    for batch in args.batch_sizes:
        for i in range(batch):
            prompt = [rng.randrange(100, 40000) for _ in range(128)]
            params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True)
            engine.add_request(f"b{batch}-{i}", prompt, params)
        while engine.scheduler.waiting or min(len(s.output_token_ids) for s in engine.scheduler.running) < 5:
            engine.step()
        times: dict[bool, list[float]] = {True: [], False: []}
        for step in range(args.steps):
            compiled = step % 2 == 0
            engine.runner.compiled_decode = compiled
            start = time.perf_counter()
            engine.step()
            times[compiled].append((time.perf_counter() - start) * 1e3)
        engine.runner.compiled_decode = True
        while engine.has_unfinished_requests():
            engine.step()
        median = {path: statistics.median(t) for path, t in times.items()}
        ratio = median[False] / median[True]
        rows.append({"batch": batch, "compiled_ms": median[True], "python_ms": median[False], "ratio": ratio})
        print(f"{batch:>5} {median[True]:>9.2f} {median[False]:>8.2f} {ratio:>16.3f}", flush=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    save_results({"env": env, "rows": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
