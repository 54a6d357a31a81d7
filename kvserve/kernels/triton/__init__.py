"""Triton GPU kernels with the CPU kernels' entry points. Importing this package imports triton, so
`kvserve.kernels.backends` imports it only when CUDA and triton are present."""

from __future__ import annotations

import torch

from kvserve.kernels.attention import DECODE_MAX_QUERY_LEN
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.triton.decode import triton_decode_attention
from kvserve.kernels.triton.prefill import triton_prefill_attention

__all__ = ["triton_attention", "triton_decode_attention", "triton_prefill_attention"]


def triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """A mixed batch: few-token sequences through the decode kernel, the rest through prefill; `window`:
    each query sees only the last `window` keys."""
    out = torch.empty_like(q)
    decode = [i for i, n in enumerate(meta.query_lens_host) if n <= DECODE_MAX_QUERY_LEN]
    prefill = [i for i, n in enumerate(meta.query_lens_host) if n > DECODE_MAX_QUERY_LEN]
    triton_decode_attention(q, k_cache, v_cache, meta, scale, seqs=decode, out=out, window=window)
    triton_prefill_attention(q, k_cache, v_cache, meta, scale, seqs=prefill, out=out, window=window)
    return out
