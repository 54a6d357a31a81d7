"""A weight matrix kept in its GGUF block format: the blocks as bytes, their type and the logical shape.

Layout (GGML's, as the file stores it): row n of the [N, K] matrix is the K / block_elems blocks of
row n back to back, `row_bytes` bytes in all, so `blocks` is uint8 [N, row_bytes] and any row
operation (selecting, permuting, concatenating rows) is the same operation on `blocks`. A block holds
a run of one row's elements, never parts of two rows. The reference for every kernel that reads
these blocks is `dequantize` (gguf.quants.dequantize, float32).
"""

from __future__ import annotations

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
