"""The compiled decode step: every decoder layer of a step made only of decode rows as one C++ call
(kernels/cpu/decode_layers.cpp), instead of LlamaModel.forward's Python loop over the layers.

It runs every family's layer as that loop does: the Llama layer, and where the model has them its q/k/v
bias, q/k head norms, norms after attention and MLP, tanh-GELU gating, a RoPE table and a sliding window
per layer. It needs every projection to be a bf16 KernelLinear, or every one quantized (QuantizedLinear,
or StackedQuantizedLinear for a fused projection whose parts differ in block type; any dtype). It takes
each layer's tensors in the order a step runs them (a quantized part as its blocks, with the block types),
and their packed tiles (linear_amx's, or linear_tiles_fma's without AMX) where every projection has them,
once, as a kernels.DecodeModel; a step passes only its rows. It then takes up to AMX_MAX_ROWS rows
(quant_linear takes any number; the one limit keeps the step's cost model), else the GEMV's few.

Invariant: the tensors it holds are the model's own (views, no copies), so it reads the same weights and
gives the Python loop's tokens (tests/test_decode_layers.py, tests/test_model_families.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from kvserve.kernels.metadata import AttentionMetadata
from kvserve.model.linear import AMX_MAX_ROWS, GatedAfterProduct, KernelLinear, LinearFn, gemv_kernels
from kvserve.model.quantized import QuantizedTensor
from kvserve.model.quantized_linear import QuantizedLinear, StackedQuantizedLinear, in_decode_step, quantized_kernels
from kvserve.model.weights import LayerWeights, Weight

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaModel


def projection_weights(layer: LayerWeights) -> tuple[Weight, ...]:
    """A layer's four projections in the order a step runs them (and decode_layers takes them)."""
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def product_of(linear: LinearFn) -> LinearFn:
    """The product decode_layers runs for a layer's linear: a gelu-gated up projection's own product
    (decode_layers gates it after), any other linear itself."""
    return linear.product if isinstance(linear, GatedAfterProduct) else linear


def product_parts(linear: LinearFn, weight: Weight) -> list[torch.Tensor | QuantizedTensor]:
    """What decode_layers multiplies for a projection: a quantized linear's block tensors, one per part,
    or the dense `weight` (the model's own)."""
    if isinstance(linear, QuantizedLinear):
        return [linear.weight]
    if isinstance(linear, StackedQuantizedLinear):
        return [part.weight for part in linear.parts]
    assert isinstance(weight, torch.Tensor), "a quantized weight is multiplied by a quantized linear"
    return [weight]


def layer_products(model: LlamaModel) -> list[list[LinearFn]]:
    """Per layer, the products decode_layers runs for its projections, in projection_weights' order."""
    return [[product_of(p) for p in layer] for layer in model.linears]


def decode_model_arguments(model: LlamaModel, kernels: ModuleType) -> dict[str, Any]:
    """kernels.DecodeModel's arguments for `model` (ops.h says what each holds)."""
    projections = layer_products(model)
    parts = [
        product_parts(p, w) for layer, weights in zip(projections, model.weights.layers, strict=True)
        for p, w in zip(layer, projection_weights(weights), strict=True)
    ]  # fmt: skip
    tiles = [p.tiles if isinstance(p, KernelLinear) else None for layer in projections for p in layer]
    none = torch.empty(0)  # decode_layers' "none": no elements
    return {
        "weights": [w.blocks if isinstance(w, QuantizedTensor) else w for ps in parts for w in ps],
        "parts": [len(ps) for ps in parts],
        "norms": [norm for pair in model.norms for norm in pair],
        "tiles": tiles if all(t is not None for t in tiles) else [],
        "block_types": [w.kernel_type for ps in parts for w in ps if isinstance(w, QuantizedTensor)],
        "extras": [
            extras.get(name, none) for extras in model.layer_extras for name in kernels.DECODE_LAYER_EXTRAS
        ] if any(model.layer_extras) else [],
        "final_norm": model.final_norm,
        "eps": model.config.rms_norm_eps,
        "rope": [table for pair in model.layer_rope for table in pair],
        "scale": model.scale,
        "hq": model.config.num_heads,
        "hkv": model.config.num_kv_heads,
        "windows": [window or 0 for window in model.layer_windows],  # decode_layers' 0: no window
        "gelu_tanh": model.config.activation == "gelu_tanh",
    }  # fmt: skip


class CompiledDecodeStep:
    def __init__(self, model: LlamaModel, kernels: ModuleType, all_quantized: bool) -> None:
        self.kernels = kernels
        self.decode_model = kernels.DecodeModel(**decode_model_arguments(model, kernels))
        self.max_rows = AMX_MAX_ROWS if self.decode_model.tiles or all_quantized else kernels.GEMV_MAX_ROWS

    @classmethod
    def for_model(cls, model: LlamaModel) -> CompiledDecodeStep | None:
        """The step for `model` where its kernels built and every projection takes them, else None."""
        if model.device.type != "cpu":
            return None
        all_quantized = all(
            isinstance(p, QuantizedLinear | StackedQuantizedLinear) for layer in layer_products(model) for p in layer
        )
        if all_quantized:
            kernels = quantized_kernels()
        elif model.dtype == torch.bfloat16 and not model.quantized:
            kernels = gemv_kernels()
        else:
            return None
        return None if kernels is None else cls(model, kernels, all_quantized)

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
        return self.kernels.decode_layers(
            h, self.decode_model, num_layers, positions, kv_cache, slot_mapping, meta.block_tables, meta.seq_lens,
            meta.cu_seqlens_q, torch.arange(meta.num_seqs), in_decode_step(),
        )  # fmt: skip
