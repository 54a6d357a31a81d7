"""Triton varlen causal prefill over the paged KV cache: FlashAttention Alg. 1 with the tiles in SRAM.

One program per (query tile, sequence, query head). It walks the sequence's keys (cached prefix and new
tokens alike) through its block table, BLOCK_N at a time, up to the tile's last position, keeping the
running max, denominator and accumulator in registers; normalizes once; writes its rows. With a sliding
window W (WINDOWED) a query at p sees keys p - W + 1 .. p: the walk starts at the tile's first query's
first key, so the entries of released blocks before it are never read (metadata.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.triton.launch import PREFILL_DEFAULTS, LaunchConfig

LOG2E = 1.4426950408889634
# Finite start for the running max: exp2(m_old - m_new) is never NaN. A constexpr, since Triton kernels
# read no other globals.
M_FLOOR = tl.constexpr(-1e30)


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    OUT,
    SEQ_IDS,
    CU_Q,
    SEQ_LENS,
    BLOCK_TABLES,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    window,  # keys a query sees, itself included (with WINDOWED)
    GROUP: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.load(SEQ_IDS + tl.program_id(1))
    head = tl.program_id(2)
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(SEQ_LENS + seq)
        prefix = seq_len - q_len
        kv_head = head // GROUP
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < q_len
        d_valid = offs_d < HEAD_DIM
        q = tl.load(
            Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        qpos = prefix + offs_m
        m_i = tl.full([BLOCK_M], M_FLOOR, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)  # causal: nothing past the last row
        kv_start = 0
        if WINDOWED:  # nothing before the first row's window
            kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
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
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            OUT + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=m_valid[:, None] & d_valid[None, :],
        )


def dot_precision(dtype: torch.dtype) -> str:
    # float32 must stay float32 (TF32 would cost ~1e-3 relative error); bf16 dots are exact in fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    seqs: list[int] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Varlen causal prefill for the sequences in seqs (default all), written into out's rows; `window`:
    each query sees only the last `window` keys; `config`: the launch shape (default per dtype)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    seqs = list(range(meta.num_seqs)) if seqs is None else seqs
    out = torch.empty_like(q) if out is None else out
    if not seqs:
        return out
    max_q = max(meta.query_lens_host[i] for i in seqs)
    config = config or PREFILL_DEFAULTS[q.dtype]
    grid = (triton.cdiv(max_q, config.block_m), len(seqs), hq)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
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
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        window or 0,
        GROUP=hq // hkv,
        CACHE_BLOCK=meta.block_size,
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        WINDOWED=window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
