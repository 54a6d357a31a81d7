"""Backend selection by name, and every CPU backend computing the same function."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import BACKEND_NAMES
from kvserve.kernels import backends
from kvserve.kernels.attention import tiled_attention
from kvserve.kernels.attention_cpu import cpu_attention
from kvserve.kernels.attention_ref import gather_sequence_kv, paged_reference_attention, random_paged_inputs
from kvserve.kernels.attention_sdpa import sdpa_attention
from kvserve.kernels.backends import default_attention_backend, get_attention_backend


@pytest.mark.parametrize("name", ["tiled", "reference", "sdpa", "cpu", "auto_cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backends_agree_with_the_oracle(name: str, dtype: torch.dtype) -> None:
    q, k, v, meta = random_paged_inputs([1, 3, 40, 1, 12], [90, 3, 100, 1, 300], 6, 2, 64, 16, dtype)
    out = get_attention_backend(name, "cpu")(q, k, v, meta, 0.125)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    assert out.dtype == dtype
    # float32: typically ~2e-7 here, but the torch "tiled" kernel has twice given 1.03e-5 as the first
    # test of a fresh CI process (cause not found: the same call in a new process gives 1.8e-7), so the
    # bound is 5e-5 -- still far below any real fault (a wrong mask or scale is >= 1e-2).
    assert ((out.double() - ref).norm() / ref.norm()).item() < (5e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("window", [1, 7, 33])
@pytest.mark.parametrize("name", ["tiled", "reference", "sdpa", "cpu", "auto_cpu"])
def test_cpu_backends_agree_with_the_oracle_under_a_sliding_window(name: str, window: int) -> None:
    """Decode rows, short and long prefills, with and without a cached prefix (HF's sliding-window mask)."""
    q, k, v, meta = random_paged_inputs([1, 3, 40, 1, 12, 70], [90, 3, 100, 1, 300, 70], 4, 1, 64, 16)
    out = get_attention_backend(name, "cpu")(q, k, v, meta, 0.125, window=window)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64, window)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-5


def test_the_oracles_window_is_the_last_keys_of_each_query() -> None:
    q, k, v, meta = random_paged_inputs([5], [20], 2, 1, 8, 16, torch.float64)
    window, keys, values = 6, gather_sequence_kv(k, meta, 0), gather_sequence_kv(v, meta, 0)
    out = paged_reference_attention(q, k, v, meta, 0.5, torch.float64, window)
    for row, position in enumerate(range(15, 20)):  # query row r sits at position 15 + r
        seen = slice(position - window + 1, position + 1)
        for head in range(2):
            weights = torch.softmax(keys[seen, 0] @ q[row, head] * 0.5, dim=0)
            assert torch.allclose(out[row, head], weights @ values[seen, 0])


def test_default_cpu_backend_is_a_cpu_backend() -> None:
    assert default_attention_backend("cpu") == "auto_cpu"
    assert default_attention_backend(torch.device("cpu")) == default_attention_backend("cpu")


def test_auto_cpu_takes_the_compiled_kernels_when_they_build(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(backends, "cpu_attention", lambda *a: calls.append("cpu") or cpu_attention(*a))
    q, k, v, meta = random_paged_inputs([1, 1], [5, 90], 6, 2, 64, 16, torch.float32)
    backends.auto_cpu_attention(q, k, v, meta, 0.125)
    assert calls == ["cpu"]


def test_auto_cpu_without_the_kernels_takes_the_tiled_kernel_for_large_batches(monkeypatch) -> None:
    """Below the key threshold the batch goes to SDPA, above it to the tiled kernel; both exact."""
    monkeypatch.setattr(backends.cpu, "load", lambda: None)
    calls = []
    monkeypatch.setattr(backends, "tiled_attention", lambda *a: calls.append("tiled") or tiled_attention(*a))
    monkeypatch.setattr(backends, "sdpa_attention", lambda *a: calls.append("sdpa") or sdpa_attention(*a))
    monkeypatch.setattr(backends, "TILED_FROM_TOTAL_KEYS", 200)
    for seq_lens in ([5, 90], [150, 120]):
        q, k, v, meta = random_paged_inputs([1, 1], seq_lens, 6, 2, 64, 16, torch.float32)
        out = backends.auto_cpu_attention(q, k, v, meta, 0.125)
        ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert calls == ["sdpa", "tiled"]


def test_unknown_backend_names_the_field() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash", "cpu")


def test_triton_needs_cuda() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("triton", "cpu")


def test_every_configurable_backend_name_is_a_backend() -> None:
    assert sorted(backends.BACKENDS) == sorted(BACKEND_NAMES)
