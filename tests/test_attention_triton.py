"""The Triton kernels against the float64 oracle; skipped where there is no CUDA device or triton.

Without CUDA they also run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, triton installed), in
float32 only: the interpreter's bf16 tl.dot is wrong (triton 3.5.0: about 1e10 off on a 16 x 16 product).
triton 3.5.0's interpreter also fails on a loop bound loaded from memory with NumPy 2.4 (`int()` of a
one-element array in interpreter.py's `tensor.__index__`); they passed with that line reading `.item()`."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.kernels.metadata import AttentionMetadata

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRETED, reason="needs CUDA"),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BATCHES = {  # name: (query_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    "prefill with prefixes": ([100, 37, 300], [100, 250, 301], 8, 2, 64, 16),
    "decode": ([1] * 7, [1, 15, 16, 17, 300, 1000, 77], 9, 3, 64, 16),
    "verify": ([4, 3, 5], [4, 90, 700], 8, 8, 128, 5),
    "mixed": ([1, 200, 2, 9], [500, 200, 3, 40], 12, 4, 96, 16),
}


def run_case(name: str, dtype: torch.dtype, entry: str, window: int | None = None, **kwargs: int) -> None:
    """With a window, the table entries of blocks wholly before each sequence's first window key point at
    a block of NaN, as released slots point at blocks that are not theirs (metadata.py): a kernel that
    read one would return NaN."""
    triton_kernels = pytest.importorskip("kvserve.kernels.triton")  # needs the triton package
    if INTERPRETED and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 tl.dot is wrong")
    qlens, slens, hq, hkv, d, bs = BATCHES[name]
    q, k, v, meta = random_paged_inputs(qlens, slens, hq, hkv, d, bs, dtype)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, d**-0.5, torch.float64, window)
    tables = meta.block_tables.tolist()
    if window is not None:
        released = k.shape[0]
        k, v = (torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (k, v))
        for table, n, s in zip(tables, qlens, slens, strict=True):
            dead = max(s - n - window + 1, 0) // bs
            table[:dead] = [released] * dead
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    meta = AttentionMetadata.build(qlens, slens, tables, bs, DEVICE)
    out = getattr(triton_kernels, entry)(q, k, v, meta, d**-0.5, window=window, **kwargs)
    assert torch.isfinite(out).all()
    assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < TOLERANCE[dtype]


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


@pytest.mark.parametrize("window", [1, 24, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name, entry, kwargs",
    [
        ("prefill with prefixes", "triton_prefill_attention", {}),
        ("decode", "triton_decode_attention", {"num_splits": 1}),
        ("verify", "triton_decode_attention", {"num_splits": 3}),
        ("mixed", "triton_attention", {}),
    ],
)
def test_sliding_windows(name: str, entry: str, kwargs: dict, dtype: torch.dtype, window: int) -> None:
    run_case(name, dtype, entry, window=window, **kwargs)
