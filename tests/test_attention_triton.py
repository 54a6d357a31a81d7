"""The Triton kernels against the float64 oracle; skipped where there is no CUDA device or triton."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.kernels.metadata import AttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BATCHES = {  # name: (query_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    "prefill with prefixes": ([100, 37, 300], [100, 250, 301], 8, 2, 64, 16),
    "decode": ([1] * 7, [1, 15, 16, 17, 300, 1000, 77], 9, 3, 64, 16),
    "verify": ([4, 3, 5], [4, 90, 700], 8, 8, 128, 5),
    "mixed": ([1, 200, 2, 9], [500, 200, 3, 40], 12, 4, 96, 16),
}


def run_case(name: str, dtype: torch.dtype, entry: str, **kwargs: int) -> None:
    triton_kernels = pytest.importorskip("kvserve.kernels.triton")  # needs the triton package
    qlens, slens, hq, hkv, d, bs = BATCHES[name]
    q, k, v, meta = random_paged_inputs(qlens, slens, hq, hkv, d, bs, dtype)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    meta = AttentionMetadata.build(qlens, slens, meta.block_tables.tolist(), bs, "cuda")
    out = getattr(triton_kernels, entry)(q, k, v, meta, d**-0.5, **kwargs)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, d**-0.5, torch.float64)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["prefill with prefixes", "mixed", "decode"])
def test_triton_prefill(name: str, dtype: torch.dtype) -> None:
    run_case(name, dtype, "triton_prefill_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode", "verify"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode(name: str, dtype: torch.dtype, num_splits: int) -> None:
    run_case(name, dtype, "triton_decode_attention", num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mixed_batch(dtype: torch.dtype) -> None:
    run_case("mixed", dtype, "triton_attention")
