"""Mistral: the Llama layer with sliding-window attention in every layer (`sliding_window`; null: none).
llama.cpp writes Mistral GGUFs as architecture `llama`, without the window, so none is read here."""

from __future__ import annotations

from typing import Any

from kvserve.model.config import ModelConfig
from kvserve.model.families.family import Family, base_config_from_hf
from kvserve.model.families.llama import check_plain_llama_layers
from kvserve.model.hf_config import HFConfig

# transformers' MistralConfig defaults, for keys a config.json may leave out.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096 * 32,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": 4096,
}


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    cfg = HFConfig(raw, HF_DEFAULTS, "mistral")
    check_plain_llama_layers(cfg)
    return base_config_from_hf(cfg, sliding_window=cfg.get("sliding_window"))


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    gguf_architecture=None,
    config_from_hf=config_from_hf,
    config_from_gguf=None,
)
