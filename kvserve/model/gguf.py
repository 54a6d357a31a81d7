"""Load a Llama-family GGUF file: dequantized tensors (HF names and layout), config and tokenizer data.

llama.cpp's converter permutes the rows of q_proj/k_proj so that RoPE rotates adjacent pairs; we undo
that so GGUF and HF checkpoints share one layout and one RoPE (rotate-half) implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from kvserve.model.config import ModelConfig
from kvserve.model.progress import progress

_LAYER_NAMES = {
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
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFTokenizerData:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    pre_tokenizer: str | None
    add_bos_token: bool
    chat_template: str | None


def _field_value(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


def architecture(reader: GGUFReader) -> str:
    return str(_field_value(reader, "general.architecture"))


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        return f"model.layers.{index}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: per head, rows (pair, half) -> (half, pair)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_config(reader: GGUFReader) -> ModelConfig:
    arch = _field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only the llama architecture is supported, this GGUF is {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        value = _field_value(reader, f"llama.{key}")
        return default if value is None else value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    scaling_type = get("rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = (("factor", float(get("rope.scaling.factor", 1.0))), ("type", str(scaling_type)))
    vocab = get("vocab_size") or len(_field_value(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        rope_scaling=rope_scaling,
    )


def read_tensors(reader: GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, under its HF name, in HF's [out, in] layout."""
    tensors: dict[str, torch.Tensor] = {}
    for tensor in progress(reader.tensors, "dequantizing weights", "tensor"):
        # GGUF lists dimensions innermost first; dequantize returns the row-major (numpy) shape.
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        name = _hf_name(tensor.name)
        if name.endswith("q_proj.weight"):
            array = _unpermute_rope_rows(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rope_rows(array, config.num_kv_heads)
        # dequantize may return a read-only view of the memory-mapped file; torch needs a writable array.
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=not array.flags.writeable))
    return tensors


def read_tokenizer_data(reader: GGUFReader) -> GGUFTokenizerData:
    model = _field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, got {model!r}")
    return GGUFTokenizerData(
        tokens=_field_value(reader, "tokenizer.ggml.tokens"),
        token_types=_field_value(reader, "tokenizer.ggml.token_type") or [],
        merges=_field_value(reader, "tokenizer.ggml.merges") or [],
        bos_token_id=_field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field_value(reader, "tokenizer.ggml.padding_token_id"),
        pre_tokenizer=_field_value(reader, "tokenizer.ggml.pre"),
        add_bos_token=bool(_field_value(reader, "tokenizer.ggml.add_bos_token") or False),
        chat_template=_field_value(reader, "tokenizer.chat_template"),
    )


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    return GGUFReader(str(path))
