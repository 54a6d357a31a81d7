"""The oracle: attention computed the obvious way, softmax(QK^T * scale + causal mask) V, with the
full score matrix materialized. Fast kernels are tested against it (in float64); it is also the
"reference" backend, which is correct but quadratic in memory.
"""

from __future__ import annotations

import torch

from kvserve.intmath import div_ceil
from kvserve.kernels.metadata import AttentionMetadata


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_offset: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence. q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; returns [Tq, Hq, D].

    Query i sits at position p = q_offset + i and sees keys 0 .. p, or with a sliding `window` only
    the last `window` of them, p - window + 1 .. p (HF's sliding-window mask). By default the queries are
    the last Tq positions (q_offset = Tk - Tq), as in prefill after a cached prefix, or decode.
    Query head h reads kv head h // (Hq / Hkv) (grouped-query attention).
    """
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    offset = tk - tq if q_offset is None else q_offset
    group = hq // hkv
    qc = q.to(compute_dtype).transpose(0, 1)  # [Hq, Tq, D]
    kc = k.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vc = v.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qc @ kc.transpose(1, 2) * scale  # [Hq, Tq, Tk]
    qpos = torch.arange(tq, device=q.device) + offset
    kpos = torch.arange(tk, device=q.device)
    hidden = kpos[None, :] > qpos[:, None]
    if window is not None:  # hides the keys of released slots too (kernels/metadata.py)
        hidden |= kpos[None, :] <= qpos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vc
    return out.transpose(0, 1).to(q.dtype)


def gather_sequence_kv(cache: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """Keys (or values) 0 .. seq_lens[i]-1 of sequence i as a contiguous [seq_len, Hkv, D] copy."""
    n = meta.seq_lens_host[i]
    blocks = meta.block_tables[i, : div_ceil(n, meta.block_size)]
    return cache.index_select(0, blocks).flatten(0, 1)[:n]


def paged_reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> torch.Tensor:
    """Packed varlen causal attention over the paged cache, one materialized matrix per sequence."""
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(meta.query_lens_host):
        k = gather_sequence_kv(k_cache, meta, i)
        v = gather_sequence_kv(v_cache, meta, i)
        out[start : start + n] = reference_attention(q[start : start + n], k, v, scale, None, compute_dtype, window)
        start += n
    return out


def random_paged_inputs(
    query_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and caches with each sequence's blocks scattered through the pool in shuffled order,
    as a busy block pool leaves them, plus one spare block so table padding points at foreign data."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [div_ceil(s, block_size) for s in seq_lens]
    pool = sum(blocks) + 1
    perm = torch.randperm(pool, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks:
        tables.append(perm[start : start + n])
        start += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    shape = (pool, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((sum(query_lens), num_q_heads, head_dim), generator=gen).to(dtype)
    return q, k, v, meta


def climbing_score_inputs(
    query_lens: list[int], seq_lens: list[int], seed: int = 11
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """random_paged_inputs (9 query heads, 3 KV heads of 64, blocks of 16, bf16) with q all ones and keys
    whose score q.k climbs along each sequence by 0.1 per key (times the caller's scale): a kernel that
    rescales its softmax lazily must move its reference max again and again, or the late keys would
    dominate by e^(their lead) too much, or overflow."""
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 9, 3, 64, 16, torch.bfloat16, seed)
    q = torch.ones_like(q)
    positions = torch.arange(16, dtype=torch.float32).repeat(k.shape[0], 1)
    block_order = torch.zeros(k.shape[0])
    for table, length in zip(meta.block_tables.tolist(), meta.seq_lens.tolist(), strict=True):
        for i, block in enumerate(table[: div_ceil(length, 16)]):
            block_order[block] = i
    key_position = (block_order[:, None] * 16 + positions) / 10
    k = (key_position[:, :, None, None] * torch.ones(1, 1, 3, 64) / 64).to(torch.bfloat16)
    return q, k, v, meta
