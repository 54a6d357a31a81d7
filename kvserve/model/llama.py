"""The decoder forward pass of every family (the Llama layer, plus what a family's config adds: q/k/v
bias, q/k head norms, norms after attention and MLP, tanh-GELU, scaled embeddings, per-layer sliding
windows and RoPE bases) over a packed batch of variable-length spans (no padding).

Each call processes T new tokens belonging to several sequences at once. K/V of the new tokens are
written into the paged cache through `slot_mapping` before attention runs, so attention sees each
sequence's cached prefix and its new tokens through one interface (see kernels/metadata.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.kernels.metadata import AttentionFn, AttentionMetadata
from kvserve.model.compiled_decode import CompiledDecodeStep, projection_weights
from kvserve.model.config import FULL, ModelConfig
from kvserve.model.huge_pages import move_into_one_buffer
from kvserve.model.layer_ops import layer_ops_for
from kvserve.model.linear import (
    AMX_MAX_ROWS,
    AMX_ROW_BLOCK,
    GatedAfterProduct,
    KernelLinear,
    LinearFn,
    make_gated_up,
    make_linear,
)
from kvserve.model.progress import progress
from kvserve.model.quantized import block_parts
from kvserve.model.quantized_linear import make_embedding
from kvserve.model.rope import rope_tables
from kvserve.model.weights import LayerWeights, ModelWeights


class LayerLinears(NamedTuple):
    qkv_proj: LinearFn
    o_proj: LinearFn
    gated_up: LinearFn  # act(x @ gate^T) * (x @ up^T), from gate_up_proj
    down_proj: LinearFn


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.weights = weights.to(dtype, device)
        self.ops = layer_ops_for(device)
        self.linears = [
            LayerLinears(
                qkv_proj=make_linear(layer.qkv_proj),
                o_proj=make_linear(layer.o_proj),
                gated_up=self._gated_up(layer),
                down_proj=make_linear(layer.down_proj),
            )
            for layer in progress(self.weights.layers, "packing weights", "layer")
        ]
        self.lm_head = make_linear(self.weights.lm_head, large_rows=False)  # one row per sampled token
        self.embed = make_embedding(self.weights.embed_tokens)
        self.quantized = any(block_parts(m) for m in self.weights.matrices())
        if device.type == "cpu":
            self._stream_from_huge_pages()
        # The residual stream and the norms stay in float32 whatever the weights' dtype: summing 30
        # layers' updates in bf16 loses enough precision to flip greedy choices early on this model.
        self.norms = [(layer.attn_norm.float(), layer.mlp_norm.float()) for layer in self.weights.layers]
        self.final_norm = self.weights.final_norm.float()
        self.layer_extras = [self._extras(layer) for layer in self.weights.layers]
        self.rope_cos, self.rope_sin = rope_tables(config, max_len, device)  # the full-attention layers'
        types = {config.layer_type(i) for i in range(config.num_layers)}
        tables = {kind: rope_tables(config, max_len, device, kind) for kind in types - {FULL}}
        tables[FULL] = (self.rope_cos, self.rope_sin)
        self.layer_rope = [tables[config.layer_type(i)] for i in range(config.num_layers)]
        self.layer_windows = [config.layer_window(i) for i in range(config.num_layers)]
        self.embedding_scale = config.embedding_scale
        self.scale = config.softmax_scale
        # One C++ call for a step of decode rows where the kernels run this model (compiled_decode.py).
        self.compiled_decode = CompiledDecodeStep.for_model(self)
        # Where every product, the LM head's too, runs on linear_amx, a step of AMX_ROW_BLOCK to AMX_MAX_ROWS
        # rows pays for a partial last row tile as for a whole one (the scheduler's row_block; under
        # AMX_ROW_BLOCK rows the last tile costs only its rows: amx_product.cpp's row_tile).
        products = [p for layer in self.linears for p in layer] + [self.lm_head]
        self.tiled = all(isinstance(p, KernelLinear) and p.amx for p in products)
        self.q_size = config.num_heads * config.head_dim

    def row_block(self, max_rows: int) -> int | None:
        """The row multiple a decode-only step of up to `max_rows` rows should be cut to (the scheduler's
        row_block): AMX_ROW_BLOCK where its products run on linear_amx, None where cost follows the rows."""
        return AMX_ROW_BLOCK if self.tiled and max_rows <= AMX_MAX_ROWS else None

    def _gated_up(self, layer: LayerWeights) -> LinearFn:
        if self.config.activation == "silu":
            return make_gated_up(layer.gate_up_proj, self.ops.silu_mul)
        return GatedAfterProduct(make_linear(layer.gate_up_proj), self.ops.gelu_tanh_mul)

    def _extras(self, layer: LayerWeights) -> dict[str, torch.Tensor]:
        """A layer's tensors beyond the Llama layer's (biases and norms in float32, like the others)."""
        names = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
        extras = {name: getattr(layer, name) for name in names if getattr(layer, name) is not None}
        return {name: t if name == "qkv_bias" else t.float() for name, t in extras.items()}

    def _stream_from_huge_pages(self) -> None:
        """The projection weights (what the GEMV reads: dense ones in one buffer, GGUF blocks in another)
        and their packed tiles (what linear_amx or linear_tiles_fma reads), each in one buffer on huge pages,
        in the order a decode step streams them (huge_pages.py)."""
        streamed = [w for layer in self.weights.layers for w in projection_weights(layer)] + [self.weights.lm_head]
        move_into_one_buffer(w for w in streamed if isinstance(w, torch.Tensor))
        move_into_one_buffer(part.blocks for w in streamed for part in block_parts(w))
        products = [p for layer in self.linears for p in layer] + [self.lm_head]
        move_into_one_buffer(p.tiles for p in products if isinstance(p, KernelLinear) and p.tiles is not None)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # int64 [T]: block_id * block_size + offset for each new token
        meta: AttentionMetadata,
        attention: AttentionFn,
        num_layers: int | None = None,
        compiled_decode: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]. `num_layers` < all runs a truncated (self-draft) model.
        `compiled_decode`: `attention` sends every row of this step to the compiled CPU decode kernel
        (AttentionBackend.decode_kernel_takes_every_row), so a step of at most the compiled step's max_rows
        may run as one compiled call (compiled_decode.py)."""
        cfg, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        layers = list(zip(self.linears, self.norms, strict=True))[:num_layers]
        t = input_ids.shape[0]
        # h, the float32 residual stream, is updated in place by add_rms_norm, which also normalizes
        # it for the next block: each layer's two residual adds are fused into the following norm.
        h = self.embed(input_ids)
        if self.embedding_scale is not None:
            h.mul_(torch.tensor(self.embedding_scale, dtype=torch.float32))
        step = self.compiled_decode
        if compiled_decode and step is not None and t <= step.max_rows:
            return step.run(h, positions, kv_cache, slot_mapping, meta, len(layers))
        x = ops.add_rms_norm(h, None, layers[0][1][0], eps, self.dtype)
        k_caches, v_caches = (kind.unbind(0) for kind in kv_cache.unbind(1))  # per-layer views, 3 calls
        for index, (linear, (_, mlp_norm)) in enumerate(layers):
            extras = self.layer_extras[index]
            qkv = linear.qkv_proj(x)
            if "qkv_bias" in extras:
                qkv.add_(extras["qkv_bias"])
            if "q_norm" in extras:
                ops.head_rms_norm(qkv, cfg.num_heads, cfg.num_kv_heads, extras["q_norm"], extras["k_norm"], eps)
            k_cache, v_cache = k_caches[index], v_caches[index]
            cos, sin = self.layer_rope[index]
            ops.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, cfg.num_heads, cfg.num_kv_heads)
            q = qkv[:, : self.q_size].view(t, cfg.num_heads, cfg.head_dim)
            window = self.layer_windows[index]
            if window is None:
                o = attention(q, k_cache, v_cache, meta, self.scale)
            else:
                o = attention(q, k_cache, v_cache, meta, self.scale, window=window)
            o = linear.o_proj(o.reshape(t, self.q_size))
            x = ops.add_rms_norm(h, o, mlp_norm, eps, self.dtype, extras.get("post_attn_norm"))
            next_norm = layers[index + 1][1][0] if index + 1 < len(layers) else self.final_norm
            mlp = linear.down_proj(linear.gated_up(x))
            x = ops.add_rms_norm(h, mlp, next_norm, eps, self.dtype, extras.get("post_mlp_norm"))
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the given rows only (callers select the rows they sample from), in the model dtype:
        the LM head's own output, which the sampler widens to float32 only where it computes with it
        (a greedy step reads the bf16 rows as they are; widening them would cost a copy every step)."""
        return self.lm_head(hidden)
