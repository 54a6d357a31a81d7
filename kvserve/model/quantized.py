"""A weight matrix kept in its GGUF block format: the blocks as bytes, their type and the logical shape.

Layout (GGML's, as the file stores it): row n of the [N, K] matrix is the K / block_elems blocks of
row n back to back, `row_bytes` bytes in all, so `blocks` is uint8 [N, row_bytes] and any row
operation (selecting, permuting, concatenating rows) is the same operation on `blocks`. A block holds
a run of one row's elements, never parts of two rows. The reference for every kernel that reads
these blocks is `dequantize` (gguf.quants.dequantize, float32).

A matrix the model multiplies may instead be in row groups (`interleaved`, below): the same bytes
permuted so eight rows' blocks lie side by side, the layout the batch-1 GEMV reads fastest. Row
operations then go through `ggml_blocks`, GGML's layout again.
"""

from __future__ import annotations

import functools
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

# Row groups (kernels/cpu/quant_row_groups.h has the layout and why): the blocks of ROW_GROUP_ROWS rows
# interleaved so the batch-1 GEMV multiplies eight rows per vector; for these block types, named to the
# kernels by ROW_GROUP_TYPE_OFFSET + the GGML type (the header's kRowGroupTypeOffset).
ROW_GROUP_ROWS = 8
ROW_GROUP_TYPE_OFFSET = 256
ROW_GROUP_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)


def _qs_bytes(qtype: GGMLQuantizationType) -> int:
    """The bytes of a block's values (its qs): 32 int8 for Q8_0, 256 nibbles for Q4_K, Q6_K's 256 nibbles
    and 256 bit pairs, 32 nibbles else."""
    wide = {GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q4_K: 128, GGMLQuantizationType.Q6_K: 192}
    return wide.get(qtype, 16)


def _field_widths(qtype: GGMLQuantizationType) -> list[int]:
    """The bytes of each field of a block, in GGML's order: f16 d, then Q4_1's f16 m, Q5_0's 32 fifth bits,
    or Q4_K's f16 dmin and its 12 scale bytes one field each; Q6_K's 16 scale bytes, then its f16 d."""
    widths = {GGMLQuantizationType.Q4_1: [2, 2], GGMLQuantizationType.Q5_0: [2, 4],
              GGMLQuantizationType.Q4_K: [2, 2] + [1] * 12, GGMLQuantizationType.Q6_K: [1] * 16 + [2]}  # fmt: skip
    return widths.get(qtype, [2])


