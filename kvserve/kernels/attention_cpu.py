"""The "cpu" backend: the compiled tiled kernel (kernels/cpu/decode_attention.cpp) for sequences with few new
tokens and short prefills; torch SDPA for the rest.

The compiled kernel is FlashAttention's online softmax with the cache block as the KV tile, reading K/V where
they lie in the paged cache: no gathered copy, no score matrix. With a bf16 cache on a CPU with AMX (head dim
32 or 64, blocks a multiple of 16 keys) its products run on the AMX tiles (decode_attention_amx.cpp),
elsewhere on AVX512-BF16, on the avx2 path on float32 vectors widened in registers, or on float32 vectors
over widened tiles (AVX-512 without AVX512-BF16), or plain loops. Long prefill
rows are a matrix-product workload, where SDPA's blocked GEMMs win (benchmarks/attention.py); the AMX kernel
wins while a sequence has at most AMX_PREFILL_MAX_KEYS keys, where AMX does not apply the AVX512-BF16 kernel
while it has at most BF16_PREFILL_MAX_KEYS and the AVX2 or widened float32 kernel while it has at most
WIDENED_PREFILL_MAX_KEYS. The plain loops never take prefill rows. A sliding-window layer runs a vector
kernel, which skips the cache blocks before the window; the AMX kernel has no window, so on AMX such a layer's
prefill rows go to a vector kernel.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention import DECODE_MAX_QUERY_LEN
from kvserve.kernels.attention_sdpa import prefill_rows
from kvserve.kernels.metadata import AttentionMetadata

# Sequences with more new tokens than a decode row go to the AMX kernel while they have at most this
# many keys: each chunk of 16 rows rescans all the keys it sees, so the kernel's cost grows with
# rows x keys faster than SDPA's, and past this SDPA wins
# (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
AMX_PREFILL_MAX_KEYS = 512
# The same bound for the AVX512-BF16 kernel, whose chunks of 32 rows per head rescan the keys they see
# (benchmarks/prefill_attention.py; figures: benchmarks/RESULTS.md, "Prefill rows on the AVX512-BF16
# attention kernel").
BF16_PREFILL_MAX_KEYS = 1024
# And for the AVX2 and widened float32 kernels where they score on vectors (AVX2 and up), whose rows rescan the keys
# they see (benchmarks/prefill_attention.py --dtype bfloat16|float32; figures: benchmarks/RESULTS.md,
# "Prefill rows on the widened float32 kernel" and "Decode attention on AVX2 without regrouped tiles").
WIDENED_PREFILL_MAX_KEYS = 512


def longest_prefill_on_kernel(kernels: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, window_keys: int) -> int:
    """The most keys a sequence with prefill rows may have for its rows to run on the compiled kernel: 0 where
    only the widened kernel's plain loops would take them (they go to SDPA)."""
    if kernels.amx_attention_applies(q, k_cache, window_keys):
        return AMX_PREFILL_MAX_KEYS
    if kernels.bf16_attention_applies(q, k_cache):
        return BF16_PREFILL_MAX_KEYS
    if kernels.widened_attention_vectorized(q):
        return WIDENED_PREFILL_MAX_KEYS
    return 0


def cpu_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Packed varlen causal attention over the paged cache. q: [T, Hq, D] (rows may be strided);
    `window`: a query sees only the last `window` keys (its own included)."""
    kernels = cpu.load()
    if kernels is None:
        raise RuntimeError("attention_backend 'cpu' needs kvserve's compiled CPU kernels (see kvserve/kernels/cpu)")
    out = q.new_empty(q.shape)
    window_keys = 0 if window is None else window  # the kernels' spelling of "no window"
    plan_key = ("cpu", window is None)  # which rows the kernel takes depends on whether the layer is windowed
    plan = meta.plans.get(plan_key)
    if plan is None:
        longest = longest_prefill_on_kernel(kernels, q, k_cache, window_keys)
        kernel_takes = [
            n <= DECODE_MAX_QUERY_LEN or s <= longest
            for n, s in zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
        ]
        kernel_rows = [i for i, takes in enumerate(kernel_takes) if takes]
        on_sdpa = [i for i, takes in enumerate(kernel_takes) if not takes]
        plan = meta.plans[plan_key] = (torch.tensor(kernel_rows, dtype=torch.int64), on_sdpa)
    on_kernel, on_sdpa = plan
    if len(on_kernel):
        kernels.decode_attention(
            out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, on_kernel, scale, window_keys
        )
    if on_sdpa:
        prefill_rows(q, k_cache, v_cache, meta, scale, out, on_sdpa, window)
    return out
