"""CPU linear layers: oneDNN's packed product against kvserve's tile kernels (linear_amx where the CPU
has AMX, linear_tiles_fma on AVX-512 or AVX2: the same packed weight on float32 FMAs), over every product
of one SmolLM2-135M forward pass (30 layers x qkv, o, gate_up, down, then the LM head: 121 products, 270 MB
of bf16 weights) at several row counts, the way an engine step meets them.

Each timed pass runs all 121 products once. "cold" touches a 640 MB buffer before each pass, so the
weights stream from memory as they do in a decode step, where the K/V reads of attention push them out
of cache; "warm" runs passes back to back. The kernels alternate pass by pass, so a change in the
machine's speed hits all of them. Prints median ms per pass and oneDNN / each tile kernel; writes JSON.
--cpu-path holds kvserve's kernels and torch's (oneDNN multiplies in float32 where the path has no bf16
kernel, as make_linear does) to a lower path, as the CLI's KVSERVE_CPU_ISA does.

    python benchmarks/linear.py [--rows 16 100 256 2048] [--repeats 7] [--cpu-path avx512] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from kvserve.bench.results import save_results
from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model.linear import _onednn_compute_dtype, pack_tiles

# (out_features, in_features) of one layer's products, SmolLM2-135M: fused qkv, o, fused gate_up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, LM_HEAD = 30, (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 100, 256, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cpu-path", default=None, choices=[isa.name for isa in build_config.executable_isas()])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "linear.json")
    args = parser.parse_args()
    if args.cpu_path:
        os.environ[cpu_isa.ENV] = args.cpu_path
    path = cpu_isa.selected()
    cpu_isa.cap_torch(path)  # before torch computes anything
    kernels = cpu.load()
    if kernels is None or path.isa.name == "generic":
        raise SystemExit("the tile kernels need the compiled kernels on a path with AVX2 or above")
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [LM_HEAD]
    weights = [(torch.randn(shape, generator=gen) * 0.02).bfloat16() for shape in shapes]
    compute = _onednn_compute_dtype(weights[0])
    assert compute is not None, "oneDNN packs neither bf16 nor float32 weights here"
    tiles = [pack_tiles(w) for w in weights]
    kernel_weights = {"onednn": [torch.ops.mkldnn._reorder_linear_weight(w.to(compute), 1) for w in weights]}
    products = {
        "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x.to(compute), w, None, "none", [], "").bfloat16()
    }
    tile_kernels = ["linear_amx", "linear_tiles_fma"] if kernels.amx_available() else ["linear_tiles_fma"]
    for name in tile_kernels:
        kernel_weights[name] = tiles
        products[name] = getattr(kernels, name)
    flush = torch.empty(640 * 2**20 // 4)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {path.describe()}, oneDNN in {compute}")
    print(f"ms per pass of {len(shapes)} products; ratio: onednn / the tile kernel")
    tiles_header = " ".join(f"{name:>16} {'ratio':>6}" for name in tile_kernels)
    print(f"{'rows':>5} {'cache':>5} {'onednn':>8} {tiles_header}")
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
            ratios = {name: median["onednn"] / median[name] for name in tile_kernels}
            rows_out.append({"rows": rows, "cache": cache, "median_ms": median, "onednn_over": ratios})
            cells = " ".join(f"{median[name]:>16.1f} {ratios[name]:>6.2f}" for name in tile_kernels)
            print(f"{rows:>5} {cache:>5} {median['onednn']:>8.1f} {cells}", flush=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_path": path.describe()}
    save_results({"env": env, "rows": rows_out}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
