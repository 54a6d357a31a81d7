"""Load a GGUF file: its family's config, its tensors one at a time under HF names and in HF layout,
and its tokenizer data.

Tensors are cast or dequantized to the serving dtype, except, with `keep_quantized`, matrices of a block
type kvserve's quantized kernels multiply (quantized.py's KERNEL_TYPES), which stay in their GGUF blocks.

llama.cpp's converter permutes the rows of q_proj/k_proj of Llama models so that RoPE rotates adjacent
pairs; we undo that so GGUF and HF checkpoints share one layout and one RoPE (rotate-half) implementation.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.model.config import ModelConfig
from kvserve.model.families import family_for_gguf
from kvserve.model.families.family import Family, GGUFMetadata, field_value
from kvserve.model.gguf_file import GGUFFile, GGUFTensor, open_gguf_file
from kvserve.model.progress import progress
from kvserve.model.quantized import KERNEL_TYPES, QuantizedTensor

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that configure rather than weigh (read by the family's config): not model weights.
_CONFIG_TENSORS = {"rope_freqs.weight"}
# Tensors are read from the file this many elements at a time (whole rows), each slice dequantized (to
# float32) and cast into the serving dtype, or copied as blocks, before the next: no whole float32 copy of
# a large tensor (Gemma's 262k x 640 embedding) exists, nor all of its file pages at once (row_chunks).
_CHUNK_ELEMENTS = 1 << 22
# Tensor types whose rows torch reads from the file as they are (then casts); the rest are dequantized.
_PLAIN_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16}
if hasattr(GGMLQuantizationType, "BF16"):
    _PLAIN_TYPES[GGMLQuantizationType.BF16] = torch.bfloat16


@dataclass
class GGUFTokenizerData:
    architecture: str  # general.architecture
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unknown_token_id: int | None
    pre_tokenizer: str | None
    add_bos_token: bool
    add_space_prefix: bool
    chat_template: str | None


def gguf_family(reader: GGUFFile) -> Family:
    return family_for_gguf(field_value(reader, "general.architecture"))


def architecture(reader: GGUFFile) -> str:
    return str(field_value(reader, "general.architecture"))


def read_config(reader: GGUFFile) -> ModelConfig:
    family = gguf_family(reader)
    if family.config_from_gguf is None or family.gguf_architecture is None:
        raise ValueError(f"{family.name} models are not read from GGUF files")
    return family.config_from_gguf(GGUFMetadata(reader, family.gguf_architecture))


def _hf_name(gguf_name: str, family: Family) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if part not in family.gguf_layer_names:
            raise ValueError(f"unexpected tensor {gguf_name!r} in a {family.name} GGUF")
        return f"model.layers.{index}.{family.gguf_layer_names[part]}.{suffix}"
    if stem not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a {family.name} GGUF")
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows (pair, half) -> (half, pair)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _to_dtype(
    reader: GGUFFile, tensor: GGUFTensor, dtype: torch.dtype, chunk_elements: int = _CHUNK_ELEMENTS
) -> torch.Tensor:
    """One GGUF tensor in `dtype`, in the row-major (numpy) shape, read through the file's mmap a slice of
    rows at a time. Each element is the same as that of dequantizing (or reading) the whole tensor, then
    casting: both steps are elementwise."""
    out = torch.empty(tensor.shape, dtype=dtype)
    flat = out.view(tensor.data.shape[0], -1)
    plain = _PLAIN_TYPES.get(tensor.tensor_type)
    for start, rows in reader.row_chunks(tensor, chunk_elements):
        if plain is not None:
            # The mmapped bytes are read-only: torch only reads them, the assignment below copies them.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                piece = torch.frombuffer(rows.data.cast("B"), dtype=plain)
        else:
            values = dequantize(rows, tensor.tensor_type).astype(np.float32, copy=False)
            piece = torch.from_numpy(np.ascontiguousarray(values))
        flat[start : start + len(rows)] = piece.view(len(rows), -1)
    return out


def _blocks(reader: GGUFFile, tensor: GGUFTensor, chunk_elements: int = _CHUNK_ELEMENTS) -> torch.Tensor:
    """A GGUF tensor's bytes copied out of the mapped file, uint8 [rows, bytes per row]."""
    out = np.empty(tensor.data.shape, dtype=np.uint8)
    for start, rows in reader.row_chunks(tensor, chunk_elements):
        out[start : start + len(rows)] = rows
    return torch.from_numpy(out)


def iter_tensors(
    reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Every weight under its HF name, in HF's [out, in] layout, in `dtype`, one at a time; with
    `keep_quantized`, a matrix of one of KERNEL_TYPES comes as a QuantizedTensor holding its GGUF blocks
    (the others of a quantized type are dequantized, and one log line names them)."""
    family = gguf_family(reader)
    dequantized: list[str] = []
    for tensor in progress(reader.tensors, "loading weights", "tensor"):
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = _hf_name(tensor.name, family)
        heads = None
        if family.gguf_permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif family.gguf_permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        weight: torch.Tensor | QuantizedTensor
        if keep_quantized and tensor.tensor_type in KERNEL_TYPES and len(tensor.shape) == 2:
            weight = QuantizedTensor(_blocks(reader, tensor), tensor.tensor_type, (tensor.shape[0], tensor.shape[1]))
            if heads is not None:
                weight = weight.rows(_unpermute_rope_rows(torch.arange(tensor.shape[0]), heads))
        else:
            if keep_quantized and tensor.tensor_type not in _PLAIN_TYPES:
                dequantized.append(f"{tensor.name} ({tensor.tensor_type.name})")
            weight = _to_dtype(reader, tensor, dtype)
            if heads is not None:
                weight = _unpermute_rope_rows(weight, heads)
        yield name, weight
    if dequantized:
        logger.warning("no quantized kernel for these GGUF tensors, dequantized: %s", ", ".join(dequantized))


def read_tokenizer_data(reader: GGUFFile) -> GGUFTokenizerData:
    model = field_value(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"unsupported GGUF tokenizer {model!r}; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
        )
    add_bos = field_value(reader, "tokenizer.ggml.add_bos_token")
    add_prefix = field_value(reader, "tokenizer.ggml.add_space_prefix")
    return GGUFTokenizerData(
        architecture=field_value(reader, "general.architecture"),
        model=model,
        tokens=field_value(reader, "tokenizer.ggml.tokens"),
        token_types=field_value(reader, "tokenizer.ggml.token_type") or [],
        scores=field_value(reader, "tokenizer.ggml.scores") or [],
        merges=field_value(reader, "tokenizer.ggml.merges") or [],
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field_value(reader, "tokenizer.ggml.padding_token_id"),
        unknown_token_id=field_value(reader, "tokenizer.ggml.unknown_token_id"),
        pre_tokenizer=field_value(reader, "tokenizer.ggml.pre"),
        # llama.cpp's defaults where the file is silent: BOS added for SentencePiece vocabularies only.
        add_bos_token=bool(add_bos) if add_bos is not None else model == "llama",
        add_space_prefix=bool(add_prefix) if add_prefix is not None else model == "llama",
        chat_template=field_value(reader, "tokenizer.chat_template"),
    )


def open_gguf(path: Path) -> GGUFFile:
    return open_gguf_file(path)
