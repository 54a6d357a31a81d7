"""GPU check of the Triton kernels: relative error against the float64 oracle, and time against torch
SDPA (one padded call per batch, the strongest plain-torch baseline). Run via gpu_attention_check.sh.

--sweep: every launch shape of kvserve.kernels.triton.launch's sweeps on every case, each checked against the
oracle, then per kernel and dtype the geometric-mean time of each shape over its cases (the defaults in
launch.py are the winners)."""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.triton import triton_decode_attention, triton_prefill_attention
from kvserve.kernels.triton.launch import DECODE_SWEEP, PREFILL_SWEEP, LaunchConfig

HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B-like attention, so the GPU has real work
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CASES = [  # (name, query_lens, seq_lens)
    ("prefill 1x1024", [1024], [1024]),
    ("prefill 1x4096", [4096], [4096]),
    ("prefill 512 after 3584 cached", [512], [4096]),
    ("prefill 8 mixed", [100, 300, 700, 1000, 57, 1, 2000, 33], [100, 900, 700, 3000, 57, 1, 2000, 64]),
    ("decode 1x4096", [1], [4096]),
    ("decode 64x2048", [1] * 64, [2048] * 64),
    ("decode 256x1024", [1] * 256, [1024] * 256),
    ("verify 32x(4 of 2048)", [4] * 32, [2048] * 32),
]


def time_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def sdpa_padded(dtype: torch.dtype, qlens: list[int], slens: list[int]) -> Callable[[], torch.Tensor]:
    """SDPA on contiguous padded [B, H, L, D] tensors, no paging and no gather: a baseline that favours
    SDPA. Causal (top-left) only when no sequence has a cached prefix, else unmasked (more work)."""
    b, max_q, max_s = len(qlens), max(qlens), max(slens)
    qb = torch.randn(b, HQ, max_q, D, device="cuda", dtype=dtype)
    kb = torch.randn(b, HKV, max_s, D, device="cuda", dtype=dtype)
    vb = torch.randn_like(kb)
    causal = max_q > 1 and all(a == s for a, s in zip(qlens, slens, strict=True))
    return functools.partial(F.scaled_dot_product_attention, qb, kb, vb, is_causal=causal, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="time every launch shape of the sweeps in launch.py")
    sweep = parser.parse_args().sweep
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<32} {'dtype':<9} {'kernel':<8} {'shape':<16} {'rel err':>9} {'ok':>3} {'ms':>8} {'sdpa ms':>8}")
    failures = 0
    times: dict[tuple[str, str, str], list[float]] = {}  # (kernel, dtype, shape) -> ms per case
    for dtype in (torch.float32, torch.bfloat16):
        label = str(dtype).removeprefix("torch.")
        for name, qlens, slens in CASES:
            q, k, v, meta = random_paged_inputs(qlens, slens, HQ, HKV, D, BLOCK, dtype)
            q, k, v = q.cuda(), k.cuda(), v.cuda()
            meta = AttentionMetadata.build(qlens, slens, meta.block_tables.tolist(), BLOCK, "cuda")
            scale = D**-0.5
            ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64)
            decode = max(qlens) <= 8
            kernel = "decode" if decode else "prefill"
            fn = triton_decode_attention if decode else triton_prefill_attention
            base = time_ms(sdpa_padded(dtype, qlens, slens))
            configs: list[LaunchConfig | None] = [None]
            if sweep:
                configs = list(DECODE_SWEEP if decode else PREFILL_SWEEP)
            for config in configs:
                try:
                    out = fn(q, k, v, meta, scale, config=config)
                except Exception as error:  # a swept shape may not fit (shared memory, registers): say so
                    if config is None:
                        raise
                    print(f"{name:<32} {label:<9} {kernel:<8} {config!s:<16} does not run: {type(error).__name__}")
                    continue
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ok = err < TOLERANCE[dtype] and bool(torch.isfinite(out).all())
                failures += not ok
                ms = time_ms(functools.partial(fn, q, k, v, meta, scale, config=config))
                shape = str(config) if config else "default"
                times.setdefault((kernel, label, shape), []).append(ms)
                print(
                    f"{name:<32} {label:<9} {kernel:<8} {shape:<16} {err:>9.2e} {'yes' if ok else 'NO':>3}"
                    f" {ms:>8.3f} {base:>8.3f}"
                )
    if sweep:
        print(f"\n{'kernel':<8} {'dtype':<9} {'shape':<16} {'geomean ms':>10} {'cases run':>9}")
        means = {key: statistics.geometric_mean(ms) for key, ms in times.items()}
        for (kernel, label, shape), mean in sorted(means.items(), key=lambda kv: (kv[0][:2], kv[1])):
            print(f"{kernel:<8} {label:<9} {shape:<16} {mean:>10.3f} {len(times[kernel, label, shape]):>9}")
    print("all within tolerance" if not failures else f"{failures} case(s) out of tolerance")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
