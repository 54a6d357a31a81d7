"""The "cpu" backend: the compiled tiled kernel (kernels/cpu/decode_attention.cpp) for
sequences with few new tokens, torch SDPA for prefill chunks.

The compiled kernel is FlashAttention's online softmax with the cache block as the KV tile, reading
K/V where they lie in the paged cache: no gathered copy, no score matrix. With a bf16 cache on a CPU
with AMX (head dim 32 or 64, blocks a multiple of 16 keys) its products run on the AMX tiles
(decode_attention_amx.cpp), elsewhere on AVX-512 or plain loops. Prefill
rows are a matrix-product workload, where SDPA's blocked GEMMs win (benchmarks/attention.py).
"""

from __future__ import annotations

import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention import DECODE_MAX_QUERY_LEN
from kvserve.kernels.attention_sdpa import prefill_rows
from kvserve.kernels.metadata import AttentionMetadata


def cpu_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Packed varlen causal attention over the paged cache. q: [T, Hq, D] (rows may be strided)."""
    kernels = cpu.load()
    if kernels is None:
        raise RuntimeError("attention_backend 'cpu' needs kvserve's compiled CPU kernels (see kvserve/kernels/cpu)")
    out = q.new_empty(q.shape)
    decode = meta.plans.get("cpu-decode")
    if decode is None:
        ids = [i for i, n in enumerate(meta.query_lens_host) if n <= DECODE_MAX_QUERY_LEN]
        decode = meta.plans["cpu-decode"] = torch.tensor(ids, dtype=torch.int64)
    if len(decode):
        kernels.decode_attention(
            out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, decode, scale
        )
    if len(decode) < meta.num_seqs:
        prefill_rows(q, k_cache, v_cache, meta, scale, out)
    return out
