"""What a model family is to kvserve: how its config reads (HF config.json, GGUF metadata), how its
GGUF tensors are named, and what its layers add to the Llama layer (config.py's fields). The fields
every family shares are read here; each family's file adds its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from kvserve.model.config import ModelConfig
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.hf_config import HFConfig

# GGUF tensor names (after "blk.N.") -> HF names (after "model.layers.N."), as llama.cpp's Llama.
LLAMA_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def field_value(reader: GGUFFile, key: str) -> Any:
    return reader.field(key)


class GGUFMetadata:
    """The `<architecture>.*` keys of a GGUF file; get() of a key the file lacks is an error naming it."""

    def __init__(self, reader: GGUFFile, architecture: str) -> None:
        self.reader, self.architecture = reader, architecture

    def get(self, key: str, default: Any = ...) -> Any:
        value = field_value(self.reader, f"{self.architecture}.{key}")
        if value is None:
            if default is ...:
                raise ValueError(f"this {self.architecture} GGUF has no {self.architecture}.{key}")
            return default
        return value

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.reader.tensors)

    def tensor(self, name: str) -> np.ndarray | None:
        """The values of a float32 tensor that configures the model (rope_freqs); None if absent."""
        found = next((t for t in self.reader.tensors if t.name == name), None)
        if found is None:
            return None
        if found.tensor_type != GGMLQuantizationType.F32:
            raise ValueError(f"{name} must be stored as F32, this GGUF has {found.tensor_type.name}")
        return found.data.view(np.float32).reshape(-1)

    def vocab_size(self) -> int:
        return int(self.get("vocab_size", 0) or len(field_value(self.reader, "tokenizer.ggml.tokens")))


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]  # config.json `architectures`
    hf_model_types: tuple[str, ...]  # config.json `model_type`, where `architectures` is absent
    gguf_architecture: str | None  # GGUF `general.architecture`; None: not read from GGUF
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_from_gguf: Callable[[GGUFMetadata], ModelConfig] | None
    gguf_layer_names: dict[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    # llama.cpp permutes the rows of q/k of this architecture so its RoPE rotates adjacent pairs.
    gguf_permuted_qk: bool = False
    # HF checkpoints store norm weights w of x * (offset + w) (Gemma: 1); GGUF files store offset + w.
    hf_norm_offset: float = 0.0


def base_config_from_hf(cfg: HFConfig, **family_fields: Any) -> ModelConfig:
    heads = cfg.get("num_attention_heads")
    # A family with RoPE per layer type (Gemma 3) passes rope_theta / rope_scaling in family_fields.
    theta, scaling = cfg.rope() if "rope_theta" not in family_fields else (None, None)
    fields = dict(
        vocab_size=cfg.get("vocab_size"),
        hidden_size=cfg.get("hidden_size"),
        intermediate_size=cfg.get("intermediate_size"),
        num_layers=cfg.get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.raw.get("num_key_value_heads") or heads,  # transformers' rule: absent means MHA
        head_dim=cfg.head_dim(),
        rms_norm_eps=float(cfg.get("rms_norm_eps")),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        rope_scaling=scaling,
        family=cfg.family,
    )
    return ModelConfig(**{**fields, **family_fields})


def base_config_from_gguf(meta: GGUFMetadata, family: str, **family_fields: Any) -> ModelConfig:
    hidden, heads = int(meta.get("embedding_length")), int(meta.get("attention.head_count"))
    fields = dict(
        vocab_size=meta.vocab_size(),
        hidden_size=hidden,
        intermediate_size=int(meta.get("feed_forward_length")),
        num_layers=int(meta.get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("attention.head_count_kv", heads)),  # llama.cpp's rule: absent means MHA
        head_dim=int(meta.get("attention.key_length", 0) or meta.get("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),  # llama.cpp's default base
        max_position_embeddings=int(meta.get("context_length")),
        tie_word_embeddings=not meta.has_tensor("output.weight"),
        family=family,
    )
    return ModelConfig(**{**fields, **family_fields})


def gguf_rope_scaling(meta: GGUFMetadata) -> tuple[tuple[str, Any], ...] | None:
    """GGUF's rope.scaling.*: none or linear (llama3's factors come as the rope_freqs tensor instead)."""
    kind = meta.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF {meta.architecture}.rope.scaling.type {kind!r}; supported: none, linear")
    return (("factor", float(meta.get("rope.scaling.factor"))), ("rope_type", "linear"))
