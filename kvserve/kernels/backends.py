"""Attention backends by name: every one computes the same function, (q, k_cache, v_cache, meta, scale,
window=None) -> out, is chosen by the engine's `attention_backend` config field, and declares what it
supports (AttentionBackend)."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvserve.config import BACKEND_NAMES
from kvserve.kernels import cpu
from kvserve.kernels.attention import DECODE_MAX_QUERY_LEN, tiled_attention
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
    """The compiled CPU kernels where they build; otherwise torch_cpu_attention."""
    if cpu.load() is not None:
        return cpu_attention(q, k_cache, v_cache, meta, scale, window)
    return torch_cpu_attention(q, k_cache, v_cache, meta, scale, window)


def torch_cpu_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention on torch ops: per batch, the faster of the tiled kernel and SDPA for its shape (see
    TILED_FROM_TOTAL_KEYS)."""
    if sum(meta.seq_lens_host) >= TILED_FROM_TOTAL_KEYS:
        return tiled_attention(q, k_cache, v_cache, meta, scale, window)
    return sdpa_attention(q, k_cache, v_cache, meta, scale, window)


@dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation and what it supports, so that callers ask it rather than recognise it.

    Called like the function it wraps: (q, k_cache, v_cache, meta, scale, window=None) -> output rows."""

    name: str
    attend: AttentionFn | None  # None until get_attention_backend checked that it can run here (triton)
    windows: bool  # computes sliding-window layers (the `window` argument)
    # Sends every decode row (query length <= DECODE_MAX_QUERY_LEN) to the compiled CPU decode kernel where
    # the kernels built, so a step made only of decode rows may run as one compiled call (compiled_decode.py).
    decode_rows_on_cpu_kernel: bool

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.attend is not None, "get_attention_backend returns backends that can run"
        return self.attend(*args, **kwargs)

    @property
    def compiled_decode(self) -> bool:
        return self.decode_rows_on_cpu_kernel and cpu.load() is not None

    def decode_kernel_takes_every_row(self, meta: AttentionMetadata) -> bool:
        """Whether this batch's every row goes to the compiled decode kernel (see `compiled_decode`)."""
        return self.compiled_decode and meta.max_query_len <= DECODE_MAX_QUERY_LEN


BACKENDS = {
    backend.name: backend
    for backend in (
        AttentionBackend("auto_cpu", auto_cpu_attention, windows=True, decode_rows_on_cpu_kernel=True),
        AttentionBackend("cpu", cpu_attention, windows=True, decode_rows_on_cpu_kernel=True),
        AttentionBackend("tiled", tiled_attention, windows=True, decode_rows_on_cpu_kernel=False),
        AttentionBackend("sdpa", sdpa_attention, windows=True, decode_rows_on_cpu_kernel=False),
        AttentionBackend("reference", paged_reference_attention, windows=True, decode_rows_on_cpu_kernel=False),
        AttentionBackend("triton", None, windows=True, decode_rows_on_cpu_kernel=False),
    )
}


def get_attention_backend(name: str, device: torch.device | str, windowed: bool = False) -> AttentionBackend:
    """The backend `name`, checked to run here; `windowed`: the model has sliding-window layers, which the
    backend must compute."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if windowed and not backend.windows:
        computes = [n for n, b in BACKENDS.items() if b.windows]
        raise ValueError(
            f"attention_backend {name!r} has no sliding window yet; this model has sliding-window layers: "
            f"use one of {computes}"
        )
    if name == "cpu" and cpu.load() is None:
        raise ValueError("attention_backend 'cpu' needs kvserve's compiled CPU kernels, which failed to build")
    if windowed and backend.compiled_decode:
        logger.info("sliding-window layers run attention on the compiled CPU kernel, skipping blocks before the window")
    if name == "triton":
        if not triton_available(device):
            raise ValueError(f"attention_backend 'triton' needs CUDA and the triton package (device {device})")
        from kvserve.kernels.triton import triton_attention  # imports triton: only where it exists

        return replace(backend, attend=triton_attention)
    return backend


def default_attention_backend(device: torch.device | str) -> str:
    """The fastest correct backend on this device kind: the Triton kernels on CUDA (tiles in on-chip
    memory, the case FlashAttention is for); on the CPU a per-batch choice between the tiled kernel
    and SDPA (auto_cpu_attention)."""
    if triton_available(device):
        return "triton"
    return "auto_cpu"
