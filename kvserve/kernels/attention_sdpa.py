"""The "sdpa" backend: torch.nn.functional.scaled_dot_product_attention over K/V gathered from the
paged cache. Sequences with few new tokens are batched into one padded call; longer ones (prefill)
get one call each, since padding a batch of unequal prompts to the longest wastes quadratic work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels.attention import DECODE_MAX_QUERY_LEN
from kvserve.kernels.attention_ref import gather_sequence_kv
from kvserve.kernels.metadata import AttentionMetadata


@dataclass
class _DecodePlan:
    """What one padded decode call needs that depends only on the metadata (memoized on it)."""

    slot: torch.Tensor  # int64 [B * Smax]: cache slot of each (sequence, key position)
    rows: torch.Tensor  # int64 [B * Qmax]: q row of each (sequence, query row), clamped for padding
    dest: torch.Tensor  # int64 [B * Qmax]: out row, T for padding rows
    mask: torch.Tensor  # bool [B, 1, Qmax, Smax]: True where a query row may see a key
    shape: tuple[int, int, int]  # (B, Qmax, Smax)


def _decode_plan(meta: AttentionMetadata, seq_list: list[int], t_rows: int, window: int | None) -> _DecodePlan:
    dev = meta.seq_lens.device
    seqs = torch.tensor(seq_list, device=dev)
    qlen = torch.tensor([meta.query_lens_host[i] for i in seq_list], device=dev)
    slen = meta.seq_lens[seqs]
    max_q, max_s = int(qlen.max()), max(meta.seq_lens_host[i] for i in seq_list)
    j = torch.arange(max_q, device=dev)
    rows = meta.cu_seqlens_q[seqs].unsqueeze(1) + j
    valid = j < qlen.unsqueeze(1)
    qpos = (slen - qlen).unsqueeze(1) + j  # padding rows see every real key, so they stay finite
    kpos = torch.arange(max_s, device=dev)
    col = torch.div(kpos, meta.block_size, rounding_mode="floor")
    slot = (meta.block_tables[seqs][:, col] * meta.block_size + kpos % meta.block_size).flatten()
    mask = (kpos <= qpos.unsqueeze(-1)) & (kpos < slen.view(-1, 1, 1))  # [B, Qmax, Smax]
    if window is not None:  # a query at p sees p - window + 1 .. p: its own key stays, so no row is empty
        # Keys before the window may come from released slots: masked, finite, weight 0 (metadata.py).
        mask &= kpos > qpos.unsqueeze(-1) - window
    return _DecodePlan(
        slot=slot,
        rows=rows.clamp_max(t_rows - 1).flatten(),
        dest=torch.where(valid, rows, t_rows).flatten(),
        mask=mask.unsqueeze(1),
        shape=(len(seq_list), max_q, max_s),
    )


def _padded_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    seq_list: list[int],
    out: torch.Tensor,
    window: int | None = None,
) -> None:
    """One SDPA call for the sequences in seqs, keys padded to the longest and masked per sequence.
    The index and mask tensors are planned once per metadata (and window) and reused by every layer."""
    _, hkv, d = k_cache.shape[1:]
    key = ("sdpa-decode", q.shape[0], window)
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _decode_plan(meta, seq_list, q.shape[0], window)
    b, max_q, max_s = plan.shape
    k = k_cache.view(-1, hkv * d).index_select(0, plan.slot).view(b, max_s, hkv, d).transpose(1, 2)
    v = v_cache.view(-1, hkv * d).index_select(0, plan.slot).view(b, max_s, hkv, d).transpose(1, 2)
    qb = q.index_select(0, plan.rows).view(b, max_q, -1, d)
    res = F.scaled_dot_product_attention(qb.transpose(1, 2), k, v, attn_mask=plan.mask, scale=scale, enable_gqa=True)
    out.index_copy_(0, plan.dest, res.transpose(1, 2).flatten(0, 1))


def _one_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    i: int,
    row0: int,
    window: int | None = None,
) -> torch.Tensor:
    n, s = meta.query_lens_host[i], meta.seq_lens_host[i]
    k = gather_sequence_kv(k_cache, meta, i).transpose(0, 1).unsqueeze(0)
    v = gather_sequence_kv(v_cache, meta, i).transpose(0, 1).unsqueeze(0)
    qs = q[row0 : row0 + n].transpose(0, 1).unsqueeze(0)
    if n == s and (window is None or window >= s):  # is_causal aligns the mask top-left: right without a prefix
        res = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kpos = torch.arange(s, device=q.device)
        qpos = kpos[s - n :].unsqueeze(1)
        mask = kpos <= qpos
        if window is not None:  # hides the keys of released slots too (kernels/metadata.py)
            mask &= kpos > qpos - window
        res = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return res[0].transpose(0, 1)


def sdpa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Packed varlen causal attention over the paged cache via torch SDPA. q: [T, Hq, D]; `window`:
    a query sees only the last `window` keys (its own included)."""
    out = q.new_empty((q.shape[0] + 1, q.shape[1], q.shape[2]))
    qlens = meta.query_lens_host
    decode = [i for i, n in enumerate(qlens) if n <= DECODE_MAX_QUERY_LEN]
    if decode:
        _padded_decode(q, k_cache, v_cache, meta, scale, decode, out, window)
    prefill = [i for i, n in enumerate(qlens) if n > DECODE_MAX_QUERY_LEN]
    prefill_rows(q, k_cache, v_cache, meta, scale, out, prefill, window)
    return out[:-1]


def prefill_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    seqs: list[int],
    window: int | None = None,
) -> None:
    """Writes the out rows of the sequences `seqs` (indices into the batch), one SDPA call each."""
    row_starts = [0, *itertools.accumulate(meta.query_lens_host)]
    for i in seqs:
        rows = _one_prefill(q, k_cache, v_cache, meta, scale, i, row_starts[i], window)
        out[row_starts[i] : row_starts[i + 1]] = rows
