"""A weight matrix kept in its GGUF block format: the blocks as bytes, their type and the logical shape.

Layout (GGML's, as the file stores it): row n of the [N, K] matrix is the K / block_elems blocks of
row n back to back, `row_bytes` bytes in all, so `blocks` is uint8 [N, row_bytes] and any row
operation (selecting, permuting, concatenating rows) is the same operation on `blocks`. A block holds
a run of one row's elements, never parts of two rows. The reference for every kernel that reads
these blocks is `dequantize` (gguf.quants.dequantize, float32).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# The block types kvserve's kernels multiply (kernels/cpu/quant_blocks.h has their layouts).
KERNEL_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)


@dataclass(frozen=True)
class QuantizedTensor:
    blocks: torch.Tensor  # uint8 [N, row_bytes], contiguous
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (N, K): the matrix the blocks encode

    def __post_init__(self) -> None:
        block_elems, block_bytes = GGML_QUANT_SIZES[self.qtype]
        n, k = self.shape
        if k % block_elems:
            raise ValueError(f"{self.qtype.name} rows must hold whole blocks of {block_elems}, got K={k}")
        expected = (n, k // block_elems * block_bytes)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(f"{self.qtype.name} blocks of a {n}x{k} matrix are uint8 {expected}, got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}")  # fmt: skip

    @classmethod
    def from_gguf(cls, data: np.ndarray, qtype: GGMLQuantizationType, shape: Sequence[int]) -> QuantizedTensor:
        """From a GGUF tensor's bytes ([N, row_bytes] uint8, as GGUFReader gives them; copied out of the
        memory-mapped file) and its row-major shape (N, K)."""
        n, k = (int(d) for d in shape)
        blocks = torch.from_numpy(np.array(data, dtype=np.uint8, order="C", copy=True)).view(n, -1)
        return cls(blocks, GGMLQuantizationType(qtype), (n, k))

    @property
    def row_bytes(self) -> int:
        return self.blocks.shape[1]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] matrix (gguf's reference dequantization)."""
        values = gguf_dequantize(self.blocks.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantizedTensor:
        """The rows `index` (a permutation or a selection) in that order."""
        blocks = self.blocks[torch.as_tensor(index, dtype=torch.long)].contiguous()
        return QuantizedTensor(blocks, self.qtype, (blocks.shape[0], self.shape[1]))

    @staticmethod
    def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """The rows of `parts` stacked (a fused projection); they must share the block type and K."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("QuantizedTensor.cat takes tensors of one block type and one K")
        blocks = torch.cat([p.blocks for p in parts], dim=0)
        return QuantizedTensor(blocks, first.qtype, (blocks.shape[0], first.shape[1]))


@dataclass(frozen=True)
class StackedQuantizedTensor:
    """A fused projection whose parts the file stores in different block types (llama.cpp's mixes do
    this: Gemma 3's Q4_K_M file has q and k in Q5_0 and v in Q8_0). A product runs one block type, so
    each part stays as the file has it and a product over this runs once per part, on its rows.

    Invariant: at least two parts, all with the same K, neighbours of different block types (`stack_rows`
    joins neighbours of one type)."""

    parts: tuple[QuantizedTensor, ...]

    def __post_init__(self) -> None:
        neighbours = zip(self.parts, self.parts[1:], strict=False)
        if len(self.parts) < 2 or any(a.qtype == b.qtype or a.shape[1] != b.shape[1] for a, b in neighbours):
            raise ValueError("StackedQuantizedTensor takes parts of one K, neighbours of different block types")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], dim=0)


Quantized = QuantizedTensor | StackedQuantizedTensor


def stack_rows(parts: Sequence[QuantizedTensor]) -> Quantized:
    """The parts' rows stacked (a fused projection): one QuantizedTensor where they share a block type,
    else a StackedQuantizedTensor of the runs of neighbouring parts that share one (q|k, v)."""
    runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.qtype)]
    if len(runs) == 1:
        return QuantizedTensor.cat(parts)
    return StackedQuantizedTensor(tuple(QuantizedTensor.cat(run) for run in runs))


def block_parts(weight: object) -> list[QuantizedTensor]:
    """The QuantizedTensors `weight` is made of: itself, its parts, or none for a dense tensor."""
    if isinstance(weight, QuantizedTensor):
        return [weight]
    if isinstance(weight, StackedQuantizedTensor):
        return list(weight.parts)
    return []
