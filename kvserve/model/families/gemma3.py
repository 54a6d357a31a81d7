"""Gemma 3 (text): sliding-window layers interleaved with global ones, each kind with its own RoPE base;
q/k head norms; norms before and after attention and the MLP; a tanh-GELU gated MLP; embeddings scaled
by sqrt(hidden); norm weights w applied as x * (1 + w) (GGUF stores 1 + w); a tied LM head."""

from __future__ import annotations

import math
from typing import Any

from kvserve.model.config import FULL, SLIDING, ModelConfig
from kvserve.model.families.family import (
    LLAMA_GGUF_LAYER_NAMES,
    Family,
    GGUFMetadata,
    base_config_from_gguf,
    base_config_from_hf,
    gguf_rope_scaling,
)
from kvserve.model.families.qwen3 import QK_NORM_GGUF_NAMES
from kvserve.model.hf_config import HFConfig

# transformers' Gemma3TextConfig defaults, for keys a config.json may leave out.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131_072,
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "sliding_window": 4096,
    "head_dim": 256,
}
# Without `layer_types`, every sixth layer is global (transformers' and llama.cpp's rule).
SLIDING_WINDOW_PATTERN = 6
# llama.cpp's Gemma 3 GGUFs carry no base for the sliding layers: its loader uses this one.
GGUF_SLIDING_ROPE_THETA = 10_000.0


def default_layer_types(num_layers: int, pattern: int = SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def gemma_fields(hidden_size: int) -> dict[str, Any]:
    return dict(qk_norm=True, sandwich_norms=True, activation="gelu_tanh", embedding_scale=math.sqrt(hidden_size))


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    cfg = HFConfig(raw, HF_DEFAULTS, "gemma3")
    cfg.require("hidden_activation", ("gelu_pytorch_tanh",))
    cfg.require("attention_bias", (False,))
    cfg.require("final_logit_softcapping", (None,))
    cfg.require("attn_logit_softcapping", (None,))
    cfg.require("use_bidirectional_attention", (False, None))
    layers = cfg.get("num_hidden_layers")
    layer_types = raw.get("layer_types") or default_layer_types(layers, raw.get("sliding_window_pattern", 6))
    sliding_theta, sliding_scaling = cfg.rope(SLIDING)
    if sliding_scaling is not None:
        raise ValueError(f"unsupported RoPE scaling {dict(sliding_scaling)} on Gemma 3's sliding layers")
    full_theta, full_scaling = cfg.rope(FULL)
    return base_config_from_hf(
        cfg,
        rope_theta=full_theta,
        rope_scaling=full_scaling,
        sliding_window=cfg.get("sliding_window"),
        layer_types=tuple(layer_types),
        sliding_rope_theta=sliding_theta,
        attention_scale=float(cfg.get("query_pre_attn_scalar")) ** -0.5,
        **gemma_fields(cfg.get("hidden_size")),
    )


def config_from_gguf(meta: GGUFMetadata) -> ModelConfig:
    layers, hidden = int(meta.get("block_count")), int(meta.get("embedding_length"))
    head_dim = int(meta.get("attention.key_length"))
    # llama.cpp's rule: the 27B (62 layers) scales queries by 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim).
    scalar = hidden / int(meta.get("attention.head_count")) if layers == 62 else head_dim
    return base_config_from_gguf(
        meta,
        "gemma3",
        rope_scaling=gguf_rope_scaling(meta),
        sliding_window=int(meta.get("attention.sliding_window")),
        layer_types=default_layer_types(layers),
        sliding_rope_theta=GGUF_SLIDING_ROPE_THETA,
        attention_scale=scalar**-0.5,
        **gemma_fields(hidden),
    )


GEMMA3_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    **QK_NORM_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_types=("gemma3_text",),
    gguf_architecture="gemma3",
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names=GEMMA3_GGUF_LAYER_NAMES,
    hf_norm_offset=1.0,
)
