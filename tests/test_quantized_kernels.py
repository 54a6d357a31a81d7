"""kvserve's quantized-weight kernels (kernels/cpu/quant_*.cpp) against gguf's reference dequantization
(gguf.quants.dequantize) followed by a float64 matmul, over random shapes and random blocks: random
bytes everywhere, then f16 scales set to the edges of their range (0, the largest finite, the smallest
normal and subnormal, negative), whole zero blocks and all-0 / all-15 nibbles.

Tolerances, and why:
- dequantize_rows: bit-identical (the same float32 operations as the reference).
- quant_linear: the same float32 weights, summed in another order: 1e-5 of sum |w x| (plus one
  bf16 rounding of the result for bf16 activations). For bf16 activations on a path with native bf16
  products (AMX, AVX512-BF16) the weights are first rounded to bf16, as the dense bf16 engine holds them
  (quant_linear_bf16.cpp, tiles_fma.h's VDPBF16PS form where the tile products are on: set_tile_products,
  and long chunks, W dequantized whole into bf16): the reference rounds them too. Elsewhere (the tiles'
  float32 form, AVX2) bf16 x meets the float32 weights. Each setting is tested.
- quant_gemv quantizes each 32 elements of x to int8 (step s = max |x| / 127, rounding to nearest), so
  each x moves by at most s / 2 and the result by at most sum over x blocks of s / 2 * sum |w| over the
  block: that bound, plus the float32 slack and bf16 rounding above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.kernels import cpu
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model.quantized import KERNEL_TYPES, ROW_GROUP_ROWS, ROW_GROUP_TYPES, QuantizedTensor
from kvserve.model.quantized_linear import quantized_kernels

# quant_linear.cpp's kLongChunkRows: bf16 chunks of more rows multiply W dequantized whole into bf16.
LONG_CHUNK_ROWS = 512
# Byte offsets of each type's f16 scale fields within a block (quant_blocks.h has the layouts).
SCALE_FIELDS = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}
# Where each type's packed 4-bit values lie (the all-0 / all-15 nibble rows).
NIBBLE_BYTES = {
    GGMLQuantizationType.Q4_0: slice(2, 18),
    GGMLQuantizationType.Q4_1: slice(4, 20),
    GGMLQuantizationType.Q5_0: slice(6, 22),
    GGMLQuantizationType.Q4_K: slice(16, 144),
    GGMLQuantizationType.Q6_K: slice(0, 128),  # ql; its qh bit pairs above them stay random
}
EDGE_SCALES = np.array([0.0, 65504.0, -65504.0, 2.0**-14, 2.0**-24, -(2.0**-24), 1.0], dtype=np.float16)


@pytest.fixture(scope="module")
def kernels():
    built = cpu.load()
    assert built is not None, "the CPU kernels must build on the machines kvserve is tested on"
    return built


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: random bytes, scales mostly ordinary (1e-3 to 0.1, either sign) and some at
    the edges; row 0 zero, row 1 all-0 nibbles, row 2 all-15 nibbles where the type has nibbles."""
    elems, size = GGML_QUANT_SIZES[qtype]
    blocks = gen.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        scales = gen.uniform(1e-3, 0.1, size=(n, k // elems)) * gen.choice([-1, 1], size=(n, k // elems))
        scales = scales.astype(np.float16)
        edge = gen.random(size=scales.shape) < 0.15
        scales[edge] = gen.choice(EDGE_SCALES, size=int(edge.sum()))
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    if n > 0:
        blocks[0] = 0
    if qtype in NIBBLE_BYTES and n > 2:
        blocks[1, :, NIBBLE_BYTES[qtype]] = 0x00
        blocks[2, :, NIBBLE_BYTES[qtype]] = 0xFF
    return blocks.reshape(n, -1)


def reference(blocks: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    return QuantizedTensor(torch.from_numpy(blocks), qtype, (n, k)).dequantize()


def random_case(qtype: GGMLQuantizationType, seed: int, max_rows: int) -> tuple:
    gen = np.random.default_rng(seed)
    elems = GGML_QUANT_SIZES[qtype][0]
    n, k = int(gen.integers(1, 70)), elems * int(gen.integers(1, 7 if elems == 32 else 3))
    rows = int(gen.integers(1, max_rows + 1))
    blocks = random_blocks(qtype, n, k, gen)
    x = torch.from_numpy(gen.standard_normal((rows, k)).astype(np.float32)) * float(gen.choice([1e-3, 1.0, 50.0]))
    return blocks, n, k, x


def within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    return bool(((y.double() - ref).abs() <= bound).all())


def float_slack(w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    slack = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    return slack + (2.0**-8 * ref.abs() if dtype == torch.bfloat16 else 0.0)


@dataclass(frozen=True)
class TileProducts:
    """quant_linear's products of bf16 x without AMX (set_tile_products)."""

    panels: bool  # on the tiles' register blocks, else on quant_linear_bf16's VDPBF16PS dots
    bf16_pairs: bool  # the register blocks on VDPBF16PS, else on float32 FMAs
    long_chunks: bool  # chunks past LONG_CHUNK_ROWS on linear_tiles_fma, else on oneDNN (with the panels on)


@pytest.fixture(
    params=[TileProducts(False, False, False), TileProducts(True, False, True), TileProducts(True, True, False)],
    ids=["tiles off", "tiles on float32 FMAs, long chunks too", "tiles on VDPBF16PS, long chunks on oneDNN"],
)
def tile_products(request, kernels) -> TileProducts:
    """One setting for one test; the process's own is restored after."""
    setting = request.param
    if setting.bf16_pairs and not kernels.TILES_HAVE_BF16_PAIRS:
        pytest.skip("this build has no VDPBF16PS form of the tiles")
    previous = kernels.tile_products()
    kernels.set_tile_products(setting.panels, setting.long_chunks, setting.bf16_pairs)
    yield setting
    kernels.set_tile_products(*previous)


def multiplied_weights(w: torch.Tensor, dtype: torch.dtype, tiles: TileProducts, rows: int = 1) -> torch.Tensor:
    """The weights quant_linear multiplies `rows` rows of x with: w, or w rounded to bf16 (see the module
    docstring)."""
    if dtype != torch.bfloat16 or not cpu_isa.selected().bf16:
        return w
    kernels = cpu.load()
    float_tiles = tiles.panels and not tiles.bf16_pairs and not kernels.amx_available()
    return w if float_tiles and rows <= LONG_CHUNK_ROWS else w.bfloat16().float()


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_bit_identical(kernels, qtype: GGMLQuantizationType) -> None:
    for seed in range(3):
        blocks, n, k, _ = random_case(qtype, seed, 1)
        ids = torch.from_numpy(np.random.default_rng(seed).integers(0, n, size=2 * n))  # any order, repeats
        ours = kernels.dequantize_rows(torch.from_numpy(blocks), ids, int(qtype))
        torch.testing.assert_close(ours, reference(blocks, qtype, n, k)[ids], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_quant_linear_matches_dequantize_then_matmul(kernels, tile_products, qtype, dtype: torch.dtype) -> None:
    for seed in range(4):
        blocks, n, k, x = random_case(qtype, 10 + seed, 40 if seed == 0 else 9)
        x = x.to(dtype)
        w = multiplied_weights(reference(blocks, qtype, n, k), dtype, tile_products)
        ref = x.double() @ w.double().T
        y = kernels.quant_linear(x, torch.from_numpy(blocks), int(qtype))
        assert y.dtype == dtype and y.shape == ref.shape
        assert within(y, ref, float_slack(w, x, ref, dtype)), f"seed {seed}"


# quant_gemv has no portable form: on the generic path (KVSERVE_CPU_ISA=generic, kernels/cpu/isa.py) it
# refuses, and quantized weights are dequantized at load instead (quantized_linear.quantized_kernels).
needs_quant_gemv = pytest.mark.skipif(
    quantized_kernels() is None, reason="quant_gemv needs AVX2, FMA and F16C, and this build has none of them"
)


@needs_quant_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_quant_gemv_within_the_int8_activation_bound(kernels, qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    for seed in range(4):
        blocks, n, k, x = random_case(qtype, 20 + seed, GEMV_TEST_ROWS)
        x = x.to(dtype)
        w = reference(blocks, qtype, n, k)
        ref = x.double() @ w.double().T
        y = kernels.quant_gemv(x, torch.from_numpy(blocks), int(qtype))
        assert y.dtype == dtype and y.shape == ref.shape
        assert within(y, ref, int8_bound(w, x, ref, dtype)), f"seed {seed}"


# Rows of x in the GEMV tests: up to two chunks of the widest row chunk (four) and a remainder.
GEMV_TEST_ROWS = 11


def int8_bound(w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far x's rounding to int8 per 32 elements may move each result (the module docstring)."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 127  # [rows, K/32]
    block_abs_w = w.double().abs().view(w.shape[0], -1, 32).sum(-1)  # [N, K/32]
    return (step / 2) @ block_abs_w.T * (1 + 1e-4) + float_slack(w, x, ref, dtype)


@needs_quant_gemv
def test_quant_gemv_is_not_loose(kernels) -> None:
    """The bound above is not vacuous: on ordinary data the int8 activations err by ~0.5 % of the
    result's norm, where dequantize-then-matmul in float32 errs by ~1e-7."""
    gen = np.random.default_rng(5)
    qtype = GGMLQuantizationType.Q4_1
    blocks = random_blocks(qtype, 256, 576, gen)
    blocks[:3] = random_blocks(qtype, 3, 576, np.random.default_rng(6))[2]  # no special rows here
    w = reference(blocks, qtype, 256, 576)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ w.double().T
    error = (kernels.quant_gemv(x, torch.from_numpy(blocks), int(qtype)).double() - ref).norm() / ref.norm()
    assert 1e-4 < error < 2e-2


def test_kernels_refuse_bad_input_by_name(kernels) -> None:
    blocks = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="GGML type 1 "):
        kernels.quant_linear(torch.zeros(1, 32), blocks, 1)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 32\]"):
        kernels.quant_linear(torch.zeros(1, 64), blocks, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="whole number"):
        kernels.dequantize_rows(torch.zeros(4, 21, dtype=torch.uint8), torch.arange(4), int(GGMLQuantizationType.Q4_1))
    for bad_id in (-1, 4):
        with pytest.raises(RuntimeError, match=f"row id {bad_id} is outside the matrix's 4 rows"):
            kernels.dequantize_rows(blocks, torch.tensor([0, bad_id]), int(GGMLQuantizationType.Q4_1))


@needs_quant_gemv
def test_quant_gemv_refuses_no_rows(kernels) -> None:
    blocks = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="one row or more"):
        kernels.quant_gemv(torch.zeros(0, 32), blocks, int(GGMLQuantizationType.Q4_1))


def test_quantized_tensor_rows_and_cat_follow_the_matrix() -> None:
    gen = np.random.default_rng(3)
    qtype = GGMLQuantizationType.Q8_0
    a = QuantizedTensor(torch.from_numpy(random_blocks(qtype, 6, 64, gen)), qtype, (6, 64))
    b = QuantizedTensor(torch.from_numpy(random_blocks(qtype, 2, 64, gen)), qtype, (2, 64))
    order = torch.tensor([5, 0, 3, 1, 2, 4])
    torch.testing.assert_close(a.rows(order).dequantize(), a.dequantize()[order], rtol=0, atol=0)
    fused = QuantizedTensor.cat([a, b])
    assert fused.shape == (8, 64) and fused.nbytes == 8 * 68
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedTensor(a.blocks[:, :60], qtype, (6, 64))
    other = QuantizedTensor(torch.zeros(1, 20, dtype=torch.uint8), GGMLQuantizationType.Q4_1, (1, 32))
    with pytest.raises(ValueError, match="one block type"):
        QuantizedTensor.cat([a, other])


@pytest.mark.parametrize("qtype", ROW_GROUP_TYPES, ids=lambda t: t.name)
def test_row_groups_are_a_permutation_of_the_blocks(qtype: GGMLQuantizationType) -> None:
    gen = np.random.default_rng(7)
    k = 3 * GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, 24, k, gen)
    ggml = QuantizedTensor(torch.from_numpy(blocks), qtype, (24, k))
    grouped = ggml.interleaved()
    assert grouped.row_group == ROW_GROUP_ROWS and grouped.nbytes == ggml.nbytes
    assert grouped.blocks.shape == (3, 8 * blocks.shape[1])
    assert sorted(grouped.blocks.flatten().tolist()) == sorted(blocks.flatten().tolist())
    torch.testing.assert_close(grouped.ggml_blocks(), ggml.blocks, rtol=0, atol=0)
    torch.testing.assert_close(grouped.dequantize(), ggml.dequantize(), rtol=0, atol=0)
    # the layout quant_row_groups.h states: row 3's scale d of block 1, and its qs byte 4 * 2 + 1. A GGML
    # block holds its fields, then its qs (Q6_K: its qs, then its fields); a group block its fields first.
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    group_block = grouped.blocks[0, 8 * block_bytes : 16 * block_bytes].numpy()
    row3_block1 = blocks[3, block_bytes : 2 * block_bytes]
    qs_bytes = {GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q4_K: 128, GGMLQuantizationType.Q6_K: 192}.get(
        qtype, 16
    )
    fields = block_bytes - qs_bytes
    fields_start, qs_start = (qs_bytes, 0) if qtype == GGMLQuantizationType.Q6_K else (0, fields)
    d = SCALE_FIELDS[qtype][0]
    d_in_group = 8 * (d - fields_start) + 2 * 3
    assert bytes(group_block[d_in_group : d_in_group + 2]) == bytes(row3_block1[d : d + 2])
    assert group_block[8 * fields + 32 * 2 + 4 * 3 + 1] == row3_block1[qs_start + 4 * 2 + 1]


@pytest.mark.parametrize("qtype", ROW_GROUP_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_gathers_rows_from_row_groups(kernels, qtype: GGMLQuantizationType) -> None:
    """The embedding's gather from a tied table kept in row groups: any rows, exactly as GGML's layout."""
    gen = np.random.default_rng(9)
    k = 2 * GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, 32, k, gen)
    grouped = QuantizedTensor(torch.from_numpy(blocks), qtype, (32, k)).interleaved()
    ids = torch.tensor([31, 0, 9, 9, 8, 17, 3])
    ours = kernels.dequantize_rows(grouped.blocks, ids, grouped.kernel_type)
    torch.testing.assert_close(ours, reference(blocks, qtype, 32, k)[ids], rtol=0, atol=0)


def test_only_whole_groups_are_interleaved() -> None:
    gen = np.random.default_rng(8)
    odd = QuantizedTensor(torch.from_numpy(random_blocks(GGMLQuantizationType.Q6_K, 12, 256, gen)),
                          GGMLQuantizationType.Q6_K, (12, 256))  # fmt: skip
    assert odd.interleaved() is odd
    with pytest.raises(ValueError, match="row groups of 8"):  # 12 rows are not whole groups of 8
        QuantizedTensor(
            torch.zeros(1, 8 * 210, dtype=torch.uint8), GGMLQuantizationType.Q6_K, (12, 256), ROW_GROUP_ROWS
        )


def row_group_case(qtype: GGMLQuantizationType, seed: int, max_rows: int) -> tuple:
    """random_case's matrix with N a whole number of row groups, and it in row groups."""
    gen = np.random.default_rng(seed)
    n, k = ROW_GROUP_ROWS * int(gen.integers(1, 9)), GGML_QUANT_SIZES[qtype][0] * int(gen.integers(1, 7))
    blocks = random_blocks(qtype, n, k, gen)
    x = torch.from_numpy(gen.standard_normal((int(gen.integers(1, max_rows + 1)), k)).astype(np.float32))
    grouped = QuantizedTensor(torch.from_numpy(blocks), qtype, (n, k)).interleaved()
    return blocks, grouped, x * float(gen.choice([1e-3, 1.0, 50.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ROW_GROUP_TYPES, ids=lambda t: t.name)
def test_quant_linear_on_row_groups_matches_dequantize_then_matmul(kernels, tile_products, qtype, dtype) -> None:
    for seed in range(4):
        blocks, grouped, x = row_group_case(qtype, 30 + seed, 40 if seed == 0 else 9)
        x = x.to(dtype)
        w = multiplied_weights(reference(blocks, qtype, *grouped.shape), dtype, tile_products)
        ref = x.double() @ w.double().T
        y = kernels.quant_linear(x, grouped.blocks, grouped.kernel_type)
        assert y.dtype == dtype and y.shape == ref.shape
        assert within(y, ref, float_slack(w, x, ref, dtype)), f"seed {seed}"


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_quant_linear_rows_are_the_same_whatever_the_rows_beside_them(kernels, tile_products, qtype) -> None:
    """bf16 rows of x at every tail of the panels' 32-row pairs of x: each row's products equal
    dequantize-then-matmul's within float slack, and are the same bits as in a product of more rows (the
    zero rows padding x's last pair, and the rows beside, take no part in them), gated (silu(gate) * up in
    the kernel) and not."""
    gen = np.random.default_rng(80)
    n, k = 64, 96
    blocks = random_blocks(qtype, n, k, gen)
    grouped = QuantizedTensor(torch.from_numpy(blocks), qtype, (n, k)).interleaved()
    x = torch.from_numpy(gen.standard_normal((49, k)).astype(np.float32)).bfloat16()
    w = multiplied_weights(reference(blocks, qtype, n, k), torch.bfloat16, tile_products)
    for gated in (False, True):
        whole = kernels.quant_linear(x, grouped.blocks, grouped.kernel_type, gated)
        for rows in (3, 16, 17, 31, 32, 33, 48):
            part = kernels.quant_linear(x[:rows], grouped.blocks, grouped.kernel_type, gated)
            torch.testing.assert_close(part, whole[:rows], rtol=0, atol=0)
    ref = x.double() @ w.double().T
    plain = kernels.quant_linear(x, grouped.blocks, grouped.kernel_type)
    assert within(plain, ref, float_slack(w, x, ref, torch.bfloat16))


@needs_quant_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ROW_GROUP_TYPES, ids=lambda t: t.name)
def test_quant_gemv_on_row_groups_equals_it_on_ggml_blocks(kernels, qtype, dtype) -> None:
    """The same int8 activations and the same integer products: the two layouts differ only in the order
    of a few float32 sums per output, so they agree to float32 rounding of the result's terms."""
    for seed in range(6):
        blocks, grouped, x = row_group_case(qtype, 40 + seed, GEMV_TEST_ROWS)
        x = x.to(dtype)
        w = reference(blocks, qtype, *grouped.shape)
        ours = kernels.quant_gemv(x, grouped.blocks, grouped.kernel_type)
        ggml = kernels.quant_gemv(x, torch.from_numpy(blocks), int(qtype))
        assert ours.dtype == dtype and ours.shape == ggml.shape
        slack = float_slack(w, x, ggml.double(), dtype)
        assert within(ours, ggml.double(), slack), f"seed {seed}"


@needs_quant_gemv
@pytest.mark.parametrize("qtype", ROW_GROUP_TYPES, ids=lambda t: t.name)
def test_quant_gemv_on_row_groups_covers_every_tile_and_its_tail(kernels, qtype: GGMLQuantizationType) -> None:
    """The row-group GEMV multiplies tiles of up to four groups (on AVX-512 with VNNI: 512-bit vectors of two
    groups, two vectors per tile for Q8_0, where x has two chunks of four rows or more) and narrower tiles for
    each thread's last groups. With nine rows, every group count from 1 to 9 gives the GGML layout's results,
    and its gated form silu_mul of them exactly."""
    gen = np.random.default_rng(80)
    k = GGML_QUANT_SIZES[qtype][0] * 2
    x = torch.from_numpy(gen.standard_normal((9, k)).astype(np.float32))
    for groups in range(1, 10):
        n = ROW_GROUP_ROWS * groups
        blocks = random_blocks(qtype, n, k, gen)
        grouped = QuantizedTensor(torch.from_numpy(blocks), qtype, (n, k)).interleaved()
        ours = kernels.quant_gemv(x, grouped.blocks, grouped.kernel_type)
        ggml = kernels.quant_gemv(x, torch.from_numpy(blocks), int(qtype))
        slack = float_slack(reference(blocks, qtype, n, k), x, ggml.double(), torch.float32)
        assert within(ours, ggml.double(), slack), f"{groups} groups"
        gate_up_blocks = torch.from_numpy(random_blocks(qtype, 2 * n, k, gen))
        gate_up = QuantizedTensor(gate_up_blocks, qtype, (2 * n, k)).interleaved()
        gated = kernels.quant_gemv(x, gate_up.blocks, gate_up.kernel_type, True)
        product = kernels.quant_gemv(x, gate_up.blocks, gate_up.kernel_type)
        torch.testing.assert_close(gated, kernels.silu_mul(product), rtol=0, atol=0, msg=f"{groups} groups, gated")


@needs_quant_gemv
@pytest.mark.parametrize("in_groups", [False, True], ids=["GGML's layout", "row groups"])
@pytest.mark.parametrize("qtype", ROW_GROUP_TYPES, ids=lambda t: t.name)
def test_quant_gemv_rows_of_a_batch_are_each_row_alone(kernels, qtype, in_groups) -> None:
    """A decode batch's rows (here 1,120 blocks of x, which the kernel quantizes on all threads) give the
    same bits as each row multiplied alone (one thread quantizes it), and lie within the int8 bound. The
    batch takes the forms a lone row does not: chunks of rows with x broadcast inside the dots and, in row
    groups of every type but Q4_0 and Q4_1, sweeps of 16 rows over each unpacked block (70 rows: four sweeps,
    then chunks of four and two); Q4_0, Q4_1 and Q8_0 in row groups without VNNI, chunks of four rows that
    meet their blocks' values load by load, and a last chunk of two as a lone row's; gated too (W = [gate; up])."""
    gen = np.random.default_rng(90)
    n, k, rows = 64, 512, 70
    blocks = random_blocks(qtype, n, k, gen)
    weights = QuantizedTensor(torch.from_numpy(blocks), qtype, (n, k))
    if in_groups:
        weights = weights.interleaved()
    x = torch.from_numpy(gen.standard_normal((rows, k)).astype(np.float32))
    for gated in (False, True):
        whole = kernels.quant_gemv(x, weights.blocks, weights.kernel_type, gated)
        alone = [kernels.quant_gemv(x[i : i + 1], weights.blocks, weights.kernel_type, gated) for i in range(rows)]
        torch.testing.assert_close(whole, torch.cat(alone), rtol=0, atol=0, msg=f"gated {gated}")
    w = reference(blocks, qtype, n, k)
    ref = x.double() @ w.double().T
    assert within(kernels.quant_gemv(x, weights.blocks, weights.kernel_type), ref, int8_bound(w, x, ref, torch.float32))


@needs_quant_gemv
@pytest.mark.parametrize("decode_step", [False, True], ids=["prefill step", "decode step"])
@pytest.mark.parametrize("in_groups", [False, True], ids=["GGML's layout", "row groups"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_1], ids=lambda t: t.name)
def test_quant_product_is_the_gemv_up_to_its_rows_and_the_panel_product_above(
    kernels, qtype, in_groups, decode_step
) -> None:
    gen = np.random.default_rng(60)
    n, k = 16, 256
    grouped = QuantizedTensor(torch.from_numpy(random_blocks(qtype, n, k, gen)), qtype, (n, k))
    if in_groups:
        grouped = grouped.interleaved()
    x = torch.from_numpy(gen.standard_normal((1, k)).astype(np.float32))
    int8_rows = kernels.int8_max_rows(grouped.kernel_type)
    grouped_rows = 128  # row groups: fewer where AMX makes panels cheap, fewest for Q6_K's costlier GEMV
    if kernels.amx_available():
        grouped_rows = 8 if qtype == GGMLQuantizationType.Q6_K else 16
    assert int8_rows == (grouped_rows if in_groups else 8)
    most = int8_rows if decode_step else kernels.GEMV_MAX_ROWS
    for rows in sorted({1, 2, 3, most - 1, most, most + 1, most + 7}):
        xs = torch.cat([x * (i + 1) for i in range(rows)])
        kernel = kernels.quant_gemv if rows <= most else kernels.quant_linear
        expected = kernel(xs, grouped.blocks, grouped.kernel_type)
        ours = kernels.quant_product(xs, grouped.blocks, grouped.kernel_type, decode_step)
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@needs_quant_gemv
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0],
                         ids=lambda t: t.name)  # fmt: skip
def test_gated_products_are_silu_mul_of_the_product(kernels, qtype: GGMLQuantizationType) -> None:
    """quant_product(gated) of W = [gate; up] is silu_mul of its product. On row groups whose halves are whole
    groups the GEMV gates inside the kernel, from the float32 results, so in bf16 it equals silu_mul of the
    float32 product rounded once; elsewhere (GGML's layout, halves of odd group counts) silu_mul follows the
    product in x's dtype. float32 x: at every row count (the panel product's float32 form gates after it);
    bf16 panels gate inside too, checked against the reference in test_long_chunks_match_dequantize_then_matmul."""
    gen = np.random.default_rng(70)
    for n in (48, 24):  # halves of 3 groups (gated in the kernel), of 1.5 groups (silu_mul after)
        k = 96
        ggml = QuantizedTensor(torch.from_numpy(random_blocks(qtype, n, k, gen)), qtype, (n, k))
        weight = ggml.interleaved()
        most = kernels.int8_max_rows(weight.kernel_type)
        for rows in (1, 5, most + 1):
            x = torch.from_numpy(gen.standard_normal((rows, k)).astype(np.float32))
            product = kernels.quant_product(x, weight.blocks, weight.kernel_type, True)
            gated = kernels.quant_product(x, weight.blocks, weight.kernel_type, True, gated=True)
            torch.testing.assert_close(gated, kernels.silu_mul(product), rtol=0, atol=0)
            if rows > most:
                continue
            in_kernel = weight.row_group > 1 and n % 16 == 0
            x16 = x.bfloat16()
            gated = kernels.quant_product(x16, weight.blocks, weight.kernel_type, True, gated=True)
            product = kernels.quant_product(x16.float() if in_kernel else x16, weight.blocks, weight.kernel_type, True)
            torch.testing.assert_close(gated, kernels.silu_mul(product).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
def test_long_chunks_match_dequantize_then_matmul(kernels, tile_products, qtype: GGMLQuantizationType) -> None:
    """bf16 rows at and past 512 (a long prefill chunk): with AMX, or on AVX512-BF16 without AMX with the
    tile products on, 512 rows take the panels (AMX tiles or packed x, gated inside them) and more W
    dequantized whole into bf16 for the dense engine's product (oneDNN's or the tiles', quant_linear.cpp);
    elsewhere the panels of the other forms. One reference for all, gated or not."""
    gen = np.random.default_rng(80)
    n, k = 64, 256
    ggml = QuantizedTensor(torch.from_numpy(random_blocks(qtype, n, k, gen)), qtype, (n, k))
    weight = ggml.interleaved()
    for rows in (512, 513, 700):
        x = torch.from_numpy(gen.standard_normal((rows, k)).astype(np.float32)).bfloat16()
        w = multiplied_weights(ggml.dequantize(), torch.bfloat16, tile_products, rows)
        ref = x.double() @ w.double().T
        y = kernels.quant_linear(x, weight.blocks, weight.kernel_type)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        assert within(y, ref, float_slack(w, x, ref, torch.bfloat16)), f"{rows} rows"
        gated = kernels.quant_linear(x, weight.blocks, weight.kernel_type, gated=True).double()
        gate, up = ref[:, : n // 2], ref[:, n // 2 :]
        expected = gate * torch.sigmoid(gate) * up
        slack = float_slack(w, x, ref, torch.bfloat16)
        bound = (slack[:, : n // 2] * up.abs() + slack[:, n // 2 :] * gate.abs()) * 2 + 2.0**-7 * expected.abs() + 1e-6
        assert within(gated, expected, bound), f"{rows} rows, gated"
