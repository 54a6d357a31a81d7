"""y = x @ W^T with W kept in the layout the device's fastest kernel wants.

On CPUs with oneDNN, weights pre-packed into oneDNN's blocked layout run faster than F.linear (which
re-reads a plain layout every call), in bf16 and float32 alike. Where oneDNN has no bf16 kernel (CPUs
without AVX-512: its packing probe fails), bf16 weights are packed widened to float32 and the product
runs in float32 on bf16 inputs: the same arithmetic as a bf16 product with float32 accumulation (bf16
values widen exactly), at the float32 kernel's speed, where torch's own bf16 F.linear is several times
slower than float32. At one or two rows (batch-1 decode) kvserve's own bf16 GEMV (kernels/cpu/gemv.cpp)
is faster still. From 3 to AMX_MAX_ROWS rows, on CPUs with AMX, kvserve's tile kernel
(kernels/cpu/linear_amx.cpp) beats oneDNN; on CPUs without, its kernel over the same packed tiles
(kernels/cpu/linear_tiles_fma.cpp, on float32 FMAs or VDPBF16PS) does where a probe at load says so
(batched_products).
Figures: benchmarks/RESULTS.md, "Figures behind the code's rules".
Anything else (CUDA, a torch without the op) uses F.linear. `make_linear` builds a plain projection;
`make_gated_up` the MLP's up projection, silu(gate) * up, by the same choice of kernels. Weights kept in
GGUF blocks (quantized.Quantized) go to the quantized kernels (quantized_linear.py).
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu
from kvserve.model.quantized import Quantized, QuantizedTensor, StackedQuantizedTensor
from kvserve.model.quantized_linear import make_quantized_linear

LinearFn = Callable[[torch.Tensor], torch.Tensor]

logger = logging.getLogger(__name__)

# The most rows linear_amx takes; more go to oneDNN, which is faster from about here on
# (`python benchmarks/linear.py`). Up to it linear_amx also spares the mixed steps of online traffic
# oneDNN's primitive creation for each new row count. Figures: benchmarks/RESULTS.md, "Figures behind the code's rules".
AMX_MAX_ROWS = 512
# Tile kernel operands: 32-column panels (two 16-column B tiles), 32-deep k steps.
AMX_ALIGN = 32
# linear_amx computes rows in blocks of two 16-row tiles; a last block of 1-31 rows costs as much as a full
# one (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
AMX_ROW_BLOCK = 32


@functools.cache
def onednn_packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN packs and multiplies `dtype` weights on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(2, 3, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 3, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return out.shape == (1, 2) and bool((out == 3).all())


def _onednn_compute_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype oneDNN multiplies `weight` in: its own, float32 for bf16 weights where oneDNN has no
    bf16 kernel, or None where oneDNN cannot take it at all (CUDA, other dtypes, no oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    for dtype in (weight.dtype, torch.float32):
        if onednn_packing_works(dtype):
            return dtype
    return None


@functools.cache
def _onednn_epilogues_work(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN linear takes the silu ("swish") and multiply epilogues make_gated_up
    uses, in `dtype`."""
    try:
        x = torch.ones(1, 2, dtype=dtype)
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(1, 2, dtype=dtype), 1)
        silu = torch.ops.mkldnn._linear_pointwise(x, weight, None, "swish", [], "")  # silu(2) = 1.76
        out = torch.ops.mkldnn._linear_pointwise.binary(x, silu, weight, None, "mul")  # 2 * silu(2)
    except (RuntimeError, AttributeError):
        return False
    return abs(float(out) - 2 * float(F.silu(torch.tensor(2.0)))) < 0.02


@functools.cache
def gemv_kernels() -> ModuleType | None:
    """The compiled kernels if their bf16 GEMV runs on this CPU (it needs AVX512-BF16, or AVX2 and
    FMA), else None. Probed once per process: every linear layer and the model ask."""
    kernels = cpu.load()
    if kernels is None:
        return None
    try:
        out = kernels.gemv_bf16(torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(3, 32, dtype=torch.bfloat16))
    except RuntimeError:
        return None
    return kernels if bool((out == 32).all()) else None


