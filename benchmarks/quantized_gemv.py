"""Quantized-weight products (kernels/cpu/quant_gemv.cpp, quant_linear.cpp) against the engine's bf16
linear on the same shapes (kvserve.model.linear.make_linear: the bf16 GEMV at 1-2 rows, oneDNN above):
per kernel, block type, shape and row count, the median time and the effective bandwidth (the bytes of
the weight it reads, quantized or bf16, per second). For block types with row groups (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K;
kvserve/model/quantized.py) the same matrix in row groups, as the engine holds its projections, is a
column of its own ("groups us"; "GB/s" is GGML's layout).

Shapes are SmolLM2-135M's: the down projection (576 x 1536), the fused gate_up's half (1536 x 576) and
the LM head (49152 x 576); K-quants (256-element blocks) only where K is a multiple of 256. Weights are
random values quantized by gguf (K-quants: random blocks with sane scales, as gguf has no quantizer for
them). As in a decode step, where the weights stream from memory, each call takes the next of enough
copies of the matrix (at least STREAM_BYTES of each kind) that none is still in cache when its turn
comes again. Each row of the table alternates the kernels call by call, so a change in the machine's
load hits both.

    python benchmarks/quantized_gemv.py [--rows 1 2 16] [--repeats 20] [--threads 1 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from kvserve.bench.results import save_results
from kvserve.kernels import cpu
from kvserve.model.linear import make_linear
from kvserve.model.quantized import KERNEL_TYPES, QuantizedTensor

SHAPES = [(576, 1536), (1536, 576), (49152, 576)]
STREAM_BYTES = 64 << 20  # past the last-level cache of the CPUs kvserve runs on


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, gen: np.random.Generator) -> torch.Tensor:
    elems, size = GGML_QUANT_SIZES[qtype]
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        blocks = gen.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
        offset = 0 if qtype == GGMLQuantizationType.Q4_K else 208
        blocks[..., offset : offset + 2] = np.full((n, k // elems, 1), 0.01, np.float16).view(np.uint8)
        return torch.from_numpy(blocks.reshape(n, -1))
    return torch.from_numpy(quantize(gen.standard_normal((n, k)).astype(np.float32) * 0.02, qtype))


def median_us(fns: dict[str, list[Callable[[], object]]], repeats: int) -> dict[str, float]:
    """Median microseconds per call of each kernel, the kernels alternating call by call, each call on
    the next copy of its weight."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for copies in fns.values():
        for fn in copies:
            fn()  # first-call costs (allocation, page faults, oneDNN primitives) out of the figures
    for i in range(repeats):
        for name, copies in fns.items():
            start = time.perf_counter()
            copies[i % len(copies)]()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--types", nargs="+", default=[t.name for t in KERNEL_TYPES])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quantized_gemv.json")
    args = parser.parse_args()
    kernels = cpu.load()
    if kernels is None:
        raise SystemExit("the quantized kernels need the compiled CPU kernels")
    gen = np.random.default_rng(0)
    rows_out = []
    print(f"{'threads':>7} {'shape':>11} {'rows':>4} {'type':>5} {'kernel':>12} {'us':>9} {'GB/s':>6} {'groups us':>9} "
          f"{'bf16 us':>8}")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n, k in SHAPES:
            dense_copies = -(-STREAM_BYTES // (n * k * 2))
            dense = [make_linear(torch.randn(n, k).mul_(0.02).bfloat16()) for _ in range(dense_copies)]
            for rows in args.rows:
                x = torch.randn(rows, k).bfloat16()
                kernel = "quant_gemv" if rows <= kernels.GEMV_MAX_ROWS else "quant_linear"
                for name in args.types:
                    qtype = GGMLQuantizationType[name]
                    if k % GGML_QUANT_SIZES[qtype][0]:
                        continue
                    one = random_blocks(qtype, n, k, gen)
                    blocks = [one.clone() for _ in range(-(-STREAM_BYTES // one.numel()))]
                    product = getattr(kernels, kernel)
                    fns = {
                        kernel: [functools.partial(product, x, b, int(qtype)) for b in blocks],
                        "bf16": [functools.partial(linear, x) for linear in dense],
                    }
                    grouped = [QuantizedTensor(b, qtype, (n, k)).interleaved() for b in blocks]
                    if grouped[0].row_group > 1:
                        fns["row groups"] = [functools.partial(product, x, g.blocks, g.kernel_type) for g in grouped]
                    us = median_us(fns, args.repeats)
                    gbps = one.numel() / us[kernel] / 1e3
                    row = {"threads": threads, "n": n, "k": k, "rows": rows, "type": name, "kernel": kernel,
                           "us": us[kernel], "gb_per_s": gbps, "row_groups_us": us.get("row groups"),
                           "bf16_us": us["bf16"], "bf16_gb_per_s": n * k * 2 / us["bf16"] / 1e3}  # fmt: skip
                    rows_out.append(row)
                    groups = f"{us['row groups']:>9.1f}" if "row groups" in us else f"{'-':>9}"
                    print(f"{threads:>7} {n:>5}x{k:<5} {rows:>4} {name:>5} {kernel:>12} {us[kernel]:>9.1f} "
                          f"{gbps:>6.2f} {groups} {us['bf16']:>8.1f}")  # fmt: skip
    meta = {"benchmark": "quantized_gemv", "repeats": args.repeats, "torch": torch.__version__}
    save_results({"meta": meta, "rows": rows_out}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
