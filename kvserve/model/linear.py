"""y = x @ W^T with W kept in the layout the device's fastest kernel wants.

On CPUs with oneDNN, bf16 weights pre-packed into oneDNN's blocked layout run 1.5-2x faster than
F.linear (which re-reads a plain layout every call): measured on this 2-core Xeon with AMX, one
thread, a 3072x576 projection: 0.25 -> 0.175 ms at 1 row, 0.44 -> 0.24 ms at 64 rows; the 49152-row
LM head 3.7 -> 2.3 ms. At one or two rows (batch-1 decode) kvserve's own bf16 GEMV
(kernels/cpu/gemv.cpp) is faster still: 3072x576 at one row 93 -> 45 us, two threads. From 3 to
AMX_MAX_ROWS rows, on CPUs with AMX, kvserve's tile kernel (kernels/cpu/linear_amx.cpp) beats oneDNN.
Anything else (float32, CUDA, a torch without the op) uses F.linear. `make_linear` builds a plain
projection; `make_gated_up` the MLP's up projection, silu(gate) * up, by the same choice of kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu

LinearFn = Callable[[torch.Tensor], torch.Tensor]

# The most rows linear_amx takes; more go to oneDNN. `python benchmarks/linear.py` (the model's 121
# products, weights streamed from memory, 2 threads), oneDNN / linear_amx time: 1.19x at 100 rows, 1.24x
# at 256, 1.26x at 384, 1.02x at 512, 0.85x at 1,024. Up to 512 it also spares the mixed steps of
# online traffic oneDNN's primitive creation for each new row count (~1.5 ms per product shape).
AMX_MAX_ROWS = 512
# Tile kernel operands: 32-column panels (two 16-column B tiles), 32-deep k steps.
AMX_ALIGN = 32


def _onednn_packing_works(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(2, 3, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 3, dtype=torch.bfloat16), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return out.shape == (1, 2) and bool((out == 3).all())


@functools.cache
def _onednn_epilogues_work() -> bool:
    """Whether this torch's oneDNN linear takes the silu ("swish") and multiply epilogues make_gated_up uses."""
    try:
        x = torch.ones(1, 2, dtype=torch.bfloat16)
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(1, 2, dtype=torch.bfloat16), 1)
        silu = torch.ops.mkldnn._linear_pointwise(x, weight, None, "swish", [], "")  # silu(2) = 1.76
        out = torch.ops.mkldnn._linear_pointwise.binary(x, silu, weight, None, "mul")  # 2 * silu(2)
    except (RuntimeError, AttributeError):
        return False
    return abs(float(out) - 2 * float(F.silu(torch.tensor(2.0)))) < 0.02


@functools.cache
def gemv_kernels() -> ModuleType | None:
    """The compiled kernels if their bf16 GEMV runs on this CPU (it needs AVX512-BF16), else None.
    Probed once per process: every linear layer and the model ask."""
    kernels = cpu.load()
    if kernels is None:
        return None
    try:
        out = kernels.gemv_bf16(torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(3, 32, dtype=torch.bfloat16))
    except RuntimeError:
        return None
    return kernels if bool((out == 32).all()) else None


def make_linear(weight: torch.Tensor) -> LinearFn:
    """A function computing F.linear(x, weight) (no bias), as fast as this device allows."""
    if not _onednn_packing_works(weight):
        return lambda x: F.linear(x, weight)
    # The batch-size hint only tunes the blocking; the packed weight accepts any number of rows.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return _with_few_row_kernels(weight, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


def make_gated_up(weight: torch.Tensor, silu_mul: LinearFn) -> LinearFn:
    """A function computing silu(x @ gate^T) * (x @ up^T) for weight = [gate; up] ([2I, K]), where
    `silu_mul` maps the product [T, 2I] to that. Its kernels apply the silu and the multiplication to
    the float32 results while they are in cache; a separate silu_mul pass read the [T, 2I] product back
    from memory. linear_amx does it in its epilogue (per layer, weights streamed: 100 rows 0.357 -> 0.308 ms,
    256 rows 0.738 -> 0.520); oneDNN, for more rows (prefill chunks), as two products with a silu and a
    multiply epilogue (2,048 rows: 4.22 -> 3.42 ms). The GEMV (1-2 rows) stays a product and a silu_mul."""
    if not _onednn_packing_works(weight):
        return lambda x: silu_mul(F.linear(x, weight))
    if not _onednn_epilogues_work():
        gate_up = make_linear(weight)
        return lambda x: silu_mul(gate_up(x))
    gate, up = (torch.ops.mkldnn._reorder_linear_weight(half.contiguous(), 1) for half in weight.chunk(2))

    def many_rows(x: torch.Tensor) -> torch.Tensor:
        silu_gate = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, silu_gate, up, None, "mul")

    return _with_few_row_kernels(weight, many_rows, silu_mul)


def _with_few_row_kernels(weight: torch.Tensor, many_rows: LinearFn, silu_mul: LinearFn | None = None) -> LinearFn:
    """`many_rows` for row counts kvserve's own kernels do not take; up to GEMV_MAX_ROWS the bf16 GEMV,
    then up to AMX_MAX_ROWS linear_amx where the CPU has AMX. With `silu_mul` (weight = [gate; up]) the
    result is silu(gate) * up: the GEMV's product goes through silu_mul, linear_amx gates in its epilogue."""
    kernels = gemv_kernels()
    if kernels is None:
        return many_rows
    few_rows = kernels.GEMV_MAX_ROWS
    n, k = weight.shape
    amx = kernels.amx_available() and n % AMX_ALIGN == 0 and k % AMX_ALIGN == 0
    gated = silu_mul is not None
    tiles = pack_for_amx(_interleave_halves(weight) if gated else weight) if amx else None
    amx_rows = AMX_MAX_ROWS if amx else few_rows  # without tiles nothing lies between GEMV and many_rows
    gemv = (lambda x: silu_mul(kernels.gemv_bf16(x, weight))) if gated else (lambda x: kernels.gemv_bf16(x, weight))
    return lambda x: (
        gemv(x)
        if x.shape[0] <= few_rows
        else kernels.linear_amx(x.contiguous(), tiles, gated)
        if x.shape[0] <= amx_rows
        else many_rows(x)
    )


def _interleave_halves(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] with rows reordered gate 0-15, up 0-15, gate 16-31, up 16-31, ...: so that each of
    linear_amx's 32-column blocks holds 16 gate columns and their up columns (its gated epilogue)."""
    n, k = weight.shape
    return weight.view(2, n // AMX_ALIGN, AMX_ALIGN // 2, k).transpose(0, 1).reshape(n, k)


def pack_for_amx(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] as linear_amx's B tiles: [N/16, K/32, 512], tile (j, s) holding columns 16j.. and k
    steps 32s.. with element (n, k) at (k // 2) * 32 + n * 2 + k % 2 (k-pairs of one column adjacent)."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // 32, 512)
