"""This machine's roofs now, on the process's torch threads and its CPU path (KVSERVE_CPU_ISA, with torch's
own CPU code capped to it): the GEMM rate in bf16 and in float32, and the stream read bandwidth on 2 MiB
huge pages and on 4 KiB pages. benchmarks/cpu_performance.py runs this file once per path the CPU
executes (`measure_path`), since torch reads its caps once per process.

- GEMM: square products through oneDNN's packed linear (`torch.ops.mkldnn._linear_pointwise`, the product
  kvserve's linear layers run, whose ISA the path caps), else torch.matmul where oneDNN cannot take the
  dtype (bf16 on a CPU without native bf16). Not torch.matmul throughout: its float32 product is MKL's,
  which the path's caps do not reach on every CPU. Sizes double from 256 up to --gemm-n, stopping before
  one whose product would take over GEMM_BUDGET_S (8 times the previous size's): without native bf16,
  torch's bf16 product is far too slow to run at full size (benchmarks/RESULTS.md, "Roofs per CPU path").
  The figure is the best of GEMM_REPEATS at the largest size run, after a warm-up.
- Stream: a full read of a float32 buffer (`sum`, multithreaded; float32 rather than bf16, whose sum
  widens each element first and reads slower), the best of STREAM_REPEATS after a first read. The huge
  page buffer is kvserve's own (model/huge_pages.py: madvise(MADV_HUGEPAGE) before the first touch); the
  other is advised MADV_NOHUGEPAGE. Whether the kernel granted huge pages is read back from AnonHugePages
  in /proc/self/smaps_rollup.

    python benchmarks/roofs.py [--json] [--gemm-n 2048] [--stream-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.kernels.cpu import build_config
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model.huge_pages import HUGE_PAGE_BYTES, empty_on_huge_pages
from kvserve.model.linear import onednn_packing_works

GEMM_BUDGET_S = 1.0
GEMM_REPEATS = 3
STREAM_REPEATS = 5
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS_ROLLUP = Path("/proc/self/smaps_rollup")


def _product(dtype: torch.dtype, n: int) -> tuple[Any, str]:
    """A call computing one n x n x n product in `dtype`, and which library runs it."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    if onednn_packing_works(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        return lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), "onednn linear"
    return lambda: torch.matmul(a, b), "torch.matmul"


def gemm_flop_s(dtype: torch.dtype, max_n: int = 2048) -> dict[str, Any]:
    """The GEMM rate in `dtype`: {flop_s, n (the size it was taken at), via (the library)}."""
    n, best_s, result = 256, 0.0, {}
    while n <= max_n and best_s * 8 <= GEMM_BUDGET_S:
        run, via = _product(dtype, n)
        run()  # warm-up: oneDNN creates its primitive, the threads wake
        times = []
        for _ in range(GEMM_REPEATS):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        best_s = min(times)
        result = {"flop_s": 2 * n**3 / best_s, "n": n, "via": via}
        n *= 2
    return result


def _anon_huge_bytes() -> int | None:
    """AnonHugePages of this process (bytes), None where the kernel does not report it."""
    try:
        match = re.search(r"^AnonHugePages:\s+(\d+) kB", SMAPS_ROLLUP.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _on_small_pages(numel: int) -> torch.Tensor:
    """A float32 buffer in a fresh mapping advised to stay on 4 KiB pages (THP "always" would make it huge)."""
    mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)  # Linux only
    if advice is not None:
        mapping.madvise(advice)
    return torch.frombuffer(mapping, dtype=torch.float32)


def stream_read(nbytes: int, huge_pages: bool) -> dict[str, Any]:
    """Read bandwidth over a buffer of `nbytes`: {gb_s, huge_page_share (of the buffer, None where
    unknown)}."""
    numel = nbytes // 4
    before = _anon_huge_bytes()
    buffer = empty_on_huge_pages(numel, torch.float32) if huge_pages else _on_small_pages(numel)
    buffer.fill_(1.0)  # the first touch, which places the pages
    after = _anon_huge_bytes()
    share = None if before is None or after is None else (after - before) / nbytes
    buffer.sum()
    best_s = math.inf
    for _ in range(STREAM_REPEATS):
        start = time.perf_counter()
        buffer.sum()
        best_s = min(best_s, time.perf_counter() - start)
    return {"gb_s": numel * 4 / best_s / 1e9, "huge_page_share": share}


