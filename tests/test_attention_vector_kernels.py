"""The vector decode attention kernels that replace the widened float32 kernel (decode_attention.cpp) where
they apply: decode_attention_bf16.cpp (AVX512-BF16, bf16 caches) and decode_attention_avx2.cpp (the avx2
path's build, bf16 and float32 caches). Each against the float64 oracle and against the widened kernel, both
in one build (set_bf16_attention, set_avx2_attention). On AMX CPUs the AMX kernel is switched off for these
tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention_cpu import BF16_PREFILL_MAX_KEYS, cpu_attention
from kvserve.kernels.attention_ref import climbing_score_inputs, paged_reference_attention, random_paged_inputs
from kvserve.kernels.cpu import isa as cpu_isa


@dataclass(frozen=True)
class VectorKernel:
    built_on_path: Callable[[], bool]  # whether the selected path's build has the kernel
    switch_name: str
    cache_dtypes: tuple[torch.dtype, ...]  # the caches it takes; the widened kernel takes the others
    # Whether its bf16 outputs always differ in bits from the widened kernel's: the bf16 kernel rounds its
    # probabilities to bf16; the AVX2 kernel's float32 sums often round to the widened kernel's bf16 outputs.
    bf16_outputs_differ: bool


VECTOR_KERNELS = {
    "bf16": VectorKernel(lambda: cpu_isa.selected().bf16, "set_bf16_attention", (torch.bfloat16,), True),
    "avx2": VectorKernel(
        lambda: cpu_isa.selected().isa.name == "avx2", "set_avx2_attention", (torch.bfloat16, torch.float32), False
    ),
}


@dataclass
class SwitchedKernel:
    kernel: VectorKernel
    switch: Callable[[bool], bool]


@pytest.fixture(params=sorted(VECTOR_KERNELS))
def vector_kernel(request):
    """The kernel and its switch (on at the start), with the AMX kernel off; skips where the path lacks it."""
    built = cpu.load()
    kernel = VECTOR_KERNELS[request.param]
    if built is None or not kernel.built_on_path():
        pytest.skip(f"the selected path has no {request.param} attention kernel (KVSERVE_CPU_ISA may force another)")
    previous_amx = built.set_amx_attention(False)
    switch = getattr(built, kernel.switch_name)
    switch(True)
    yield SwitchedKernel(kernel, switch)
    built.set_amx_attention(previous_amx)
    switch(True)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES = [
    # (query_lens, seq_lens, heads, kv_heads, head_dim, block_size, window)
    # decode at tile and block edges, a fresh one-key sequence; whole sequences per work item (4+ sequences)
    ([1, 1, 1, 1], [1, 16, 17, 33], 9, 3, 64, 16, None),
    # verify rows of 1-8 tokens: 24 rows per KV head, three passes of the P.V rows held in registers
    ([1, 4, 8, 1, 3, 6], [90, 4, 100, 33, 300, 64], 9, 3, 64, 16, None),
    # head dim 32; blocks of 5, so tiles of 5 keys; one KV head per work item (3 sequences)
    ([1, 5, 2], [37, 70, 130], 4, 2, 32, 5, None),
    # one-key blocks, GQA 8:1, head dim 128
    ([1, 3], [70, 41], 8, 1, 128, 1, None),
    # Gemma 3 270M's head dim 256; blocks of two tiles
    ([1, 2], [300, 90], 4, 1, 256, 32, None),
    # windows: from a block's first key (100 - 20), mid-tile, larger than the context; no GQA, head dim 96
    ([1, 4, 1], [100, 60, 37], 9, 3, 64, 16, 20),
    ([1, 1], [33, 80], 2, 2, 96, 16, 17),
    ([2, 1], [30, 12], 9, 3, 64, 16, 1000),
    # prefill rows (attention_cpu.py sends them here up to BF16_PREFILL_MAX_KEYS keys): a 128-token prompt,
    # 384 rows per KV head in 12 chunks, beside decode rows of unequal cost (the split by cost)
    ([128, 1, 1, 1], [128, 50, 51, 300], 9, 3, 64, 16, None),
    # a prompt's later chunk after 300 cached keys, and a short prompt: one KV head per work item
    ([100, 37], [400, 37], 9, 3, 64, 16, None),
    # a windowed prefill whose window starts mid-chunk; Gemma 3's heads (4 per KV head, dim 256) with a window
    ([90, 1, 1, 1], [200, 20, 33, 64], 9, 3, 64, 16, 40),
    ([70, 1], [70, 129], 4, 1, 256, 16, 50),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("query_lens", "seq_lens", "heads", "kv_heads", "head_dim", "block_size", "window"), CASES)
def test_kernel_matches_the_oracle_and_the_widened_kernel(
    vector_kernel, dtype, query_lens, seq_lens, heads, kv_heads, head_dim, block_size, window
) -> None:
    if dtype not in vector_kernel.kernel.cache_dtypes:
        pytest.skip(f"the kernel takes no {dtype} caches")
    q, k, v, meta = random_paged_inputs(
        query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(seq_lens)
    )
    scale = head_dim**-0.5
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64, window)
    outs = []
    for on in (True, False):
        vector_kernel.switch(on)
        outs.append(cpu_attention(q, k, v, meta, scale, window=window).double())
    # bf16 outputs are rounded to 8 bits; float32 ones, summed in another order, agree to float32's precision.
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for out in outs:
        assert relative_error(out, ref) < tolerance
    assert relative_error(outs[0], outs[1]) < tolerance
    # Whether the switch chose another kernel shows where the rounding differs: in every float32 output, and in
    # bf16 outputs where the kernel's own rounding differs (VectorKernel.bf16_outputs_differ).
    if dtype == torch.float32 or vector_kernel.kernel.bf16_outputs_differ:
        assert not torch.equal(outs[0], outs[1]), "both runs took the same kernel"


def test_kernel_rescales_when_later_keys_score_higher(vector_kernel) -> None:
    """The lazy reference max must move with scores that climb past its threshold: at scale 10 by 1 per
    key, 300 over a sequence, where exponentials against a stale reference would overflow float32."""
    q, k, v, meta = climbing_score_inputs([1, 2, 64], [300, 200, 100])
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 10.0, torch.float64)
    out = cpu_attention(q, k, v, meta, 10.0).double()
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2


def test_kernel_never_reads_nan_past_a_tiles_keys(vector_kernel) -> None:
    """Every cache slot past each sequence's last key set to NaN (stale rows of a reused block): the kernels
    must not read them (the bf16 kernel's masked loads read zeros there), or 0 * NaN would reach the output."""
    query_lens, seq_lens = [1, 1, 1, 1, 2, 40], [5, 21, 40, 16, 9, 45]
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 9, 3, 64, 16, torch.bfloat16, seed=5)
    used = torch.zeros(k.shape[:2], dtype=torch.bool)
    for table, length in zip(meta.block_tables.tolist(), seq_lens, strict=True):
        for key in range(length):
            used[table[key // 16], key % 16] = True
    k[~used] = float("nan")
    v[~used] = float("nan")
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    out = cpu_attention(q, k, v, meta, 0.125).double()
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("vector_kernel", ["bf16"], indirect=True)
def test_prefill_rows_take_the_bf16_kernel_up_to_its_bound(vector_kernel) -> None:
    """A sequence with prefill rows runs on the kernel while it has at most BF16_PREFILL_MAX_KEYS keys, on
    SDPA past that, and on SDPA whenever the kernel is switched off; both give the oracle's rows."""
    query_lens, seq_lens = [20, 20], [BF16_PREFILL_MAX_KEYS, BF16_PREFILL_MAX_KEYS + 1]
    for bf16, expected_on_kernel in ((True, [0]), (False, [])):
        vector_kernel.switch(bf16)
        q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 9, 3, 64, 16, torch.bfloat16, seed=3)
        out = cpu_attention(q, k, v, meta, 0.125).double()
        on_kernel, on_sdpa = meta.plans[("cpu", True)]
        assert on_kernel.tolist() == expected_on_kernel
        assert on_sdpa == [i for i in range(2) if i not in expected_on_kernel]
        ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
        assert relative_error(out, ref) < 1e-2


def test_avx2_kernel_says_where_it_applies() -> None:
    """avx2_attention_applies (benchmarks/prefill_attention.py names the kernel by it): on the avx2 path's build
    for head dims that are a multiple of 32 while switched on; never on another path's."""
    built = cpu.load()
    if built is None:
        pytest.skip("no compiled CPU kernels")
    on_avx2 = cpu_isa.selected().isa.name == "avx2"
    dim64, dim80 = torch.zeros(1, 9, 64, dtype=torch.bfloat16), torch.zeros(1, 9, 80, dtype=torch.bfloat16)
    assert built.avx2_attention_applies(dim64) == on_avx2
    assert not built.avx2_attention_applies(dim80)
    previous = built.set_avx2_attention(False)
    try:
        assert not built.avx2_attention_applies(dim64)
    finally:
        built.set_avx2_attention(previous)
