"""Load a Llama-family HF directory: config.json + *.safetensors (+ tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvserve.model.config import ModelConfig


def read_hf_config(directory: Path) -> tuple[ModelConfig, dict[str, Any]]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no config.json")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"only Llama-family models are supported, config.json says model_type={model_type!r}")
    heads = raw["num_attention_heads"]
    scaling = raw.get("rope_scaling")
    config = ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", 10000.0),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
    )
    return config, raw


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
