"""Rotary position embedding tables: the inverse frequencies of each RoPE variant, as HF transformers
computes them (modeling_rope_utils.py), and their cos/sin for every position."""

from __future__ import annotations

import math

import torch

from kvserve.model.config import SLIDING, ModelConfig

ROPE_SCALINGS = ("linear", "llama3")


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_for(config: ModelConfig, layer_type: str) -> torch.Tensor:
    """The inverse frequencies of one layer type's RoPE (Gemma 3's sliding layers have their own base)."""
    dim = config.head_dim
    if layer_type == SLIDING and config.sliding_rope_theta is not None:
        return default_inv_freq(config.sliding_rope_theta, dim)
    inv_freq = default_inv_freq(config.rope_theta, dim)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    if kind != "default":
        raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: {['default', *ROPE_SCALINGS]}")
    return inv_freq


def rope_tables(
    config: ModelConfig, max_len: int, device: torch.device, layer_type: str = "full_attention"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position in float32, [max_len, head_dim] in rotate-half layout."""
    inv_freq = inv_freq_for(config, layer_type)
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)
