"""Attention backends by name: every one computes the same function, (q, k_cache, v_cache, meta, scale,
window=None) -> out, and is chosen by the engine's `attention_backend` config field."""

from __future__ import annotations

import importlib.util
import logging

import torch

from kvserve.config import BACKEND_NAMES
from kvserve.kernels import cpu
from kvserve.kernels.attention import tiled_attention
from kvserve.kernels.attention_cpu import cpu_attention
from kvserve.kernels.attention_ref import paged_reference_attention
from kvserve.kernels.attention_sdpa import sdpa_attention
from kvserve.kernels.metadata import AttentionFn, AttentionMetadata

logger = logging.getLogger(__name__)


def triton_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


# Total keys in a batch (sum of seq_lens) from which the tiled kernel beats torch SDPA on the CPU
# (benchmarks/attention.py): small batches, short contexts and prefill go to SDPA; large decode batches
# over long contexts go to the tiled kernel, which also needs far less memory there. Figures:
# benchmarks/RESULTS.md, "Figures behind the code's rules".
TILED_FROM_TOTAL_KEYS = 32_768


def auto_cpu_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The compiled CPU kernels where they build; otherwise, per batch, the faster of the tiled kernel
    and SDPA for its shape (see TILED_FROM_TOTAL_KEYS)."""
    if cpu.load() is not None:
        return cpu_attention(q, k_cache, v_cache, meta, scale, window)
    if sum(meta.seq_lens_host) >= TILED_FROM_TOTAL_KEYS:
        return tiled_attention(q, k_cache, v_cache, meta, scale, window)
    return sdpa_attention(q, k_cache, v_cache, meta, scale, window)


def runs_compiled_decode(attention: AttentionFn) -> bool:
    """Whether `attention` sends every decode row to the compiled CPU kernel, so a model may run a
    small decode step as one compiled call (LlamaModel.forward's `compiled_decode`)."""
    return attention in (cpu_attention, auto_cpu_attention) and cpu.load() is not None


def get_attention_backend(name: str, device: torch.device | str, windowed: bool = False) -> AttentionFn:
    """The backend `name`; `windowed`: the model has sliding-window layers."""
    if windowed and name == "triton":
        raise ValueError(
            "attention_backend 'triton' has no sliding window yet; this model has sliding-window layers: "
            "use one of 'sdpa', 'tiled', 'reference', 'cpu', 'auto_cpu'"
        )
    if windowed and name in ("cpu", "auto_cpu") and cpu.load() is not None:
        logger.info("sliding-window layers run attention on the compiled CPU kernel, skipping blocks before the window")
    if name == "auto_cpu":
        return auto_cpu_attention
    if name == "tiled":
        return tiled_attention
    if name == "reference":
        return paged_reference_attention
    if name == "sdpa":
        return sdpa_attention
    if name == "cpu":
        if cpu.load() is None:
            raise ValueError("attention_backend 'cpu' needs kvserve's compiled CPU kernels, which failed to build")
        return cpu_attention
    if name == "triton":
        if not triton_available(device):
            raise ValueError(f"attention_backend 'triton' needs CUDA and the triton package (device {device})")
        from kvserve.kernels.triton import triton_attention  # imports triton: only where it exists

        return triton_attention
    raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")


def default_attention_backend(device: torch.device | str) -> str:
    """The fastest correct backend on this device kind: the Triton kernels on CUDA (tiles in on-chip
    memory, the case FlashAttention is for); on the CPU a per-batch choice between the tiled kernel
    and SDPA (auto_cpu_attention)."""
    if triton_available(device):
        return "triton"
    return "auto_cpu"
