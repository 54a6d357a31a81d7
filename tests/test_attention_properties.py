"""Property tests: every attention path equals the float64 oracle on random paged batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels.attention import (
    DECODE_MAX_QUERY_LEN,
    paged_decode_attention,
    tiled_attention,
    tiled_prefill_attention,
)
from kvserve.kernels.attention_ref import paged_reference_attention, random_paged_inputs
from kvserve.kernels.attention_sdpa import sdpa_attention
from kvserve.kernels.metadata import AttentionMetadata

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
FEW = settings(max_examples=12, deadline=None)


@dataclass
class Batch:
    query_lens: list[int]
    seq_lens: list[int]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def inputs(
        self, dtype: torch.dtype, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        return random_paged_inputs(
            self.query_lens,
            self.seq_lens,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            dtype,
            seed,
        )


@st.composite
def batches(draw: st.DrawFn, max_query_len: int = 300, max_seqs: int = 4) -> Batch:
    """Sequences of 1..300 keys whose last 1..max_query_len positions are new (the rest a cached
    prefix), GQA ratios 1..4, head dims 32..128, block sizes that do and don't divide the lengths."""
    n = draw(st.integers(1, max_seqs))
    seq_lens = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    query_lens = [draw(st.integers(1, min(s, max_query_len))) for s in seq_lens]
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([32, 48, 64, 96, 128]))
    block_size = draw(st.sampled_from([1, 5, 16]))
    return Batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size)


def relative_error(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
) -> float:
    """||out - ref|| / ||ref|| against the oracle run in float64 on the same (rounded) inputs."""
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


@FEW
@given(batch=batches(), dtype=DTYPES, q_tile=st.sampled_from([1, 7, 16, 64]), kv_tile=st.sampled_from([3, 16, 37, 128]))
def test_prefill_matches_reference(batch: Batch, dtype: torch.dtype, q_tile: int, kv_tile: int) -> None:
    q, k, v, meta = batch.inputs(dtype)
    scale = batch.head_dim**-0.5
    out = tiled_prefill_attention(q, k, v, meta, scale, q_tile=q_tile, kv_tile=kv_tile)
    assert relative_error(out, q, k, v, meta, scale) < TOLERANCE[dtype]


@FEW
@given(
    batch=batches(max_query_len=5, max_seqs=8),
    dtype=DTYPES,
    kv_tile=st.sampled_from([4, 16, 50, 256]),
    num_splits=st.integers(1, 4),
)
def test_decode_matches_reference(batch: Batch, dtype: torch.dtype, kv_tile: int, num_splits: int) -> None:
    """One to five query tokens per sequence (speculative verification), optionally split-KV."""
    q, k, v, meta = batch.inputs(dtype)
    scale = batch.head_dim**-0.5
    out = paged_decode_attention(q, k, v, meta, scale, kv_tile=kv_tile, num_splits=num_splits)
    assert relative_error(out, q, k, v, meta, scale) < TOLERANCE[dtype]


@FEW
@given(batch=batches(max_seqs=6), dtype=DTYPES)
def test_mixed_batch_matches_reference(batch: Batch, dtype: torch.dtype) -> None:
    """Decode and prefill sequences in one batch, through the dispatching entry point and SDPA."""
    batch.query_lens[0] = 1  # at least one decoding sequence
    q, k, v, meta = batch.inputs(dtype)
    scale = batch.head_dim**-0.5
    assert relative_error(tiled_attention(q, k, v, meta, scale), q, k, v, meta, scale) < TOLERANCE[dtype]
    assert relative_error(sdpa_attention(q, k, v, meta, scale), q, k, v, meta, scale) < TOLERANCE[dtype]


def test_a_batch_with_both_paths_is_routed_to_both() -> None:
    lens = [1, DECODE_MAX_QUERY_LEN, DECODE_MAX_QUERY_LEN + 1, 200]
    q, k, v, meta = random_paged_inputs(lens, [40, 60, 90, 200], 4, 2, 32, 16)
    assert relative_error(tiled_attention(q, k, v, meta, 0.2), q, k, v, meta, 0.2) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_stay_finite(dtype: torch.dtype) -> None:
    """Scores around 1e4: exp would overflow without the running max."""
    q, k, v, meta = random_paged_inputs([1, 70, 3], [200, 70, 90], 4, 2, 64, 16, dtype)
    q = q * 100
    scale = 1.0  # |scores| ~ 100 * sqrt(64) * 8 ~ 1e4
    for out in (
        tiled_prefill_attention(q, k, v, meta, scale, q_tile=16, kv_tile=32),
        paged_decode_attention(q[:1], k, v, _only_first(meta), scale, kv_tile=32, num_splits=3),
        tiled_attention(q, k, v, meta, scale),
    ):
        assert torch.isfinite(out).all()
    # float32 scores of size 1e4 carry ~1e-3 absolute rounding, so the softmax is only that close.
    assert relative_error(tiled_attention(q, k, v, meta, scale), q, k, v, meta, scale) < 1e-2


