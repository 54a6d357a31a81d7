"""Prefill rows on the compiled vector kernel against torch SDPA, the crossovers behind attention_cpu.py's
BF16_PREFILL_MAX_KEYS and WIDENED_PREFILL_MAX_KEYS (which prefill rows the vector kernels take where AMX does
not): the AVX512-BF16 kernel where it applies (bf16 on a build with AVX512-BF16), the AVX2 kernel on the avx2
path's build, else the widened float32 kernel; the table's header names the one that ran.

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64; --head-dim 256 --heads 4 1 for
Gemma 3's), bf16 (or --dtype float32), block size 16, shuffled block tables. The kernel runs with AMX off, so
on an AMX CPU it measures the kernel a CPU without AMX runs. Both sides write the same rows; time is the
median of --repeats calls after a warm-up, the two taking turns per case.

    python benchmarks/prefill_attention.py [--repeats 7] [--head-dim 64 --heads 9 3] [--dtype float32] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvserve.bench.timing import call_times_ms
from kvserve.kernels import cpu
from kvserve.kernels.attention_ref import random_paged_inputs
from kvserve.kernels.attention_sdpa import prefill_rows

BLOCK = 16

# (name, new tokens per sequence, keys per sequence)
CASES = [
    ("16 prompts of 128", [128] * 16, [128] * 16),
    ("4 prompts of 512", [512] * 4, [512] * 4),
    ("prefill 256", [256], [256]),
    ("prefill 512", [512], [512]),
    ("prefill 1024", [1024], [1024]),
    ("prefill 2048", [2048], [2048]),
    ("chunk of 512 after 512 cached", [512], [1024]),
    ("chunk of 512 after 1536 cached", [512], [2048]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill_attention.json")
    args = parser.parse_args()
    kernels = cpu.load()
    if kernels is None:
        raise SystemExit("the compiled CPU kernels did not load")
    hq, hkv = args.heads
    dtype = getattr(torch, args.dtype)
    scale = args.head_dim**-0.5
    previous_amx = kernels.set_amx_attention(False)
    rows = []
    probe, probe_cache = (
        torch.zeros(1, hq, args.head_dim, dtype=dtype),
        torch.zeros(1, BLOCK, hkv, args.head_dim, dtype=dtype),
    )
    if kernels.bf16_attention_applies(probe, probe_cache):
        kernel_name = "AVX512-BF16 kernel"
    elif kernels.avx2_attention_applies(probe):
        kernel_name = "AVX2 kernel"
    elif kernels.widened_attention_vectorized(probe):
        kernel_name = "widened float32 kernel"
    else:
        raise SystemExit("no vector attention kernel takes prefill rows on this CPU or build (the plain loops)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {hq}/{hkv} heads of {args.head_dim}")
    print(f"{args.dtype} on the {kernel_name}")
    print(f"{'case':<32} {'kernel ms':>10} {'sdpa ms':>9} {'sdpa/kernel':>12}")
    try:
        for name, query_lens, seq_lens in CASES:
            q, k, v, meta = random_paged_inputs(query_lens, seq_lens, hq, hkv, args.head_dim, BLOCK, dtype)
            out = torch.empty_like(q)
            seqs = list(range(len(query_lens)))
            on_kernel = torch.tensor(seqs, dtype=torch.int64)

            def kernel(q=q, k=k, v=v, meta=meta, out=out, on_kernel=on_kernel) -> None:
                kernels.decode_attention(
                    out, q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, on_kernel, scale, 0
                )

            def sdpa(q=q, k=k, v=v, meta=meta, out=out, seqs=seqs) -> None:
                prefill_rows(q, k, v, meta, scale, out, seqs)

            times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
            for _ in range(args.repeats):  # turns, so that drift in the machine's speed hits both
                times["kernel"] += call_times_ms(kernel, 1)
                times["sdpa"] += call_times_ms(sdpa, 1)
            kernel_ms, sdpa_ms = (statistics.median(times[side]) for side in ("kernel", "sdpa"))
            rows.append({"case": name, "kernel_ms": kernel_ms, "sdpa_ms": sdpa_ms, "keys": max(seq_lens)})
            print(f"{name:<32} {kernel_ms:>10.2f} {sdpa_ms:>9.2f} {sdpa_ms / kernel_ms:>12.2f}", flush=True)
    finally:
        kernels.set_amx_attention(previous_amx)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "heads": args.heads,
        "dim": args.head_dim,
        "dtype": args.dtype,
        "kernel": kernel_name,
    }
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
