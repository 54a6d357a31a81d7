"""The weights of a Llama-family model in the layout the forward pass uses.

Projections that read the same input are fused (q|k|v, gate|up) so each layer runs three big matrix
products instead of seven; the loaders hand over HF-layout tensors ([out_features, in_features]). A
matrix may be a QuantizedTensor (GGUF blocks, quantized.py): fused parts of one block type stay
quantized; parts of different types are dequantized (logged), since one product runs one block type.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, fields

import torch

from kvserve.model.quantized import QuantizedTensor

logger = logging.getLogger(__name__)
Weight = torch.Tensor | QuantizedTensor


def _stack_rows(parts: list[Weight], name: str) -> Weight:
    """The parts' rows stacked: quantized if they share a block type, else in float32."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
        return QuantizedTensor.cat(parts)
    if any(isinstance(p, QuantizedTensor) for p in parts):
        logger.warning("%s: fused parts of different block types, dequantized to float", name)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts], dim=0).contiguous()


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv_proj: Weight  # [(Hq + 2*Hkv) * D, hidden]
    o_proj: Weight
    mlp_norm: torch.Tensor
    gate_up_proj: Weight  # [2 * intermediate, hidden]
    down_proj: Weight


@dataclass
class ModelWeights:
    embed_tokens: Weight  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Weight  # the same object as embed_tokens when embeddings are tied

    @classmethod
    def from_hf_tensors(cls, tensors: dict[str, Weight], num_layers: int, tie_word_embeddings: bool) -> ModelWeights:
        """Fuse HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...)."""

        def take(name: str) -> Weight:
            if name not in tensors:
                raise ValueError(f"weights are missing tensor {name!r}")
            return tensors[name]

        layers = []
        for i in range(num_layers):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    qkv_proj=_stack_rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], p + "qkv_proj"),
                    o_proj=take(p + "self_attn.o_proj.weight"),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_proj=_stack_rows(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], p + "gate_up_proj"
                    ),
                    down_proj=take(p + "mlp.down_proj.weight"),
                )
            )
        embed = take("model.embed_tokens.weight")
        head = embed if tie_word_embeddings or "lm_head.weight" not in tensors else tensors["lm_head.weight"]
        return cls(embed_tokens=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=head)

    def to(self, dtype: torch.dtype, device: torch.device) -> ModelWeights:
        """Dense tensors cast and moved; quantized ones stay as they are (the kernels run on the CPU)."""

        def cast(t: Weight) -> Weight:
            if isinstance(t, QuantizedTensor):
                if device.type != "cpu":
                    raise ValueError(f"quantized weights run on the CPU only, not on {device}")
                return t
            return t.to(device=device, dtype=dtype).contiguous()

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

    def matrices(self) -> list[Weight]:
        """Every weight matrix, each once (a tied LM head is the embedding table)."""
        layers = [m for w in self.layers for m in (w.qkv_proj, w.o_proj, w.gate_up_proj, w.down_proj)]
        return list({id(m): m for m in [self.embed_tokens, *layers, self.lm_head]}.values())

    def quantization(self) -> str:
        """Which matrices are kept in GGUF blocks, e.g. "Q4_1 x 120, Q8_0 x 1" (fused matrices counted
        once), or "none"."""
        counts = Counter(m.qtype.name for m in self.matrices() if isinstance(m, QuantizedTensor))
        return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items())) or "none"
