"""The decoder forward pass of every family (the Llama layer, plus what a family's config adds: q/k/v
bias, q/k head norms, norms after attention and MLP, tanh-GELU, scaled embeddings, per-layer sliding
windows and RoPE bases) over a packed batch of variable-length spans (no padding).

Each call processes T new tokens belonging to several sequences at once. K/V of the new tokens are
written into the paged cache through `slot_mapping` before attention runs, so attention sees each
sequence's cached prefix and its new tokens through one interface (see kernels/metadata.py).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from kvserve.kernels.attention import DECODE_MAX_QUERY_LEN
from kvserve.kernels.metadata import AttentionFn, AttentionMetadata
from kvserve.model.config import FULL, ModelConfig
from kvserve.model.huge_pages import move_into_one_buffer
from kvserve.model.layer_ops import gelu_tanh_mul, head_rms_norm, layer_ops_for, rms_norm
from kvserve.model.linear import (
    AMX_MAX_ROWS,
    AMX_ROW_BLOCK,
    KernelLinear,
    LinearFn,
    gemv_kernels,
    make_gated_up,
    make_linear,
)
from kvserve.model.progress import progress
from kvserve.model.quantized import QuantizedTensor
from kvserve.model.quantized_linear import QuantizedLinear, make_embedding, quantized_kernels
from kvserve.model.rope import rope_tables
from kvserve.model.weights import LayerWeights, ModelWeights, Weight

logger = logging.getLogger(__name__)


def projection_weights(layer: LayerWeights) -> tuple[Weight, ...]:
    """A layer's four projections in the order a step runs them (and decode_layers takes them)."""
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


class LayerLinears(NamedTuple):
    qkv_proj: LinearFn
    o_proj: LinearFn
    gated_up: LinearFn  # act(x @ gate^T) * (x @ up^T), from gate_up_proj
    down_proj: LinearFn


# (q, k_cache, v_cache, meta, scale, window=None): window, where given, is how many keys (its own
# included) a query sees; every backend in kernels/backends.py takes it.


