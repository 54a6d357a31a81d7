"""Llama 1/2/3.x (and SmolLM2): the base layer; RoPE scaling `linear` or `llama3` (GGUF: rope_freqs)."""

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

# transformers' LlamaConfig defaults, for keys a config.json may leave out.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def check_plain_llama_layers(cfg: HFConfig) -> None:
    """The Llama layer as kvserve runs it: SiLU-gated MLP, no biases."""
    cfg.require("hidden_act", ("silu",))
    cfg.require("attention_bias", (False,))
    cfg.require("mlp_bias", (False,))


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    cfg = HFConfig(raw, HF_DEFAULTS, "llama")
    check_plain_llama_layers(cfg)
    return base_config_from_hf(cfg)


def config_from_gguf(meta: GGUFMetadata) -> ModelConfig:
    freqs = meta.tensor("rope_freqs.weight")
    return base_config_from_gguf(
        meta,
        "llama",
        rope_scaling=gguf_rope_scaling(meta),
        rope_freq_factors=None if freqs is None else tuple(float(f) for f in freqs),
    )


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    gguf_architecture="llama",
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_permuted_qk=True,
)
