"""The compiled decode step: every decoder layer of a step made only of decode rows as one C++ call
(kernels/cpu/decode_layers.cpp), instead of LlamaModel.forward's Python loop over the layers.

It runs the plain Llama layer (no bias, head norms, sandwich norms, other activations or per-layer RoPE
bases: `torch_path_reasons`), with a sliding window per layer where the model has them. It needs every
projection to be a bf16 KernelLinear, or every one a QuantizedLinear (any dtype). It takes each layer's
tensors in the order a step runs them (a quantized one as its blocks, with the block types), and their
packed tiles (linear_amx's, or linear_tiles_fma's without AMX) where every projection has them. It then
takes up to AMX_MAX_ROWS rows (quant_linear takes any number; the one limit keeps the step's cost model),
else the GEMV's few.

Invariant: the tensors it holds are the model's own (views, no copies), so it reads the same weights and
gives the Python loop's tokens (tests/test_decode_layers.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from kvserve.kernels.metadata import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.linear import AMX_MAX_ROWS, KernelLinear, LinearFn, gemv_kernels
from kvserve.model.quantized import QuantizedTensor
from kvserve.model.quantized_linear import QuantizedLinear, in_decode_step, quantized_kernels
from kvserve.model.weights import LayerWeights, Weight

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaModel


def projection_weights(layer: LayerWeights) -> tuple[Weight, ...]:
    """A layer's four projections in the order a step runs them (and decode_layers takes them)."""
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def torch_path_reasons(config: ModelConfig) -> list[str]:
    """Why the compiled decode step (the plain Llama layer) cannot run this model; empty where it can."""
    reasons = [
        "its q/k/v projections have a bias" if config.attention_bias else "",
        "it normalizes q and k heads" if config.qk_norm else "",
        "it has norms after attention and MLP" if config.sandwich_norms else "",
        f"its MLP gates with {config.activation}" if config.activation != "silu" else "",
        "its layers use different RoPE bases" if config.sliding_rope_theta is not None else "",
    ]
    return [r for r in reasons if r]


class CompiledDecodeStep:
    def __init__(
        self, model: LlamaModel, kernels: ModuleType, projections: list[list[LinearFn]], all_quantized: bool
    ) -> None:
        self.kernels = kernels
        self.model = model
        self.layer_tensors = [
            (*(w.blocks if isinstance(w, QuantizedTensor) else w for w in projection_weights(layer)), *norms)
            for layer, norms in zip(model.weights.layers, model.norms, strict=True)
        ]
        self.block_types = [
            p.weight.kernel_type for layer in projections for p in layer if isinstance(p, QuantizedLinear)
        ]
        tiles = [[p.tiles if isinstance(p, KernelLinear) else None for p in layer] for layer in projections]
        self.tiles = tiles if all(t is not None for layer in tiles for t in layer) else None
        self.windows = [window or 0 for window in model.layer_windows]  # decode_layers' 0: no window
        self.max_rows = AMX_MAX_ROWS if self.tiles is not None or all_quantized else kernels.GEMV_MAX_ROWS

    @classmethod
    def for_model(cls, model: LlamaModel) -> CompiledDecodeStep | None:
        """The step for `model` where its kernels built and it runs the plain Llama layer, else None."""
        if model.device.type != "cpu" or torch_path_reasons(model.config):
            return None
        projections: list[list[LinearFn]] = [list(layer) for layer in model.linears]
        all_quantized = all(isinstance(p, QuantizedLinear) for layer in projections for p in layer)
        if all_quantized:
            kernels = quantized_kernels()
        elif model.dtype == torch.bfloat16 and not model.quantized:
            kernels = gemv_kernels()
        else:
            return None
        return None if kernels is None else cls(model, kernels, projections, all_quantized)

    def run(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata,
        num_layers: int,
    ) -> torch.Tensor:
        """LlamaModel.forward of the first `num_layers` layers over the embedded rows `h` (updated in place),
        every row a decode row: the final-normed hidden states."""
        model, cfg = self.model, self.model.config
        tiles = [] if self.tiles is None else self.tiles[:num_layers]
        return self.kernels.decode_layers(
            h, [tensor for group in self.layer_tensors[:num_layers] for tensor in group],
            [tensor for group in tiles for tensor in group], self.block_types[: 4 * num_layers],
            model.final_norm, cfg.rms_norm_eps, positions, model.rope_cos, model.rope_sin, kv_cache, slot_mapping,
            meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, torch.arange(meta.num_seqs), model.scale,
            cfg.num_heads, cfg.num_kv_heads, self.windows[:num_layers], in_decode_step(),
        )  # fmt: skip
