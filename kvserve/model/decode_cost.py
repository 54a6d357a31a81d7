"""What decoding costs a model at the least, counted from its loaded weights: the bytes a decode step
reads from memory and the floating-point operations a token computes. These are the numerators of the
roofs benchmarks/cpu_performance.py measures its rows against: a step takes at least its bytes over the
machine's stream bandwidth, and at least its FLOPs over the machine's GEMM rate.

Lower bounds, not a kernel's traffic: each weight tensor is counted once per step at its stored size (a
quantized matrix's blocks), though a kernel may read a packed or widened copy; the K/V a step reads is
each sequence's cached tokens once per layer; writes (the new K/V, activations) are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from kvserve.model.compiled_decode import projection_weights
from kvserve.model.config import ModelConfig
from kvserve.model.weights import ModelWeights, Weight


def stored_bytes(weight: Weight) -> int:
    """A tensor's size as the model holds it: a quantized matrix's blocks, a dense tensor's elements."""
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.nbytes


def _matrix_params(weight: Weight) -> int:
    """The multiplications one token makes with this matrix (its logical N x K, whatever its storage)."""
    n, k = weight.shape
    return n * k


@dataclass(frozen=True)
class DecodeCost:
    """Per-step and per-token costs of one model at one dtype and quantization (`of`)."""

    config: ModelConfig
    # Read once by every step whatever its rows: every tensor of every layer (the norms, which the model
    # reads as float32 copies, at their stored size: a vector per layer), the final norm and the LM head.
    # The embedding table is not: a step reads one row of it per token.
    weight_bytes: int
    embedding_row_bytes: int
    kv_token_bytes: int  # one cached token's K and V in one layer
    layer_params: int  # the projections' weights one token multiplies, all layers
    lm_head_params: int

    @classmethod
    def of(cls, weights: ModelWeights, config: ModelConfig, kv_dtype: torch.dtype) -> DecodeCost:
        """The costs of a model holding `weights` (as LlamaModel holds them: cast to the model dtype,
        quantized ones in their blocks) with a K/V cache of `kv_dtype`."""
        layer_tensors = [getattr(layer, f.name) for layer in weights.layers for f in fields(layer)]
        layer_bytes = sum(stored_bytes(t) for t in layer_tensors if t is not None)
        table = weights.embed_tokens
        matrices = [m for layer in weights.layers for m in projection_weights(layer)]
        element = torch.empty((), dtype=kv_dtype).element_size()
        return cls(
            config=config,
            weight_bytes=layer_bytes + stored_bytes(weights.final_norm) + stored_bytes(weights.lm_head),
            embedding_row_bytes=stored_bytes(table) // table.shape[0],
            kv_token_bytes=2 * config.num_kv_heads * config.head_dim * element,
            layer_params=sum(_matrix_params(m) for m in matrices),
            lm_head_params=_matrix_params(weights.lm_head),
        )

    def attended_keys(self, context_len: int) -> int:
        """Keys a token at `context_len` (its own included) attends to, summed over the layers: all of them
        in a full-attention layer, at most the window in a sliding one."""
        windows = (self.config.layer_window(i) for i in range(self.config.num_layers))
        return sum(context_len if window is None else min(window, context_len) for window in windows)

    def step_bytes(self, context_lens: Sequence[int]) -> int:
        """Bytes a decode step reads whose rows are one new token of each sequence, at these context
        lengths (each the sequence's tokens after the step, the new one included)."""
        kv = self.kv_token_bytes * sum(self.attended_keys(n) for n in context_lens)
        return self.weight_bytes + len(context_lens) * self.embedding_row_bytes + kv

    def token_flops(self, context_len: int, lm_head: bool = True) -> int:
        """FLOPs of one token at `context_len`: 2 per weight it multiplies in the projections, in the LM
        head where its logits are computed (`lm_head`: a prompt's tokens before its last have none),
        and in attention 2 per element of q.k and of p.v over the keys it attends to."""
        attention = 2 * 2 * self.config.num_heads * self.config.head_dim * self.attended_keys(context_len)
        return 2 * self.layer_params + (2 * self.lm_head_params if lm_head else 0) + attention
