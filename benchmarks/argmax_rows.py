"""The greedy sampler's argmax (kernels/cpu/argmax_rows.cpp) against torch.max(dim=-1), on each CPU path this
machine executes, each path in a process of its own (KVSERVE_CPU_ISA, as roofs.py runs its probes): the
scalar loop of generic builds, and the 8- and 16-lane loops of AVX2 and AVX-512 builds.

Logits as a step leaves them: bf16 rows of SmolLM2's vocabulary (49,152) and Gemma 3's (262,144), one row
(batch-1 decode) and 100 (a full decode batch); the kernel and torch.max alternate call by call
(quantized_gemv.median_us). Prints the median microseconds per call of each and their ratio; writes JSON.

    python benchmarks/argmax_rows.py [--repeats 200] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from quantized_gemv import median_us
from roofs import json_on_path

from kvserve.bench.results import save_results
from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa

VOCABS = (49152, 262144)
ROWS = (1, 100)


def measure(repeats: int) -> list[dict[str, Any]]:
    """This process's path: median us per call of the kernel and of torch.max, per shape."""
    kernels = cpu.load()
    if kernels is None:
        raise SystemExit("argmax_rows needs the compiled CPU kernels")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for vocab in VOCABS:
        for rows in ROWS:
            logits = torch.randn(rows, vocab, generator=gen).bfloat16()
            assert torch.equal(kernels.argmax_rows(logits), logits.max(dim=-1).indices)
            fns = {
                "kernel": [functools.partial(kernels.argmax_rows, logits)],
                "torch.max": [functools.partial(torch.max, logits, -1)],
            }
            us = median_us(fns, repeats)
            rows_out.append({"vocab": vocab, "rows": rows, "kernel_us": us["kernel"], "torch_max_us": us["torch.max"]})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print this process's path's rows as one JSON list")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "argmax_rows.json")
    args = parser.parse_args()
    if args.json:
        cpu_isa.cap_torch(cpu_isa.selected())
        print(json.dumps(measure(args.repeats)))
        return
    results = []
    print("| path | vocab | rows | argmax_rows us | torch.max us | torch.max / kernel |")
    print("|---|---|---|---|---|---|")
    for isa in build_config.executable_isas():
        for row in json_on_path(__file__, ["--repeats", str(args.repeats)], isa.name, dict(os.environ)):
            results.append({"path": isa.name, **row})
            print(f"| {isa.name} | {row['vocab']:,} | {row['rows']} | {row['kernel_us']:.1f} | "
                  f"{row['torch_max_us']:.1f} | {row['torch_max_us'] / row['kernel_us']:.2f}x |")  # fmt: skip
    save_results({"meta": {"benchmark": "argmax_rows", "repeats": args.repeats}, "rows": results}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
