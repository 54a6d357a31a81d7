"""The weights of a Llama-family model in the layout the forward pass uses.

Projections that read the same input are fused (q|k|v, gate|up) so each layer runs three big matrix
products instead of seven; the loaders hand over HF-layout tensors ([out_features, in_features]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [(Hq + 2*Hkv) * D, hidden]
    o_proj: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as embed_tokens when embeddings are tied

    @classmethod
    def from_hf_tensors(
        cls, tensors: dict[str, torch.Tensor], num_layers: int, tie_word_embeddings: bool
    ) -> ModelWeights:
        """Fuse HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...)."""

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"weights are missing tensor {name!r}")
            return tensors[name]

        layers = []
        for i in range(num_layers):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    qkv_proj=torch.cat(
                        [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")], dim=0
                    ).contiguous(),
                    o_proj=take(p + "self_attn.o_proj.weight"),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_proj=torch.cat(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
                    ).contiguous(),
                    down_proj=take(p + "mlp.down_proj.weight"),
                )
            )
        embed = take("model.embed_tokens.weight")
        head = embed if tie_word_embeddings or "lm_head.weight" not in tensors else tensors["lm_head.weight"]
        return cls(embed_tokens=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=head)

    def to(self, dtype: torch.dtype, device: torch.device) -> ModelWeights:
        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        embed = cast(self.embed_tokens)
        head = embed if self.lm_head is self.embed_tokens else cast(self.lm_head)
        return ModelWeights(
            embed_tokens=embed,
            layers=[
                LayerWeights(*(cast(getattr(layer, f)) for f in LayerWeights.__dataclass_fields__))
                for layer in self.layers
            ],
            final_norm=cast(self.final_norm),
            lm_head=head,
        )
