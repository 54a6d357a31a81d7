"""Qwen3: the Llama layer with an RMSNorm on each q and k head before RoPE, no biases."""

from __future__ import annotations

from typing import Any

from kvserve.model.config import ModelConfig
from kvserve.model.families.family import (
    LLAMA_GGUF_LAYER_NAMES,
    Family,
    GGUFMetadata,
    base_config_from_gguf,
    base_config_from_hf,
    gguf_rope_scaling,
)
from kvserve.model.hf_config import HFConfig

# transformers' Qwen3Config defaults, for keys a config.json may leave out.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "head_dim": 128,
}
QK_NORM_GGUF_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    cfg = HFConfig(raw, HF_DEFAULTS, "qwen3")
    cfg.require("hidden_act", ("silu",))
    cfg.require("attention_bias", (False,))
    cfg.require("use_sliding_window", (False,))
    return base_config_from_hf(cfg, qk_norm=True)


def config_from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return base_config_from_gguf(meta, "qwen3", rope_scaling=gguf_rope_scaling(meta), qk_norm=True)


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_architecture="qwen3",
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, **QK_NORM_GGUF_NAMES},
)
