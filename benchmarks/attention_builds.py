"""The compiled decode attention of two kernel builds side by side in one process: this tree's (the build
`kvserve.kernels.cpu.load()` picks) and another's from before the window argument, given as the path of
its built module (e.g. the main branch's install build `_prebuilt_avx2*.so`).
Calls alternate between the builds, so a change in this VM's speed hits both; median us per call.

Shapes: SmolLM2's (9 query heads on 3 KV heads of 64, bf16 cache, 16-key blocks), decode rows of N
sequences at a context of --context keys, no window: what a change to the kernel must not slow.

    python benchmarks/attention_builds.py --other PATH.so [--batch-sizes 1 8 64 100] [--context 256]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention_ref import random_paged_inputs


def load_module(path: Path) -> ModuleType:
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="the other build's module file")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 100])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per build and batch size")
    args = parser.parse_args()
    this, other = cpu.load(), load_module(args.other)
    assert this is not None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per decode_attention call (median)")
    print("| batch | this tree | other build | other / this |\n|---|---|---|---|")
    for batch in args.batch_sizes:
        q, k, v, meta = random_paged_inputs([1] * batch, [args.context] * batch, 9, 3, 64, 16, torch.bfloat16)
        out = torch.empty_like(q)
        seqs = torch.arange(batch)
        tensors = (out, q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, seqs, 0.125)
        calls = {
            "this": lambda t=tensors: this.decode_attention(*t, 0),
            "other": lambda t=tensors: other.decode_attention(*t),
        }
        results = {}
        for name, call in calls.items():  # the same output from both builds
            call()
            results[name] = out.clone()
        assert torch.equal(results["this"], results["other"])
        times: dict[str, list[float]] = {name: [] for name in calls}
        for i in range(2 * args.calls):
            name = ("this", "other")[i % 2]
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e6)
        median = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {batch} | {median['this']:.1f} | {median['other']:.1f} | {median['other'] / median['this']:.3f} |")


if __name__ == "__main__":
    main()
