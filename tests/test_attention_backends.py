"""Backend selection by name, and every CPU backend computing the same function."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.kernels.backends import default_attention_backend, get_attention_backend


@pytest.mark.parametrize("name", ["tiled", "reference", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backends_agree_with_the_oracle(name: str, dtype: torch.dtype) -> None:
    q, k, v, meta = random_paged_inputs([1, 3, 40, 1, 12], [90, 3, 100, 1, 300], 6, 2, 64, 16, dtype)
    out = get_attention_backend(name, "cpu")(q, k, v, meta, 0.125)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    assert out.dtype == dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


def test_default_cpu_backend_is_a_cpu_backend() -> None:
    assert default_attention_backend("cpu") in ("tiled", "sdpa")
    assert default_attention_backend(torch.device("cpu")) == default_attention_backend("cpu")


def test_unknown_backend_names_the_field() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash", "cpu")


def test_triton_needs_cuda() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("triton", "cpu")