def transparent_huge_pages_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never": the bracketed word), None off Linux."""
    try:
        match = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def measure(gemm_n: int = 2048, stream_mib: int = 1024) -> dict[str, Any]:
    """Every roof of this process's path, on its torch threads."""
    choice = cpu_isa.selected()
    stream_bytes = max(stream_mib * 2**20 // HUGE_PAGE_BYTES, 1) * HUGE_PAGE_BYTES
    return {
        "path": choice.isa.name,
        "describe": choice.describe(),
        "native_bf16": choice.bf16,
        "threads": torch.get_num_threads(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "gemm_bf16": gemm_flop_s(torch.bfloat16, gemm_n),
        "gemm_fp32": gemm_flop_s(torch.float32, gemm_n),
        "transparent_huge_pages": transparent_huge_pages_mode(),
        "stream_huge": stream_read(stream_bytes, huge_pages=True),
        "stream_4k": stream_read(stream_bytes, huge_pages=False),
    }


def path_environment(path: str, base: dict[str, str]) -> dict[str, str]:
    """`base` set up for `path`: the CPU's best as kvserve runs it unforced (no KVSERVE_CPU_ISA), any
    other forced by KVSERVE_CPU_ISA, with torch's own CPU code capped to it (isa.cap_torch)."""
    env = {name: value for name, value in base.items() if name != cpu_isa.ENV}
    choice = cpu_isa.choose(path, build_config.cpu_features())
    if choice.isa != choice.best:
        env[cpu_isa.ENV] = path
        cpu_isa.cap_torch(choice, env)
    return env


def json_on_path(script: str, args: list[str], path: str, base_env: dict[str, str]) -> Any:
    """`script --json *args` in a process of its own on `path`, whose environment is otherwise `base_env`: the
    JSON of its last line of output."""
    cmd = [sys.executable, script, "--json", *args]
    out = subprocess.run(cmd, env=path_environment(path, base_env), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{Path(script).name} on the {path} path failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def measure_path(path: str, base_env: dict[str, str], gemm_n: int = 2048, stream_mib: int = 1024) -> dict[str, Any]:
    """`measure` in a process of its own on `path`, whose environment is otherwise `base_env`."""
    return json_on_path(__file__, ["--gemm-n", str(gemm_n), "--stream-mib", str(stream_mib)], path, base_env)


def measure_every_path(base_env: dict[str, str], gemm_n: int = 2048, stream_mib: int = 1024) -> list[dict[str, Any]]:
    """The roofs of each path this CPU executes, lowest first."""
    return [measure_path(isa.name, base_env, gemm_n, stream_mib) for isa in build_config.executable_isas()]


def print_table(roofs: list[dict[str, Any]]) -> None:
    print("\n## roofs (this machine, now: each path in a process of its own)")
    print(f"transparent huge pages: {roofs[0]['transparent_huge_pages']}; {roofs[0]['threads']} torch threads")
    print("| path | bf16 GFLOP/s (n, via) | fp32 GFLOP/s (n, via) | stream GB/s huge pages (share granted) | 4 KiB |")
    print("|---|---|---|---|---|")
    for r in roofs:
        gemm = [f"{g['flop_s'] / 1e9:.1f} ({g['n']}, {g['via']})" for g in (r["gemm_bf16"], r["gemm_fp32"])]
        huge, small = r["stream_huge"], r["stream_4k"]
        granted = "unknown" if huge["huge_page_share"] is None else f"{huge['huge_page_share']:.0%}"
        print(f"| {r['describe']} | {gemm[0]} | {gemm[1]} | {huge['gb_s']:.1f} ({granted}) | {small['gb_s']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print this process's path's roofs as one JSON object")
    parser.add_argument("--gemm-n", type=int, default=2048, help="the largest GEMM side")
    parser.add_argument("--stream-mib", type=int, default=1024, help="the stream buffer's size")
    args = parser.parse_args()
    if args.json:
        cpu_isa.cap_torch(cpu_isa.selected())  # a forced path: torch's own ops too, before they first run
        print(json.dumps(measure(args.gemm_n, args.stream_mib)))
    else:
        print_table(measure_every_path(dict(os.environ), args.gemm_n, args.stream_mib))


if __name__ == "__main__":
    main()
