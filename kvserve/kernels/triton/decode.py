"""Triton paged decode: one or a few new tokens per sequence, optionally split along the KV axis.

One program per (sequence, KV head, split). Its rows are every (query token, query head) pair that
reads this KV head, so K/V are loaded once for the whole GQA group. With several splits each program
writes its unnormalized (m, den, acc) state and the splits are merged by `merge_attention_states`' rule,
the same statistics combination the CPU kernel uses (flash-decoding). With a sliding window W
(WINDOWED) the splits share the keys from the first query token's first window key on, so the entries
of released blocks before it are never read (metadata.py).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kvserve.intmath import div_ceil
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.triton.launch import DECODE_DEFAULT, LaunchConfig
from kvserve.kernels.triton.prefill import LOG2E, M_FLOOR, dot_precision


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    ACC,  # [splits, T, Hq, D] float32, or the output itself when NORMALIZE
    M_OUT,  # [splits, T, Hq] float32, natural-log units
    DEN_OUT,
    SEQ_IDS,
    CU_Q,
    SEQ_LENS,
    BLOCK_TABLES,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_as,
    stride_at,
    stride_ah,
    stride_ms,
    stride_mt,
    stride_bt,
    window,  # keys a query sees, itself included (with WINDOWED)
    GROUP: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.load(SEQ_IDS + tl.program_id(0))
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    seq_len = tl.load(SEQ_LENS + seq)
    first = 0
    if WINDOWED:  # the first query token's first key
        first = tl.maximum(seq_len - q_len - window + 1, 0)
    chunk = tl.cdiv(seq_len - first, NUM_SPLITS)
    kv_start = first + split * chunk
    kv_end = tl.minimum(kv_start + chunk, seq_len)

    rows = tl.arange(0, BLOCK_M)  # row r = (token r // GROUP, head kv_head * GROUP + r % GROUP)
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    r_valid = token < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=r_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    qpos = seq_len - q_len + token
    m_i = tl.full([BLOCK_M], M_FLOOR, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        block = tl.load(BLOCK_TABLES + seq * stride_bt + offs_n // CACHE_BLOCK, mask=n_valid, other=0)
        within = offs_n % CACHE_BLOCK
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(
            K + block[:, None] * stride_kb + within[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        seen = (offs_n[None, :] <= qpos[:, None]) & n_valid[None, :]
        if WINDOWED:
            seen = seen & (offs_n[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + block[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    row_off = (q_start + token) * stride_at + head * stride_ah
    out_mask = r_valid[:, None] & d_valid[None, :]
    if NORMALIZE:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(ACC + row_off[:, None] + offs_d[None, :], out.to(ACC.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ACC + split * stride_as + row_off[:, None] + offs_d[None, :], acc, mask=out_mask)
        m_off = split * stride_ms + (q_start + token) * stride_mt + head
        tl.store(M_OUT + m_off, m_i * 0.6931471805599453, mask=r_valid)  # base 2 -> natural log
        tl.store(DEN_OUT + m_off, l_i, mask=r_valid)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, but no split shorter than 256 keys; one split off CUDA
    (Triton's interpreter runs the kernels on the CPU, one program at a time)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = div_ceil(2 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_seq_len // 256))


def triton_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    seqs: list[int] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Paged decode for the sequences in seqs (default all; each with a few query tokens); `window`: each
    query sees only the last `window` keys; `config`: the launch shape (DECODE_DEFAULT by default; its
    block_m is unused, the rows being the GQA group's)."""
    config = config or DECODE_DEFAULT
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    seqs = list(range(meta.num_seqs)) if seqs is None else seqs
    out = torch.empty_like(q) if out is None else out
    if not seqs:
        return out
    max_q = max(meta.query_lens_host[i] for i in seqs)
    max_s = max(meta.seq_lens_host[i] for i in seqs)
    if num_splits is None:
        num_splits = choose_num_splits(len(seqs), hkv, max_s, q.device)
    normalize = num_splits == 1
    if normalize:
        acc, m, den = out.unsqueeze(0), out.new_empty(1, 1, 1), out.new_empty(1, 1, 1)
    else:
        acc = torch.zeros((num_splits, t, hq, d), dtype=torch.float32, device=q.device)
        m = torch.full((num_splits, t, hq), M_FLOOR.value, dtype=torch.float32, device=q.device)
        den = torch.zeros((num_splits, t, hq), dtype=torch.float32, device=q.device)
    _decode_kernel[(len(seqs), hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        acc,
        m,
        den,
        torch.tensor(seqs, dtype=torch.int32, device=q.device),
        meta.cu_seqlens_q,
        meta.seq_lens,
        meta.block_tables,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        m.stride(0),
        m.stride(1),
        meta.block_tables.stride(0),
        window or 0,
        GROUP=group,
        CACHE_BLOCK=meta.block_size,
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=max(16, triton.next_power_of_2(group * max_q)),
        BLOCK_N=config.block_n,
        WINDOWED=window is not None,
        NUM_SPLITS=num_splits,
        NORMALIZE=normalize,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not normalize:
        # All splits merged at once (merge_attention_states' rule over a split axis): one reference max,
        # each split's numerator and denominator rescaled to it and summed. A pairwise loop would launch
        # ~6 kernels per split, which dominates a long single-sequence decode.
        weights = torch.exp(m - m.amax(0, keepdim=True))
        den_all = (den * weights).sum(0)
        acc_all = (acc * weights.unsqueeze(-1)).sum(0)
        merged = acc_all / den_all.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        if len(seqs) == meta.num_seqs:
            out.copy_(merged)
            return out
        starts = [0, *itertools.accumulate(meta.query_lens_host)]
        rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], device=q.device)
        out[rows] = merged[rows].to(out.dtype)  # only these sequences' rows: out may hold others
    return out
