"""The weights of a decoder model in the layout the forward pass uses.

Projections that read the same input are fused (q|k|v, gate|up) so each layer runs three big matrix
products instead of seven; the loaders hand over HF-named, HF-layout tensors ([out_features, in_features])
one at a time, and each is dropped from the loader's dict once fused, so at most one layer exists twice.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvserve.model.config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [(Hq + 2*Hkv) * D, hidden]
    o_proj: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2*Hkv) * D] (Qwen2)
    q_norm: torch.Tensor | None = None  # [D], per head (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # after attention, before the residual add (Gemma 3)
    post_mlp_norm: torch.Tensor | None = None  # after the MLP, before the residual add (Gemma 3)


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as embed_tokens when embeddings are tied

    @classmethod
    def from_hf_tensors(cls, tensors: dict[str, torch.Tensor], config: ModelConfig) -> ModelWeights:
        """Fuse HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...), emptying `tensors`."""

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"weights are missing tensor {name!r}")
            return tensors.pop(name)

        def fuse(names: list[str]) -> torch.Tensor:
            return torch.cat([take(n) for n in names], dim=0).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{n}_proj." for n in ("q", "k", "v")]
            # Gemma names its MLP's input norm pre_feedforward_layernorm; its post_attention_layernorm
            # is the norm after attention. Llama's post_attention_layernorm is the MLP's input norm.
            mlp_norm = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
            layer = LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"),
                qkv_proj=fuse([n + "weight" for n in qkv]),
                o_proj=take(p + "self_attn.o_proj.weight"),
                mlp_norm=take(p + mlp_norm + ".weight"),
                gate_up_proj=fuse([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down_proj=take(p + "mlp.down_proj.weight"),
            )
            if config.attention_bias:
                layer.qkv_bias = fuse([n + "bias" for n in qkv])
            if config.qk_norm:
                layer.q_norm, layer.k_norm = take(p + "self_attn.q_norm.weight"), take(p + "self_attn.k_norm.weight")
            if config.sandwich_norms:
                layer.post_attn_norm = take(p + "post_attention_layernorm.weight")
                layer.post_mlp_norm = take(p + "post_feedforward_layernorm.weight")
            layers.append(layer)
        embed = take("model.embed_tokens.weight")
        head = tensors.pop("lm_head.weight", None)
        if config.tie_word_embeddings or head is None:
            head = embed
        final_norm = take("model.norm.weight")
        if tensors:
            raise ValueError(f"unexpected tensors for a {config.family} model: {sorted(tensors)[:5]}")
        return cls(embed_tokens=embed, layers=layers, final_norm=final_norm, lm_head=head)

    def to(self, dtype: torch.dtype, device: torch.device) -> ModelWeights:
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
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