def _only_first(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata.build(
        meta.query_lens_host[:1], meta.seq_lens_host[:1], meta.block_tables[:1].tolist(), meta.block_size
    )


def test_masked_slots_do_not_leak() -> None:
    """Slots past each sequence's end, padding table entries and empty splits are all masked, so huge
    values stored there change nothing and padding query rows come out finite."""
    q, k, v, meta = random_paged_inputs([1, 4, 2], [17, 5, 33], 6, 3, 32, 8)
    scale = 32**-0.5
    expected = tiled_attention(q, k, v, meta, scale)
    used = torch.zeros(k.shape[:2], dtype=torch.bool)
    for i, n in enumerate(meta.seq_lens_host):
        for pos in range(n):
            used[meta.block_tables[i, pos // 8], pos % 8] = True
    k[~used], v[~used] = 1e30, -1e30
    tables = meta.block_tables.clone()
    tables[0, 3:] = int(torch.nonzero(~used.any(1))[0])  # padding points at a stale block
    # A new metadata object: kernels memoize per-metadata plans, so metadata is never modified after use.
    meta = AttentionMetadata.build(meta.query_lens_host, meta.seq_lens_host, tables.tolist(), meta.block_size)
    for out in (
        tiled_attention(q, k, v, meta, scale),
        paged_decode_attention(q, k, v, meta, scale, kv_tile=4, num_splits=8),
        tiled_prefill_attention(q, k, v, meta, scale, q_tile=3, kv_tile=5),
        sdpa_attention(q, k, v, meta, scale),
    ):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_one_plan_serves_every_layer() -> None:
    """Each backend's per-metadata plan is built by the first layer and reused by the others, whose
    queries and caches differ, and every layer's result still matches the oracle; other head shapes
    plan anew."""
    lens = [1, 3, 40, 1, 12]
    meta = random_paged_inputs(lens, [90, 3, 100, 1, 300], 6, 2, 64, 16)[3]
    for layer in range(3):
        q, k, v, _ = random_paged_inputs(lens, [90, 3, 100, 1, 300], 6, 2, 64, 16, seed=layer)
        q = strided(q) if layer == 1 else q
        assert relative_error(tiled_attention(q, k, v, meta, 0.125), q, k, v, meta, 0.125) < 1e-5
        assert relative_error(sdpa_attention(q, k, v, meta, 0.125), q, k, v, meta, 0.125) < 1e-5
        if layer == 0:
            plans = dict(meta.plans)
        assert meta.plans == plans and all(meta.plans[key] is plan for key, plan in plans.items())
    assert len(plans) == 2  # one per backend
    q, k, v, _ = random_paged_inputs(lens, [90, 3, 100, 1, 300], 4, 1, 32, 16)
    assert relative_error(tiled_attention(q, k, v, meta, 0.2), q, k, v, meta, 0.2) < 1e-5
    assert len(meta.plans) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_tile", "num_splits"), [(None, 1), (7, 1), (None, 3), (7, 3)])
def test_pure_decode_paths(dtype: torch.dtype, kv_tile: int | None, num_splits: int) -> None:
    """One new token per sequence: the lean path (q and out used in place, one tile) and its multi-tile
    and split-KV variants, with unequal lengths so that tiles need masks and items are reordered."""
    seq_lens = [1, 17, 300, 64, 65, 2]
    q, k, v, meta = random_paged_inputs([1] * 6, seq_lens, 9, 3, 64, 16, dtype)
    q = strided(q)
    out = paged_decode_attention(q, k, v, meta, 0.125, kv_tile=kv_tile, num_splits=num_splits)
    assert relative_error(out, q, k, v, meta, 0.125) < TOLERANCE[dtype]
    (plans,) = meta.plans.values()
    assert (plans[0].dest is None) == (kv_tile is None and num_splits == 1)  # the lean path when expected
    assert len(plans[0].tiles) == (1 if kv_tile is None else -(-300 // num_splits // kv_tile))


def strided(q: torch.Tensor) -> torch.Tensor:
    """The same q laid out heads-outermost, so not contiguous (the model may hand q over like that)."""
    return q.transpose(0, 1).contiguous().transpose(0, 1)
