"""The elementwise steps of a decoder layer, as five fused operations.

`TorchLayerOps` defines them with torch ops; it is the reference and the fallback. On the CPU the
compiled kernels of kvserve/kernels/cpu (same names, same arguments, same results up to float32
summation order and exp's polynomial, each result rounded once) replace them, in the Python layer loop
and in the compiled decode step alike: a decode step's cost there was mostly the
per-call overhead of ~25 small torch ops per layer, not their arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu


class TorchLayerOps:
    @staticmethod
    def add_rms_norm(
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        dtype: torch.dtype,
        delta_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual += delta (in place, float32; with `delta_weight`, rms_norm(delta) * delta_weight: the
        norms after attention and MLP, Gemma 3's); returns rms_norm(residual) * weight in `dtype`."""
        if delta_weight is not None:
            assert delta is not None, "delta_weight needs a delta"
            residual.add_(F.rms_norm(delta.float(), (delta.shape[-1],), delta_weight, eps))
        elif delta is not None:
            residual.add_(delta)
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps).to(dtype)

    @staticmethod
    def head_rms_norm(
        qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> None:
        """In place on the q and k heads of qkv [T, (Hq + 2 Hkv) * D]: each head RMS-normalized over D in
        float32, q heads times q_weight, k heads times k_weight (float32 [D]); Qwen3's and Gemma 3's."""
        t, dim = qkv.shape[0], q_weight.shape[0]
        heads = qkv[:, : (num_heads + num_kv_heads) * dim].view(t, -1, dim)
        for part, weight in ((heads[:, :num_heads], q_weight), (heads[:, num_heads:], k_weight)):
            part.copy_(F.rms_norm(part.float(), (dim,), weight, eps))

    @staticmethod
    def rope_write_kv(
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """Rotate-half RoPE on the q and k heads of qkv [T, (Hq + 2 Hkv) * D] in place (float32 math,
        cos/sin float32 [max_len, D]); then k and v go to the cache rows `slots` of one layer's
        caches [num_slots..., Hkv, D]."""
        t, dim = qkv.shape[0], cos.shape[1]
        qk = qkv[:, : (num_heads + num_kv_heads) * dim].view(t, num_heads + num_kv_heads, dim)
        c = cos.index_select(0, positions).unsqueeze(1)
        s = sin.index_select(0, positions).unsqueeze(1)
        x = qk.float()
        half = dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        qk.copy_(x * c + rotated * s)
        kv = num_kv_heads * dim
        k_start = num_heads * dim
        k_cache.view(-1, kv).index_copy_(0, slots, qkv[:, k_start : k_start + kv])
        v_cache.view(-1, kv).index_copy_(0, slots, qkv[:, k_start + kv :])

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2I] (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up for gate_up [T, 2I] (gate first): Gemma's gated MLP."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def layer_ops_for(device: torch.device) -> Any:
    """The compiled kernels on the CPU where they build, else the torch definitions."""
    kernels = cpu.load() if device.type == "cpu" else None
    return kernels if kernels is not None else TorchLayerOps
