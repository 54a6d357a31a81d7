"""Linear layers and the embedding over weights kept in GGUF blocks (QuantizedTensor), on kvserve's
quantized kernels (kernels/cpu/quant_*.cpp).

`quant_product` chooses the kernel (the compiled decode step calls the same): `quant_gemv` streams the
blocks once with x quantized to int8 per 32 elements, for up to GEMV_MAX_ROWS rows, or in a decode step
(`decode_step`: every row follows generated tokens) up to `int8_max_rows` (on row groups 128, or 16
with AMX, 8 for Q6_K's; 8 in GGML's layout); more rows, and prefill steps, take `quant_linear`, which dequantizes a
panel of weight rows into a tile in cache and multiplies every row with it, exactly up to the order of
the sums. The weights are read once per product at their quantized size either way. A prefill's KV
serves every later token of its request, so it stays exact; a decode step's row makes one token, as
batch 1's always has on the GEMV. A fused projection whose parts differ in block type
(StackedQuantizedTensor) runs a product per part and concatenates their columns.

The embedding table, when quantized, stays in its blocks: a step gathers the rows of its tokens and
dequantizes only those (exactly, as gguf does), from GGML's layout or from row groups, where a tied
table (SmolLM2's, Gemma 3's: also the LM head) lies so that the head's products run the GEMV. A
dequantized copy would cost the table's float size again in memory (49152 x 576 float32 is 113 MB for
SmolLM2), to save a dequantization of a few rows per step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu
from kvserve.model.quantized import Quantized, QuantizedTensor, StackedQuantizedTensor

LinearFn = Callable[[torch.Tensor], torch.Tensor]

# Whether the model call at hand is a decode step (see the module docstring); set by `decode_step`.
_decode_step: ContextVar[bool] = ContextVar("decode_step", default=False)


@contextlib.contextmanager
def decode_step(active: bool) -> Iterator[None]:
    """Within it, quantized products take the rows of a decode step where `active` (the runner's
    judgement: every row follows generated tokens, as in decode, verify and draft passes), a prefill
    step's otherwise."""
    token = _decode_step.set(active)
    try:
        yield
    finally:
        _decode_step.reset(token)


def in_decode_step() -> bool:
    """Whether the model call at hand is a decode step (`decode_step`)."""
    return _decode_step.get()


@functools.cache
def quantized_kernels() -> ModuleType | None:
    """The compiled kernels if their quantized products run on this CPU (they need AVX2, FMA and F16C),
    else None. Probed once per process."""
    kernels = cpu.load()
    if kernels is None:
        return None
    try:  # one Q8_0 block: scale 1.0 (f16 0x3C00), every value 1
        block = torch.tensor([[0x00, 0x3C] + [1] * 32], dtype=torch.uint8)
        out = kernels.quant_gemv(torch.ones(1, 32), block, 8)
    except RuntimeError:
        return None
    return kernels if bool(((out - 32).abs() < 1e-3).all()) else None


@dataclass(frozen=True)
class QuantizedLinear:
    """x @ W^T for W in GGUF blocks; `gated` (W = [gate; up]): silu(gate) * up of the product, which the
    GEMV on row groups computes while the two halves' results are in registers."""

    kernels: ModuleType
    weight: QuantizedTensor
    gated: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.quant_product(x, self.weight.blocks, self.weight.kernel_type, in_decode_step(), self.gated)


@dataclass(frozen=True)
class StackedQuantizedLinear:
    """x @ W^T for W = [part 0; part 1; ...] of different block types: one product per part, columns
    concatenated; with `silu_mul` applied to the whole as QuantizedLinear does."""

    parts: tuple[QuantizedLinear, ...]
    silu_mul: LinearFn | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=1)
        return y if self.silu_mul is None else self.silu_mul(y)


def make_quantized_linear(
    weight: Quantized, silu_mul: LinearFn | None = None
) -> QuantizedLinear | StackedQuantizedLinear:
    """x @ W^T, or with `silu_mul` (W = [gate; up]) silu(gate) * up: the kernels' own where W is one
    QuantizedTensor, `silu_mul` after the concatenated parts' products where it is stacked."""
    kernels = quantized_kernels()
    if kernels is None:
        raise ValueError("weights are kept in GGUF blocks only where kvserve's quantized kernels run")
    if isinstance(weight, StackedQuantizedTensor):
        return StackedQuantizedLinear(tuple(QuantizedLinear(kernels, part) for part in weight.parts), silu_mul)
    return QuantizedLinear(kernels, weight, gated=silu_mul is not None)


def make_embedding(table: torch.Tensor | QuantizedTensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """token ids [T] -> their rows of `table` in float32 [T, hidden]."""
    if not isinstance(table, QuantizedTensor):
        return lambda ids: F.embedding(ids, table).float()
    kernels = quantized_kernels()
    if kernels is None:
        raise ValueError("a quantized embedding table needs kvserve's quantized kernels")
    return lambda ids: kernels.dequantize_rows(table.blocks, ids, table.kernel_type)
