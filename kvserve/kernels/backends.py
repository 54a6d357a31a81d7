"""Attention backends by name: every one computes the same function, (q, k_cache, v_cache, meta, scale)
-> out, and is chosen by the engine's `attention_backend` config field."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from kvserve.kernels.attention import tiled_attention
from kvserve.kernels.attention_ref import paged_reference_attention
from kvserve.kernels.attention_sdpa import sdpa_attention
from kvserve.kernels.metadata import AttentionMetadata

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
BACKEND_NAMES = ("tiled", "reference", "sdpa", "triton")


def triton_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def get_attention_backend(name: str, device: torch.device | str) -> AttentionFn:
    if name == "tiled":
        return tiled_attention
    if name == "reference":
        return paged_reference_attention
    if name == "sdpa":
        return sdpa_attention
    if name == "triton":
        if not triton_available(device):
            raise ValueError(f"attention_backend 'triton' needs CUDA and the triton package (device {device})")
        from kvserve.kernels.triton import triton_attention  # imports triton: only where it exists

        return triton_attention
    raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")


def default_attention_backend(device: torch.device | str) -> str:
    """The fastest correct backend on this device kind.

    CUDA with triton: the Triton kernels (tiles in on-chip memory, the case FlashAttention is for).
    CPU: "tiled". Measured with benchmarks/attention.py (1 thread, float32, SmolLM2-135M heads, ms per
    layer call, tiled vs sdpa): batched decode 64x1024 38 vs 92, 256x512 83 vs 181, 256x2048 233 vs
    589, 128 mixed lengths 60 vs 264, verify 32x4 16 vs 35, 255 decodes + one 256-token prefill 62 vs
    126, with 5-40x less peak memory; sdpa wins prefill (1024 tokens 25 vs 51, 4096 384 vs 844) and
    tiny batches, where the tiled path's ~70 torch ops cost ~0.4 ms more per call. Serving time is
    dominated by batched decode steps (one per output token, for every running sequence), so tiled.
    """
    if triton_available(device):
        return "triton"
    return "tiled"