def torch_path_reasons(config: ModelConfig) -> list[str]:
    """Why the compiled decode step (kernels/cpu/decode_layers.cpp: the plain Llama layer) cannot run
    this model; empty where it can."""
    reasons = [
        "its q/k/v projections have a bias" if config.attention_bias else "",
        "it normalizes q and k heads" if config.qk_norm else "",
        "it has norms after attention and MLP" if config.sandwich_norms else "",
        f"its MLP gates with {config.activation}" if config.activation != "silu" else "",
        "its layers use different RoPE bases" if config.sliding_rope_theta is not None else "",
    ]
    return [r for r in reasons if r]


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
        self.quantized = any(isinstance(m, QuantizedTensor) for m in self.weights.matrices())
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
        self.decode_windows = [window or 0 for window in self.layer_windows]  # decode_layers' 0: no window
        self.embedding_scale = config.embedding_scale
        # The compiled decode step (kernels/cpu/decode_layers.cpp) runs the plain Llama layer and needs
        # every linear to be a bf16 KernelLinear, or every linear a QuantizedLinear (any dtype); it takes
        # each layer's tensors in this order (a quantized one as its blocks, with the block types), and
        # their AMX tiles where every projection has them. It then takes up to AMX_MAX_ROWS rows
        # (quant_linear takes any number; the one limit keeps the step's cost model), else the GEMV's few.
        reasons = torch_path_reasons(config)
        projections = [(lin.qkv_proj, lin.o_proj, lin.gated_up, lin.down_proj) for lin in self.linears]
        all_quantized = all(isinstance(p, QuantizedLinear) for layer in projections for p in layer)
        self.decode_kernels = None
        if device.type == "cpu" and not reasons and all_quantized:
            self.decode_kernels = quantized_kernels()
        elif device.type == "cpu" and not reasons and dtype == torch.bfloat16 and not self.quantized:
            self.decode_kernels = gemv_kernels()
        if reasons and dtype == torch.bfloat16 and device.type == "cpu" and gemv_kernels() is not None:
            logger.warning("%s decode steps run on torch ops because %s", config.family, "; ".join(reasons))
        self.decode_layer_tensors = [
            (*(w.blocks if isinstance(w, QuantizedTensor) else w for w in projection_weights(layer)), *norms)
            for layer, norms in zip(self.weights.layers, self.norms, strict=True)
        ]
        self.decode_block_types = [
            int(p.weight.qtype) for layer in projections for p in layer if isinstance(p, QuantizedLinear)
        ]
        tiles = [[p.tiles if isinstance(p, KernelLinear) else None for p in layer] for layer in projections]
        all_tiled = all(t is not None for layer in tiles for t in layer)
        self.decode_layer_tiles = tiles if all_tiled else None
        self.compiled_decode_max_rows = (
            0
            if self.decode_kernels is None
            else AMX_MAX_ROWS
            if all_tiled or all_quantized
            else self.decode_kernels.GEMV_MAX_ROWS
        )
        # Steps of 3 to AMX_MAX_ROWS rows pay for their rows in whole blocks of this many where every product,
        # the LM head's too, runs on linear_amx (the scheduler's row_block); None where the cost follows the rows.
        lm_head_tiled = isinstance(self.lm_head, KernelLinear) and self.lm_head.tiles is not None
        self.product_row_block = AMX_ROW_BLOCK if all_tiled and lm_head_tiled else None
        self.scale = config.softmax_scale
        self.q_size = config.num_heads * config.head_dim

    def _gated_up(self, layer: LayerWeights) -> LinearFn:
        if self.config.activation == "silu":
            return make_gated_up(layer.gate_up_proj, self.ops.silu_mul)
        gate_up = make_linear(layer.gate_up_proj)
        return lambda x: gelu_tanh_mul(gate_up(x))

    def _extras(self, layer: LayerWeights) -> dict[str, torch.Tensor]:
        """A layer's tensors beyond the Llama layer's (biases and norms in float32, like the others)."""
        names = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
        extras = {name: getattr(layer, name) for name in names if getattr(layer, name) is not None}
        return {name: t if name == "qkv_bias" else t.float() for name, t in extras.items()}

    def _stream_from_huge_pages(self) -> None:
        """The projection weights (what the GEMV reads: dense ones in one buffer, GGUF blocks in another)
        and their AMX tiles (what linear_amx reads), each in one buffer on huge pages, in the order a
        decode step streams them (huge_pages.py)."""
        streamed = [w for layer in self.weights.layers for w in projection_weights(layer)] + [self.weights.lm_head]
        move_into_one_buffer(w for w in streamed if not isinstance(w, QuantizedTensor))
        move_into_one_buffer(w.blocks for w in streamed if isinstance(w, QuantizedTensor))
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
        `compiled_decode`: `attention` is the CPU decode kernel's backend, so a step of at most
        compiled_decode_max_rows tokens where every sequence is a decode row may run as one compiled call."""
        cfg, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        layers = list(zip(self.linears, self.norms, strict=True))[:num_layers]
        t = input_ids.shape[0]
        # h, the float32 residual stream, is updated in place by add_rms_norm, which also normalizes
        # it for the next block: each layer's two residual adds are fused into the following norm.
        h = self.embed(input_ids)
        if self.embedding_scale is not None:
            h.mul_(torch.tensor(self.embedding_scale, dtype=torch.float32))
        kernels = self.decode_kernels
        if (
            compiled_decode
            and kernels is not None
            and t <= self.compiled_decode_max_rows
            and max(meta.query_lens_host) <= DECODE_MAX_QUERY_LEN  # every row on the decode kernel
        ):
            tiles = [] if self.decode_layer_tiles is None else self.decode_layer_tiles[: len(layers)]
            return kernels.decode_layers(
                h, [tensor for group in self.decode_layer_tensors[: len(layers)] for tensor in group],
                [tensor for group in tiles for tensor in group], self.decode_block_types[: 4 * len(layers)],
                self.final_norm, eps, positions, self.rope_cos, self.rope_sin, kv_cache, slot_mapping,
                meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, torch.arange(meta.num_seqs), self.scale,
                cfg.num_heads, cfg.num_kv_heads, self.decode_windows[: len(layers)],
            )  # fmt: skip
        x = ops.add_rms_norm(h, None, layers[0][1][0], eps, self.dtype)
        k_caches, v_caches = (kind.unbind(0) for kind in kv_cache.unbind(1))  # per-layer views, 3 calls
        for index, (linear, (_, mlp_norm)) in enumerate(layers):
            extras = self.layer_extras[index]
            qkv = linear.qkv_proj(x)
            if "qkv_bias" in extras:
                qkv.add_(extras["qkv_bias"])
            if "q_norm" in extras:
                heads = qkv[:, : self.q_size + cfg.num_kv_heads * cfg.head_dim].view(t, -1, cfg.head_dim)
                head_rms_norm(heads, cfg.num_heads, extras["q_norm"], extras["k_norm"], eps)
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
            if "post_attn_norm" in extras:
                o = rms_norm(o, extras["post_attn_norm"], eps)
            x = ops.add_rms_norm(h, o, mlp_norm, eps, self.dtype)
            next_norm = layers[index + 1][1][0] if index + 1 < len(layers) else self.final_norm
            mlp = linear.down_proj(linear.gated_up(x))
            if "post_mlp_norm" in extras:
                mlp = rms_norm(mlp, extras["post_mlp_norm"], eps)
            x = ops.add_rms_norm(h, mlp, next_norm, eps, self.dtype)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the given rows only (callers select the rows they sample from), in the model dtype:
        the LM head's own output, which the sampler widens to float32 only where it computes with it
        (a greedy step reads the bf16 rows as they are; widening them would cost a copy every step)."""
        return self.lm_head(hidden)