@functools.cache
def _row_group_order(qtype: GGMLQuantizationType) -> np.ndarray:
    """Byte b of a group block is byte order[b] of the group's eight GGML blocks laid end to end (row r's
    block at r * block_bytes): each field of the eight rows, then the 32-byte qs vectors, byte 4r + t of
    vector j being byte 4j + t of row r's qs (quant_row_groups.h). A GGML block holds its fields before its
    qs, but Q6_K's after."""
    block_bytes, qs_bytes = GGML_QUANT_SIZES[qtype][1], _qs_bytes(qtype)
    widths = _field_widths(qtype)
    qs_first = qtype == GGMLQuantizationType.Q6_K
    fields_start, qs_start = (qs_bytes, 0) if qs_first else (0, block_bytes - qs_bytes)
    starts = fields_start + np.cumsum([0, *widths])
    rows = range(ROW_GROUP_ROWS)
    order = [
        r * block_bytes + int(start) + c
        for start, w in zip(starts[:-1], widths, strict=True)
        for r in rows
        for c in range(w)
    ]
    assert sum(widths) == block_bytes - qs_bytes, "the fields and qs make the block"
    order += [r * block_bytes + qs_start + 4 * j + t for j in range(qs_bytes // 4) for r in rows for t in range(4)]
    return np.array(order)


def _regroup(blocks: torch.Tensor, qtype: GGMLQuantizationType, n: int, to_groups: bool) -> torch.Tensor:
    """GGML-layout blocks [N, row_bytes] -> row groups [N / 8, 8 * row_bytes], or back."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    order = _row_group_order(qtype)
    groups, per_row = n // ROW_GROUP_ROWS, blocks.numel() // n // block_bytes  # blocks per row
    if to_groups:  # [G, 8, nb, B] -> [G, nb, 8 * B], then each group block's bytes reordered
        grouped = blocks.numpy().reshape(groups, ROW_GROUP_ROWS, per_row, block_bytes).transpose(0, 2, 1, 3)
        packed = grouped.reshape(groups, per_row, -1)[..., order]
        return torch.from_numpy(np.ascontiguousarray(packed).reshape(groups, -1))
    unordered = np.empty((groups, per_row, ROW_GROUP_ROWS * block_bytes), dtype=np.uint8)
    unordered[..., order] = blocks.numpy().reshape(groups, per_row, -1)
    rows = unordered.reshape(groups, per_row, ROW_GROUP_ROWS, block_bytes).transpose(0, 2, 1, 3)
    return torch.from_numpy(np.ascontiguousarray(rows).reshape(n, -1))


@dataclass(frozen=True)
class QuantizedTensor:
    blocks: torch.Tensor  # uint8 [N / row_group, row_group * row_bytes], contiguous
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (N, K): the matrix the blocks encode
    row_group: int = 1  # 1: GGML's layout (the module docstring); ROW_GROUP_ROWS: row groups

    def __post_init__(self) -> None:
        block_elems, block_bytes = GGML_QUANT_SIZES[self.qtype]
        n, k = self.shape
        if k % block_elems:
            raise ValueError(f"{self.qtype.name} rows must hold whole blocks of {block_elems}, got K={k}")
        if self.row_group != 1 and (self.row_group != ROW_GROUP_ROWS or self.qtype not in ROW_GROUP_TYPES
                                    or n % ROW_GROUP_ROWS):  # fmt: skip
            raise ValueError(f"{self.qtype.name} {n}x{k} blocks cannot be in row groups of {self.row_group}")
        expected = (n // self.row_group, k // block_elems * block_bytes * self.row_group)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(f"{self.qtype.name} blocks of a {n}x{k} matrix are uint8 {expected}, got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}")  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def kernel_type(self) -> int:
        """The number that names this layout to the kernels: the GGML type, or its row-group type."""
        return int(self.qtype) + (ROW_GROUP_TYPE_OFFSET if self.row_group > 1 else 0)

    def ggml_blocks(self) -> torch.Tensor:
        """The blocks in GGML's layout, uint8 [N, row_bytes] (a copy where they are in row groups)."""
        return self.blocks if self.row_group == 1 else _regroup(self.blocks, self.qtype, self.shape[0], False)

    def interleaved(self) -> QuantizedTensor:
        """This matrix in row groups where its block type has them and N is a whole number of groups,
        else itself."""
        if self.row_group > 1 or self.qtype not in ROW_GROUP_TYPES or self.shape[0] % ROW_GROUP_ROWS:
            return self
        return QuantizedTensor(_regroup(self.blocks, self.qtype, self.shape[0], True), self.qtype, self.shape,
                               ROW_GROUP_ROWS)  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] matrix (gguf's reference dequantization)."""
        values = gguf_dequantize(self.ggml_blocks().numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantizedTensor:
        """The rows `index` (a permutation or a selection) in that order, in GGML's layout."""
        blocks = self.ggml_blocks()[torch.as_tensor(index, dtype=torch.long)].contiguous()
        return QuantizedTensor(blocks, self.qtype, (blocks.shape[0], self.shape[1]))

    @staticmethod
    def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """The rows of `parts` stacked (a fused projection), in GGML's layout; they must share the block
        type and K."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("QuantizedTensor.cat takes tensors of one block type and one K")
        blocks = torch.cat([p.ggml_blocks() for p in parts], dim=0)
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
