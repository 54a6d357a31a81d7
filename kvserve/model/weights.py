"""The weights of a decoder model in the layout the forward pass uses.

Projections that read the same input are fused (q|k|v, gate|up) so each layer runs three big matrix
products instead of seven; the loaders hand over HF-named, HF-layout tensors ([out_features, in_features])
one at a time, and each is dropped from the loader's dict once fused, so at most one layer exists twice.
A matrix may be kept in GGUF blocks (quantized.py): fused parts of one block type are one QuantizedTensor;
parts of different types a StackedQuantizedTensor, whose product runs part by part.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.quantized import Quantized, QuantizedTensor, StackedQuantizedTensor, block_parts, stack_rows

logger = logging.getLogger(__name__)
Weight = torch.Tensor | Quantized


def _interleaved(weight: Weight) -> Weight:
    """A projection in the layout its products read fastest: blocks in row groups where their type has
    them (quantized.py), each part of a stacked one on its own; dense tensors as they are."""
    if isinstance(weight, QuantizedTensor):
        return weight.interleaved()
    if isinstance(weight, StackedQuantizedTensor):
        return StackedQuantizedTensor(tuple(part.interleaved() for part in weight.parts))
    return weight


def _stack_rows(parts: list[Weight], name: str) -> Weight:
    """The parts' rows stacked: kept in blocks if every part is (in row groups where they can be), else
    dense (in the dense parts' dtype)."""
    quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
    if len(quantized) == len(parts):
        return _interleaved(stack_rows(quantized))
    if quantized:
        logger.warning("%s: fused parts of which only some are in blocks, dequantized", name)
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    dense = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
    return torch.cat([d.to(dtype) for d in dense], dim=0).contiguous()


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv_proj: Weight  # [(Hq + 2*Hkv) * D, hidden]
    o_proj: Weight
    mlp_norm: torch.Tensor
    gate_up_proj: Weight  # [2 * intermediate, hidden]
    down_proj: Weight
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2*Hkv) * D] (Qwen2)
    q_norm: torch.Tensor | None = None  # [D], per head (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # after attention, before the residual add (Gemma 3)
    post_mlp_norm: torch.Tensor | None = None  # after the MLP, before the residual add (Gemma 3)


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor | QuantizedTensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Weight  # the same object as embed_tokens when embeddings are tied

    @classmethod
    def from_hf_tensors(cls, tensors: dict[str, Weight], config: ModelConfig) -> ModelWeights:
        """Fuse HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...), emptying `tensors`."""

        def take(name: str) -> Weight:
            if name not in tensors:
                raise ValueError(f"weights are missing tensor {name!r}")
            return tensors.pop(name)

        def dense(name: str) -> torch.Tensor:
            """A vector (norm, bias): GGUF keeps only matrices in blocks, so this never dequantizes a file's."""
            weight = take(name)
            return weight if isinstance(weight, torch.Tensor) else weight.dequantize()

        def fuse(names: list[str]) -> torch.Tensor:
            return torch.cat([dense(n) for n in names], dim=0).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{n}_proj." for n in ("q", "k", "v")]
            # Gemma names its MLP's input norm pre_feedforward_layernorm; its post_attention_layernorm
            # is the norm after attention. Llama's post_attention_layernorm is the MLP's input norm.
            mlp_norm = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
            layer = LayerWeights(
                attn_norm=dense(p + "input_layernorm.weight"),
                qkv_proj=_stack_rows([take(n + "weight") for n in qkv], p + "qkv_proj"),
                o_proj=_interleaved(take(p + "self_attn.o_proj.weight")),
                mlp_norm=dense(p + mlp_norm + ".weight"),
                gate_up_proj=_stack_rows(
                    [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], p + "gate_up_proj"
                ),
                down_proj=_interleaved(take(p + "mlp.down_proj.weight")),
            )
            if config.attention_bias:
                layer.qkv_bias = fuse([n + "bias" for n in qkv])
            if config.qk_norm:
                layer.q_norm, layer.k_norm = dense(p + "self_attn.q_norm.weight"), dense(p + "self_attn.k_norm.weight")
            if config.sandwich_norms:
                layer.post_attn_norm = dense(p + "post_attention_layernorm.weight")
                layer.post_mlp_norm = dense(p + "post_feedforward_layernorm.weight")
            layers.append(layer)
        embed = _interleaved(take("model.embed_tokens.weight"))  # its gather reads either layout
        assert not isinstance(embed, StackedQuantizedTensor)  # only fused projections are stacked
        head = tensors.pop("lm_head.weight", None)
        head = embed if config.tie_word_embeddings or head is None else _interleaved(head)
        final_norm = dense("model.norm.weight")
        if tensors:
            raise ValueError(f"unexpected tensors for a {config.family} model: {sorted(tensors)[:5]}")
        return cls(embed_tokens=embed, layers=layers, final_norm=final_norm, lm_head=head)

    def to(self, dtype: torch.dtype, device: torch.device) -> ModelWeights:
        """Dense tensors cast and moved; quantized ones stay as they are (the kernels run on the CPU)."""

        def cast(t: Any) -> Any:  # a weight, or an optional one (None); LayerWeights' fields mix both
            if isinstance(t, QuantizedTensor | StackedQuantizedTensor):
                if device.type != "cpu":
                    raise ValueError(f"quantized weights run on the CPU only, not on {device}")
                return t
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        embed = cast(self.embed_tokens)
        head = embed if self.lm_head is self.embed_tokens else cast(self.lm_head)
        return ModelWeights(
            embed_tokens=embed,
            layers=[
                LayerWeights(*(cast(getattr(layer, f.name)) for f in fields(LayerWeights))) for layer in self.layers
            ],
            final_norm=cast(self.final_norm),
            lm_head=head,
        )

    def tensors(self) -> list[Weight]:
        """Every tensor the model holds, each once (a tied LM head is the embedding table)."""
        layer_tensors = [getattr(layer, f.name) for layer in self.layers for f in fields(layer)]
        held = [self.embed_tokens, *(t for t in layer_tensors if t is not None), self.final_norm, self.lm_head]
        return list({id(t): t for t in held}.values())

    def matrices(self) -> list[Weight]:
        """Every weight matrix, each once (a tied LM head is the embedding table)."""
        layers = [m for w in self.layers for m in (w.qkv_proj, w.o_proj, w.gate_up_proj, w.down_proj)]
        return list({id(m): m for m in [self.embed_tokens, *layers, self.lm_head]}.values())

    def quantization(self) -> str:
        """Which matrices are kept in GGUF blocks, e.g. "Q4_1 x 120, Q8_0 x 1" (a fused matrix counted
        once, or once per part where its parts differ in block type), or "none"."""
        counts = Counter(part.qtype.name for m in self.matrices() for part in block_parts(m))
        return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items())) or "none"