# oneDNN's batch-size hint when packing: it only tunes the blocking (the packed weight takes any number
# of rows). bf16 runs fastest with 1; float32 with 64, at every row count
# (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
PACKING_ROWS_HINT = {torch.bfloat16: 1, torch.float32: 64}
# bf16 products of more than LARGE_ROWS rows (long prefill chunks) take a second packing, made for
# LARGE_ROWS_HINT rows: neither blocking wins at every size, and the large one wins past LARGE_ROWS.
# float32 gains nothing from it, so it keeps one packing. The second one costs the bf16 weights' size
# again in memory. Figures: benchmarks/RESULTS.md, "Figures behind the code's rules".
LARGE_ROWS = 1024
LARGE_ROWS_HINT = 2048


def _onednn_pack(weight: torch.Tensor, compute: torch.dtype, rows_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(compute), rows_hint)


def _packed_for_rows(
    weight: torch.Tensor, compute: torch.dtype, large_rows: bool = True
) -> Callable[[int], torch.Tensor]:
    """`weight` packed for oneDNN, and which packing a product of a given row count takes. `large_rows`:
    the products may have more than LARGE_ROWS rows (not the LM head's: one row per sampled token)."""
    packed = _onednn_pack(weight, compute, PACKING_ROWS_HINT[compute])
    if compute != torch.bfloat16 or not large_rows:
        return lambda rows: packed
    packed_large = _onednn_pack(weight, compute, LARGE_ROWS_HINT)
    return lambda rows: packed if rows <= LARGE_ROWS else packed_large


def _in_compute_dtype(linear: LinearFn, compute: torch.dtype, out: torch.dtype) -> LinearFn:
    """`linear` (a oneDNN product in `compute`) taking and returning tensors of the model dtype `out`."""
    if compute == out:
        return linear
    return lambda x: linear(x.to(compute)).to(out)


def make_linear(weight: torch.Tensor | Quantized, large_rows: bool = True) -> LinearFn:
    """A function computing F.linear(x, weight) (no bias), as fast as this device allows; `large_rows`:
    it may be given more than LARGE_ROWS rows (see _packed_for_rows)."""
    if isinstance(weight, QuantizedTensor | StackedQuantizedTensor):
        batched_product_kernel()  # sets the quantized products' choice too
        return make_quantized_linear(weight)
    compute = _onednn_compute_dtype(weight)
    if compute is None:
        return lambda x: F.linear(x, weight)
    packed = _packed_for_rows(weight, compute, large_rows)
    product = _in_compute_dtype(
        lambda x: torch.ops.mkldnn._linear_pointwise(x, packed(x.shape[0]), None, "none", [], ""),
        compute,
        weight.dtype,
    )
    return _with_few_row_kernels(weight, product)


