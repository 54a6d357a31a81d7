"""CPU attention benchmark over the paged cache: the compiled kernel (with and without AMX), the
tiled torch kernel, torch SDPA and the reference.

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64), block size 16, with
block tables shuffled as a busy pool leaves them. Time is the median (and min) of --repeats calls after
one warm-up; peak memory is the high-water mark of allocations made during one call (torch profiler).

    python benchmarks/attention.py [--quick] [--dtype float32|bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.bench.timing import call_times_ms
from kvserve.kernels import cpu
from kvserve.kernels.attention_ref import random_paged_inputs
from kvserve.kernels.backends import get_attention_backend
from kvserve.kernels.peak_memory import peak_extra_memory

HQ, HKV, D, BLOCK = 9, 3, 64, 16
# "cpu" is the compiled kernel (AMX tiles for bf16 where the CPU has them), "cpu-avx512" the same
# kernel with its AMX path off; both only where the kernels build.
COMPILED = ("cpu", "cpu-avx512")
BACKENDS = (*COMPILED, "tiled", "sdpa", "reference")


def backend_call(name: str, q, k, v, meta, scale: float) -> Callable[[], object]:
    if name != "cpu-avx512":
        return functools.partial(get_attention_backend(name, "cpu"), q, k, v, meta, scale)
    kernels = cpu.load()
    attention = get_attention_backend("cpu", "cpu")

    def without_amx() -> object:
        # The batch's routing plan (kernel or SDPA per sequence) depends on AMX; meta caches it, and the
        # other backends share meta, so it is made afresh on each side of the switch.
        previous = kernels.set_amx_attention(False)
        meta.plans.pop("cpu", None)
        try:
            return attention(q, k, v, meta, scale)
        finally:
            kernels.set_amx_attention(previous)
            meta.plans.pop("cpu", None)

    return without_amx


@dataclass
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]


@dataclass
class Row:
    case: str
    backend: str
    median_ms: float
    min_ms: float
    peak_mib: float


def cases(quick: bool) -> list[Case]:
    out = [Case(f"prefill {n}", [n], [n]) for n in ((256, 1024) if quick else (256, 1024, 4096))]
    out.append(Case("prefill 512 after 1536 cached", [512], [2048]))
    for batch, length in (
        ((1, 1024), (16, 1024), (64, 512), (256, 256))
        if quick
        else (
            (1, 1024),
            (1, 4096),
            (16, 1024),
            (64, 1024),
            (256, 512),
            (256, 2048),
        )
    ):
        out.append(Case(f"decode {batch}x{length}", [1] * batch, [length] * batch))
    mixed = [64 + (i * 997) % 1900 for i in range(128)]  # lengths 64..1963, uneven as in service
    out.append(Case("decode 128 mixed 64..1963", [1] * 128, mixed))
    out.append(Case("verify 32x(4 of 1024)", [4] * 32, [1024] * 32))
    out.append(Case("mixed 255 decode + 256 prefill", [1] * 255 + [256], [512] * 255 + [256]))
    return out


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, min) milliseconds; the min is the better estimate on a machine shared with other work."""
    times = call_times_ms(fn, repeats)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller cases, for a smoke run")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    scale = D**-0.5
    rows: list[Row] = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'case':<34} {'backend':<10} {'median ms':>10} {'min ms':>9} {'peak MiB':>9}")
    for case in cases(args.quick):
        q, k, v, meta = random_paged_inputs(case.query_lens, case.seq_lens, HQ, HKV, D, BLOCK, dtype)
        for name in BACKENDS:
            if name in COMPILED and cpu.load() is None:
                continue
            call = backend_call(name, q, k, v, meta, scale)
            _, peak = peak_extra_memory(call)
            row = Row(case.name, name, *measure(call, args.repeats), peak / 2**20)
            rows.append(row)
            print(
                f"{row.case:<34} {row.backend:<10} {row.median_ms:>10.2f} {row.min_ms:>9.2f} {row.peak_mib:>9.1f}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta_info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype}
    args.out.write_text(json.dumps({"env": meta_info, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
