"""Qwen2 / Qwen2.5: the Llama layer with a bias on the q, k and v projections; untied LM head on the
larger sizes. Qwen's optional sliding window (`use_sliding_window`) is not implemented."""

from __future__ import annotations

from typing import Any

from kvserve.model.config import ModelConfig
from kvserve.model.families.family import (
    Family,
    GGUFMetadata,
    base_config_from_gguf,
    base_config_from_hf,
    gguf_rope_scaling,
)
from kvserve.model.hf_config import HFConfig

# transformers' Qwen2Config defaults, for keys a config.json may leave out.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    cfg = HFConfig(raw, HF_DEFAULTS, "qwen2")
    cfg.require("hidden_act", ("silu",))
    cfg.require("use_sliding_window", (False,))
    return base_config_from_hf(cfg, attention_bias=True)


def config_from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return base_config_from_gguf(meta, "qwen2", rope_scaling=gguf_rope_scaling(meta), attention_bias=True)


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_architecture="qwen2",
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
)
