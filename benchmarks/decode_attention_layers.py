"""A decode step's attention as the compiled step runs it, kernel against kernel in one process: one
call per layer, each layer with its own KV pool on huge pages (as the engine allocates it), so each call
finds its K/V out of cache as it does between a step's layers.

Kernels (bf16 caches, SmolLM2-135M's attention shape by default: 9 query heads, 3 KV heads, head dim 64;
--heads 4,1,256 for Gemma 3 270M's, --window 512 for its sliding layers; blocks of 16, block tables shuffled
as a busy pool leaves them):
- "bf16": decode_attention_bf16.cpp (AVX512-BF16 builds);
- "avx2": decode_attention_avx2.cpp (the avx2 path's builds);
- "widened": decode_attention.cpp's float32 kernel, the path of plain builds and of AVX-512 ones without
  AVX512-BF16 (set_bf16_attention and set_avx2_attention off);
- "bf16-whole", "avx2-whole", "widened-whole": the same with the key split off (set_attention_key_split), which
  otherwise shares few decode rows' keys among the threads (decode_attention_key_split.h);
- "amx": decode_attention_amx.cpp where the CPU has AMX (set_amx_attention off for the others).
Rounds alternate the kernels, so a change in this VM's speed hits each alike. Printed per batch shape:
the median over rounds of each round's best of --repeats passes, ms per layer call, the K/V bytes read
per second and their share of the read bandwidth measured in the same run (roofs.py's stream_read).

    python benchmarks/decode_attention_layers.py [--shapes 100x190 32x512 1x2048] [--heads 9,3,64]
        [--window 0] [--layers 30] [--rounds 6] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from roofs import stream_read

from kvserve.kernels import cpu
from kvserve.kernels.attention_ref import random_paged_inputs
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model.huge_pages import empty_on_huge_pages

BLOCK = 16


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    out = empty_on_huge_pages(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out


def layer_inputs(batch: int, keys: int, heads: tuple[int, int, int], layers: int) -> list[tuple]:
    inputs = []
    for seed in range(layers):
        q, k, v, meta = random_paged_inputs([1] * batch, [keys] * batch, *heads, BLOCK, torch.bfloat16, seed)
        inputs.append((q, on_huge_pages(k), on_huge_pages(v), meta))
    return inputs


def kernel_switches(kernels) -> dict[str, tuple[bool, bool, bool, bool]]:
    """name -> (AMX allowed, AVX512-BF16 allowed, AVX2 kernel allowed, key split allowed), for the kernels this
    build and CPU run."""
    switches = {"widened": (False, False, False, True), "widened-whole": (False, False, False, False)}
    if cpu_isa.selected().bf16:  # the build has AVX512-BF16 (or AMX, whose builds have it too)
        switches["bf16"] = (False, True, False, True)
        switches["bf16-whole"] = (False, True, False, False)
    if cpu_isa.selected().isa.name == "avx2":
        switches["avx2"] = (False, False, True, True)
        switches["avx2-whole"] = (False, False, True, False)
    if kernels.amx_available():
        switches["amx"] = (True, False, False, False)
    return switches


def set_switches(kernels, amx: bool, bf16: bool, avx2: bool, split: bool) -> tuple[bool, bool, bool, bool]:
    """Sets the kernel switches; returns their previous settings."""
    return (
        kernels.set_amx_attention(amx),
        kernels.set_bf16_attention(bf16),
        kernels.set_avx2_attention(avx2),
        kernels.set_attention_key_split(split),
    )


def one_pass_ms(kernels, inputs: list[tuple], scale: float, window: int) -> float:
    """ms per layer call over one pass through every layer."""
    seq_ids = torch.arange(inputs[0][3].seq_lens.numel(), dtype=torch.int64)
    out = torch.empty_like(inputs[0][0])
    start = time.perf_counter()
    for q, k, v, meta in inputs:
        kernels.decode_attention(
            out, q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, seq_ids, scale, window
        )
    return (time.perf_counter() - start) / len(inputs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["100x190", "32x512", "1x2048"], help="BATCHxKEYS")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    parser.add_argument("--window", type=int, default=0, help="sliding window in keys (0: none)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="passes per kernel and round (the best counts)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_attention_layers.json")
    args = parser.parse_args()
    kernels = cpu.load()
    if kernels is None:
        raise SystemExit("decode_attention_layers needs kvserve's compiled CPU kernels")
    stream = stream_read(1 << 30, huge_pages=True)["gb_s"]
    switches = kernel_switches(kernels)
    hq, hkv, dim = heads = tuple(int(n) for n in args.heads.split(","))
    scale = dim**-0.5
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; stream read {stream:.1f} GB/s (huge pages)")
    print(f"heads {hq} query, {hkv} KV, dim {dim}; window {args.window or 'none'}")
    print(f"{'shape':>9} {'kernel':>13} {'ms/layer':>9} {'GB/s':>6} {'stream':>7} {'vs widened':>11}")
    rows = []
    for shape in args.shapes:
        batch, keys = (int(n) for n in shape.split("x"))
        inputs = layer_inputs(batch, keys, heads, args.layers)
        kv_bytes = batch * min(keys, args.window or keys) * hkv * dim * 2 * 2  # the keys each row reads
        times: dict[str, list[float]] = {name: [] for name in switches}
        for _ in range(args.rounds):
            for name, setting in switches.items():
                previous = set_switches(kernels, *setting)
                try:
                    one_pass_ms(kernels, inputs, scale, args.window)  # the warm-up pass
                    times[name].append(
                        min(one_pass_ms(kernels, inputs, scale, args.window) for _ in range(args.repeats))
                    )
                finally:
                    set_switches(kernels, *previous)
        widened = statistics.median(times["widened"])
        for name, ts in times.items():
            ms = statistics.median(ts)
            gb_s = kv_bytes / ms / 1e6
            rows.append(
                {
                    "shape": shape,
                    "kernel": name,
                    "ms_per_layer": ms,
                    "gb_s": gb_s,
                    "stream_share": gb_s / stream,
                    "speedup_vs_widened": widened / ms,
                    "rounds_ms": ts,
                }
            )
            print(
                f"{shape:>9} {name:>13} {ms:>9.3f} {gb_s:>6.1f} {gb_s / stream:>6.0%} {widened / ms:>10.2f}x",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "heads": {"query": hq, "kv": hkv, "dim": dim},
        "window": args.window,
        "layers": args.layers,
        "stream_gb_s": stream,
    }
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
