"""Llama-family forward pass over a packed batch of variable-length spans (no padding).

Each call processes T new tokens belonging to several sequences at once. K/V of the new tokens are
written into the paged cache through `slot_mapping` before attention runs, so attention sees each
sequence's cached prefix and its new tokens through one interface (see kernels/metadata.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvserve.kernels.metadata import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.linear import LinearFn, make_linear
from kvserve.model.weights import ModelWeights


class LayerLinears(NamedTuple):
    qkv_proj: LinearFn
    o_proj: LinearFn
    gate_up_proj: LinearFn
    down_proj: LinearFn


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The fused kernel keeps the variance in float32 for bf16 input and matches the unfused
    # reference (x * rsqrt(mean(x^2) + eps) * weight) bit for bit in float32.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_tables(config: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position in float32, [max_len, head_dim] in rotate-half layout."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling or ())
    if scaling.get("type", scaling.get("rope_type")) == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif scaling:
        raise ValueError(f"unsupported rope_scaling {scaling}")
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D] already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.weights = weights.to(dtype, device)
        self.linears = [
            LayerLinears(*(make_linear(getattr(layer, name)) for name in LayerLinears._fields))
            for layer in self.weights.layers
        ]
        self.lm_head = make_linear(self.weights.lm_head)
        # The residual stream and the norms stay in float32 whatever the weights' dtype: summing 30
        # layers' updates in bf16 loses enough precision to flip greedy choices early on this model.
        self.norms = [(layer.attn_norm.float(), layer.mlp_norm.float()) for layer in self.weights.layers]
        self.final_norm = self.weights.final_norm.float()
        cos, sin = rope_tables(config, max_len, device)
        self.rope_cos = cos.to(dtype)
        self.rope_sin = sin.to(dtype)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # int64 [T]: block_id * block_size + offset for each new token
        meta: AttentionMetadata,
        attention: AttentionFn,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]. `num_layers` < all runs a truncated (self-draft) model."""
        cfg = self.config
        w = self.weights
        h = F.embedding(input_ids, w.embed_tokens).float()
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        t = input_ids.shape[0]
        eps = cfg.rms_norm_eps
        for index, (linear, (attn_norm, mlp_norm)) in enumerate(
            zip(self.linears[:num_layers], self.norms, strict=False)
        ):
            x = rms_norm(h, attn_norm, eps).to(self.dtype)
            qk, v = linear.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # q and k heads rotate together: one RoPE application instead of two.
            qk = apply_rope(qk.view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            k_cache, v_cache = kv_cache[index, 0], kv_cache[index, 1]
            k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, slot_mapping, k)
            v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(
                0, slot_mapping, v.view(t, cfg.num_kv_heads, cfg.head_dim)
            )
            o = attention(q, k_cache, v_cache, meta, self.scale)
            h = h + linear.o_proj(o.reshape(t, self.q_size))
            x = rms_norm(h, mlp_norm, eps).to(self.dtype)
            gate, up = linear.gate_up_proj(x).chunk(2, dim=-1)
            h = h + linear.down_proj(F.silu(gate) * up)
        return rms_norm(h, self.final_norm, eps).to(self.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows only (callers select the rows they sample from)."""
        return self.lm_head(hidden).float()
