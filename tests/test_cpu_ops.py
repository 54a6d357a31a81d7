"""The compiled CPU kernels (kvserve/kernels/cpu/ops.cpp) against the torch definitions they replace
(kvserve/model/layer_ops.py) and, for attention, against the materialized oracle."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention_cpu import cpu_attention
from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.model.config import ModelConfig
from kvserve.model.layer_ops import TorchLayerOps, layer_ops_for
from kvserve.model.llama import rope_tables

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    built = cpu.load()
    assert built is not None, "the CPU kernels must build on the machines kvserve is tested on"
    return built


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """float32: summation order only (1e-6 relative); bfloat16: one rounding of the same float32 value
    can land one bf16 step (2^-8 relative) away."""
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    return bool(((a.float() - b.float()).abs() <= tol * b.float().abs() + tol).all())


def test_layer_ops_pick_the_kernels_on_the_cpu(kernels) -> None:
    assert layer_ops_for(torch.device("cpu")) is kernels
    assert layer_ops_for(torch.device("meta")) is TorchLayerOps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(kernels, dtype: torch.dtype, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(37, 576, generator=gen) * 3
    delta = (torch.randn(37, 576, generator=gen) * 5).to(dtype) if with_delta else None
    weight = torch.rand(576, generator=gen) + 0.5
    ours, theirs = residual.clone(), residual.clone()
    out = kernels.add_rms_norm(ours, delta, weight, 1e-5, dtype)
    ref = TorchLayerOps.add_rms_norm(theirs, delta, weight, 1e-5, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.equal(ours, theirs)  # the residual update is one float32 add either way
    assert close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(kernels, dtype: torch.dtype) -> None:
    config = ModelConfig(49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192)  # SmolLM2-135M's shapes
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = rope_tables(config, 4096, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    t = 21
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=gen)
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    caches = [torch.zeros(8, 16, hkv, d, dtype=dtype) for _ in range(4)]
    ours, theirs = qkv.clone(), qkv.clone()
    kernels.rope_write_kv(ours, positions, cos, sin, caches[0], caches[1], slots, hq, hkv)
    TorchLayerOps.rope_write_kv(theirs, positions, cos, sin, caches[2], caches[3], slots, hq, hkv)
    assert close(ours, theirs, dtype)
    assert close(caches[0], caches[2], dtype) and torch.equal(caches[1], caches[3])
    written = caches[0].view(-1, hkv * d)[slots]
    assert torch.equal(written, ours[:, hq * d : (hq + hkv) * d])  # k rotated, as in qkv
    assert int((caches[0] != 0).flatten(1).any(1).sum()) <= 8  # nothing outside the slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_over_the_whole_range(kernels, dtype: torch.dtype) -> None:
    gate = torch.linspace(-120, 120, 24000).view(3, -1)
    gate_up = torch.cat([gate, torch.randn(gate.shape, generator=torch.Generator().manual_seed(3))], 1).to(dtype)
    out, ref = kernels.silu_mul(gate_up), TorchLayerOps.silu_mul(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # exp is a polynomial here and Sleef's in torch: a few float32 ulps apart.
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert bool(((out.float() - ref.float()).abs() <= tol * ref.float().abs() + 1e-30).all())


CASES = [
    # (query_lens, seq_lens): decode, verify (several new tokens), partial and exact blocks, a fresh
    # 1-token sequence, and a prefill chunk that the backend hands to SDPA.
    ([1, 1, 1], [1, 16, 17]),
    ([1, 4, 8, 1, 3], [90, 4, 100, 33, 300]),
    ([2, 40, 1, 12], [2, 40, 257, 500]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("query_lens", "seq_lens"), CASES)
def test_cpu_attention_matches_the_oracle(kernels, dtype, query_lens, seq_lens) -> None:
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 9, 3, 64, 16, dtype)
    # The model hands attention q as a strided view into its fused qkv rows.
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 2 * 3 * 64, dtype=dtype)], 1)
    strided_q = qkv[:, : 9 * 64].view(q.shape)
    out = cpu_attention(strided_q, k, v, meta, 0.125)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    assert out.dtype == dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


def test_cpu_attention_is_stable_for_huge_logits(kernels) -> None:
    """Scores of +-1e4 would overflow a naive exp: the online max keeps every term <= 1."""
    q, k, v, meta = random_paged_inputs([1, 3], [200, 70], 9, 3, 64, 16, torch.float32, seed=5)
    out = cpu_attention(q * 400, k, v, meta, 0.125)
    ref = paged_reference_attention(q.double() * 400, k.double(), v.double(), meta, 0.125, torch.float64)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
