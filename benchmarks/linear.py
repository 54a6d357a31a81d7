"""CPU linear layers: oneDNN's packed bf16 kernel against kvserve's AMX tile kernel (linear_amx), over
every product of one SmolLM2-135M forward pass (30 layers x qkv, o, gate_up, down, then the LM head: 121
products, 270 MB of bf16 weights) at several row counts, the way an engine step meets them.

Each timed pass runs all 121 products once. "cold" touches a 640 MB buffer before each pass, so the
weights stream from memory as they do in a decode step, where the K/V reads of attention push them out
of cache; "warm" runs passes back to back. The two kernels alternate pass by pass, so a change in the
machine's speed hits both. Prints median ms per pass and oneDNN / linear_amx; writes JSON.

    python benchmarks/linear.py [--rows 16 100 256 2048] [--repeats 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvserve.bench.results import save_results
from kvserve.kernels import cpu
from kvserve.model.linear import pack_for_amx

# (out_features, in_features) of one layer's products, SmolLM2-135M: fused qkv, o, fused gate_up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, LM_HEAD = 30, (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 100, 256, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "linear.json")
    args = parser.parse_args()
    kernels = cpu.load()
    if kernels is None or not kernels.amx_available():
        raise SystemExit("linear_amx needs the compiled kernels and a CPU with AMX-BF16")
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [LM_HEAD]
    weights = [(torch.randn(shape, generator=gen) * 0.02).bfloat16() for shape in shapes]
    kernel_weights = {
        "onednn": [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights],  # as make_linear packs
        "linear_amx": [pack_for_amx(w) for w in weights],
    }
    products = {
        "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "linear_amx": kernels.linear_amx,
    }
    flush = torch.empty(640 * 2**20 // 4)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per pass of {len(shapes)} products")
    print(f"{'rows':>5} {'cache':>5} {'onednn':>8} {'linear_amx':>11} {'ratio':>6}")
    rows_out = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {s[1] for s in shapes}}
        for cache in ("cold", "warm"):
            times: dict[str, list[float]] = {name: [] for name in products}
            for repeat in range(args.repeats + 1):
                for name, product in products.items():
                    if cache == "cold":
                        flush.add_(1)
                    start = time.perf_counter()
                    for shape, weight in zip(shapes, kernel_weights[name], strict=True):
                        product(inputs[shape[1]], weight)
                    if repeat:  # the first pass warms up (oneDNN creates its primitives)
                        times[name].append((time.perf_counter() - start) * 1e3)
            median = {name: statistics.median(t) for name, t in times.items()}
            ratio = median["onednn"] / median["linear_amx"]
            rows_out.append({"rows": rows, "cache": cache, "median_ms": median, "onednn_over_amx": ratio})
            line = f"{rows:>5} {cache:>5} {median['onednn']:>8.1f} {median['linear_amx']:>11.1f} {ratio:>6.2f}"
            print(line, flush=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    save_results({"env": env, "rows": rows_out}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