def make_gated_up(weight: torch.Tensor | Quantized, silu_mul: LinearFn) -> LinearFn:
    """A function computing silu(x @ gate^T) * (x @ up^T) for weight = [gate; up] ([2I, K]), where
    `silu_mul` maps the product [T, 2I] to that. Its kernels apply the silu and the multiplication to
    the float32 results while they are in cache; a separate silu_mul pass read the [T, 2I] product back
    from memory. linear_amx does it in its epilogue; oneDNN, for more rows (prefill chunks), as two products
    with a silu and a multiply epilogue (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
    The GEMV (1-2 rows) stays a product and a silu_mul."""
    if isinstance(weight, QuantizedTensor | StackedQuantizedTensor):
        batched_product_kernel()  # sets the quantized products' choice too
        return make_quantized_linear(weight, silu_mul)
    compute = _onednn_compute_dtype(weight)
    if compute is None:
        return lambda x: silu_mul(F.linear(x, weight))
    if not _onednn_epilogues_work(compute):
        gate_up = make_linear(weight)
        return lambda x: silu_mul(gate_up(x))
    gate, up = (_packed_for_rows(half.contiguous(), compute) for half in weight.chunk(2))

    def many_rows(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        silu_gate = torch.ops.mkldnn._linear_pointwise(x, gate(rows), None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, silu_gate, up(rows), None, "mul")

    return _with_few_row_kernels(weight, _in_compute_dtype(many_rows, compute, weight.dtype), silu_mul)


@dataclass(frozen=True)
class GatedAfterProduct:
    """act(gate) * up where the product kernels do not gate with act (they gate with silu only): `gating`
    (gelu_tanh_mul for Gemma) on the [T, 2I] result of `product` (W = [gate; up]). The compiled decode
    step takes `product` and gates its result the same way (decode_layers' gelu_tanh)."""

    product: LinearFn
    gating: LinearFn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gating(self.product(x))


# Where the CPU has no AMX: which kernel multiplies bf16 batches of 3 to AMX_MAX_ROWS rows. "auto" (the
# default) probes each on this CPU; "fma" (linear_tiles_fma on widened float32 FMAs), "dpbf16" (the same
# tiles on VDPBF16PS, where the build has AVX512-BF16) and "onednn" force one (tests and benchmarks of
# each path).
BATCHED_PRODUCT_ENV = "KVSERVE_BATCHED_PRODUCT"
BATCHED_PRODUCT_SETTINGS = ("auto", "fma", "dpbf16", "onednn")
TILE_PRODUCTS = ("amx", "fma", "dpbf16")  # the kernels that read pack_tiles' layout
# The probe's product: a decode batch through an MLP-sized matrix (SmolLM2's down projection); the
# second probe's: a long prefill chunk through a smaller matrix, to keep that probe short.
PROBE_ROWS, PROBE_OUT, PROBE_IN = 64, 576, 1536
PROBE_LONG_ROWS, PROBE_LONG_SIZE = 1024, 512
PROBE_REPEATS = 7  # timed calls of each kernel per probe, the kernels in turn (the median decides)


@dataclass(frozen=True)
class BatchedProducts:
    """The process's products of bf16 batches (batched_products)."""

    kernel: str  # "amx", "fma", "dpbf16" or "onednn": batches of 3 to AMX_MAX_ROWS rows
    long_chunks: bool  # whether longer prefill chunks take the same tiles (else oneDNN)
    # The tile form ("fma", "dpbf16") of quant_linear's panels (quantized weights have no oneDNN product),
    # or None where they take none (AMX's own tiles; no tile kernels; KVSERVE_BATCHED_PRODUCT=onednn).
    panels: str | None = None


@functools.cache
def batched_products() -> BatchedProducts:
    """Which kernel multiplies bf16 batches of 3 to AMX_MAX_ROWS rows on this CPU, and whether it takes
    longer chunks too. With AMX linear_amx (long chunks on oneDNN). Without, the fastest on a probe product
    of linear_tiles_fma's two forms (float32 FMAs; VDPBF16PS where the build has AVX512-BF16) and oneDNN's
    packed product (bf16, or float32 where it has no bf16 kernel), timed once per process (a few
    milliseconds), unless KVSERVE_BATCHED_PRODUCT forces one; then, for the tiles, a second probe at
    PROBE_LONG_ROWS rows against oneDNN for long chunks (forcing a tile form forces that too). Which wins
    depends on the CPU: AMD's Zen 4 issues VDPBF16PS at its FMA rate, Intel's cores at half of it
    (benchmarks/RESULTS.md, "FMA tiles", "VDPBF16PS tiles", "Both tile forms, chosen by a probe"). The
    quantized products of bf16 rows take the faster tile form of the same probe (set_tile_products) even
    where oneDNN wins it: oneDNN has no product of quantized weights, and their other product ran 1.1-1.25x
    slower than the tiles on Zen 4 (RESULTS.md, "Quantized panels on the probe's faster tile form")."""
    kernels = gemv_kernels()
    if kernels is None:
        return BatchedProducts("onednn", False)
    if kernels.amx_available():
        return BatchedProducts("amx", False)
    setting = os.environ.get(BATCHED_PRODUCT_ENV, "auto")
    forms = ("fma", "dpbf16") if kernels.TILES_HAVE_BF16_PAIRS else ("fma",)
    if setting not in BATCHED_PRODUCT_SETTINGS or (setting == "dpbf16" and "dpbf16" not in forms):
        allowed = [name for name in BATCHED_PRODUCT_SETTINGS if name != "dpbf16" or "dpbf16" in forms]
        raise ValueError(f"{BATCHED_PRODUCT_ENV}={setting!r}: expected one of {', '.join(allowed)} on this build")
    compute = _onednn_compute_dtype(torch.empty(0, dtype=torch.bfloat16))
    if setting != "auto":
        kernel, long_chunks = setting, setting != "onednn"
        panels = setting if setting in forms else None
    else:
        candidates = forms if compute is None else (*forms, "onednn")  # None: no oneDNN product to compare
        times = _probe(kernels, candidates, compute, PROBE_ROWS, PROBE_OUT, PROBE_IN)
        kernel = min(times, key=times.__getitem__)
        panels = min(forms, key=times.__getitem__)
        long_chunks = compute is None or (
            kernel != "onednn"
            and _fastest(kernels, (kernel, "onednn"), compute, PROBE_LONG_ROWS, PROBE_LONG_SIZE, PROBE_LONG_SIZE)
            == kernel
        )
    kernels.set_tile_products(panels=panels is not None, long_chunks=long_chunks, bf16_pairs=panels == "dpbf16")
    return BatchedProducts(kernel, long_chunks, panels)


def batched_product_kernel() -> str:
    """batched_products().kernel: "amx", "fma", "dpbf16" or "onednn"."""
    return batched_products().kernel


def long_chunks_on_tiles() -> bool:
    """Whether products of more than AMX_MAX_ROWS rows (long prefill chunks) take the tiles of the CPU
    without AMX too (batched_products)."""
    return batched_products().long_chunks


def _fastest(
    kernels: ModuleType, candidates: tuple[str, ...], compute: torch.dtype | None, rows: int, n: int, k: int
) -> str:
    """The candidate of _probe's that took the least time."""
    times = _probe(kernels, candidates, compute, rows, n, k)
    return min(times, key=times.__getitem__)


def _probe(
    kernels: ModuleType, candidates: tuple[str, ...], compute: torch.dtype | None, rows: int, n: int, k: int
) -> dict[str, float]:
    """The median milliseconds in which each candidate ("fma", "dpbf16", "onednn") multiplies `rows` random
    bf16 rows by an [n, k] weight, oneDNN as make_linear runs it (in `compute`); timed in turn, call by call,
    so that a change in the machine's speed during the probe hits each alike."""
    weight = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    tiles = pack_tiles(weight)
    calls: dict[str, Callable[[], object]] = {}
    for name in candidates:
        if name == "onednn":
            assert compute is not None
            calls[name] = functools.partial(_onednn_product(weight, compute), x)
        else:
            calls[name] = functools.partial(_tiles_in_form, kernels, name == "dpbf16", x, tiles)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for call in calls.values():
        call()  # warms caches, lets oneDNN create its primitive
    for _ in range(PROBE_REPEATS):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    logger.info(
        "bf16 products of %d x %d x %d: %s",
        rows,
        n,
        k,
        ", ".join(f"{ms:.3f} ms on {name}" for name, ms in medians.items()),
    )
    return medians


def _onednn_product(weight: torch.Tensor, compute: torch.dtype) -> LinearFn:
    """oneDNN's packed product of bf16 rows by `weight`, in `compute`, as make_linear runs it."""
    packed = _onednn_pack(weight, compute, PACKING_ROWS_HINT[compute])

    def product(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    return _in_compute_dtype(product, compute, torch.bfloat16)


def _tiles_in_form(kernels: ModuleType, bf16_pairs: bool, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    kernels.set_tile_products(panels=False, long_chunks=False, bf16_pairs=bf16_pairs)
    return kernels.linear_tiles_fma(x, tiles)


@dataclass(frozen=True)
class KernelLinear:
    """A bf16 linear on kvserve's own kernels where they take the rows: up to GEMV_MAX_ROWS the GEMV,
    then the packed `tiles` where they are set (linear_amx on AMX, else linear_tiles_fma:
    batched_product_kernel) up to AMX_MAX_ROWS, or any number where the FMA tiles take long chunks too
    (long_chunks_on_tiles), `many_rows` beyond. With `silu_mul` (weight = [gate; up])
    the result is silu(gate) * up: the GEMV's product goes through silu_mul, the tile kernels gate in
    their epilogue (`tiles` then hold the halves interleaved). The compiled decode step
    (kernels/cpu/decode_layers.cpp) makes the same choice from `weight` and `tiles`."""

    kernels: ModuleType
    weight: torch.Tensor
    tiles: torch.Tensor | None
    tiles_max_rows: int | None  # the most rows the tiles take (None: any number)
    many_rows: LinearFn
    silu_mul: LinearFn | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.kernels.GEMV_MAX_ROWS:
            y = self.kernels.gemv_bf16(x, self.weight)
            return y if self.silu_mul is None else self.silu_mul(y)
        if self.tiles is not None and (self.tiles_max_rows is None or rows <= self.tiles_max_rows):
            tile_product = self.kernels.linear_amx if self.amx else self.kernels.linear_tiles_fma
            return tile_product(x.contiguous(), self.tiles, self.silu_mul is not None)
        return self.many_rows(x)

    @property
    def amx(self) -> bool:
        """Whether the tiles run on linear_amx (whose cost goes by blocks of AMX_ROW_BLOCK rows)."""
        return self.tiles is not None and self.kernels.amx_available()


def _with_few_row_kernels(weight: torch.Tensor, many_rows: LinearFn, silu_mul: LinearFn | None = None) -> LinearFn:
    """`many_rows`, wrapped in a KernelLinear where kvserve's kernels run here."""
    kernels = gemv_kernels()
    if kernels is None or weight.dtype != torch.bfloat16:
        return many_rows
    n, k = weight.shape
    tiled = batched_product_kernel() in TILE_PRODUCTS and n % AMX_ALIGN == 0 and k % AMX_ALIGN == 0
    tiles = pack_tiles(_interleave_halves(weight) if silu_mul is not None else weight) if tiled else None
    max_rows = None if long_chunks_on_tiles() else AMX_MAX_ROWS
    return KernelLinear(kernels, weight, tiles, max_rows, many_rows, silu_mul)


def _interleave_halves(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] with rows reordered gate 0-15, up 0-15, gate 16-31, up 16-31, ...: so that each of
    linear_amx's 32-column blocks holds 16 gate columns and their up columns (its gated epilogue)."""
    n, k = weight.shape
    return weight.view(2, n // AMX_ALIGN, AMX_ALIGN // 2, k).transpose(0, 1).reshape(n, k)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] as linear_amx's B tiles (which linear_tiles_fma reads too): [N/16, K/32, 512], tile (j, s)
    holding columns 16j.. and k steps 32s.. with element (n, k) at (k // 2) * 32 + n * 2 + k % 2 (k-pairs
    of one column adjacent)."""
    n, k = weight.shape
    # reshape copies (the permuted view is not viewable as 3-D): an owned tensor, no base to keep alive.
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 512)
