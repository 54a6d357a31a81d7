"""Tiled attention with online softmax over the paged KV cache (FlashAttention, Dao et al. 2022, Alg. 1).

Computes exactly softmax(QK^T * scale + causal mask) V without materializing the score matrix: each
unit of work keeps, per query row, a softmax state (m, den, acc) -- the paper's (m, l, O) -- over the
keys seen so far and folds in one KV tile at a time with `merge_attention_states` (book §31.4,
Example 31.2: combine tile statistics, never tile averages). Scores, max and sums are float32
whatever the cache dtype.

Work is cut into *items*: a run of consecutive query rows of one sequence plus the range of its keys
to visit. Prefill items are query tiles; decode items are a sequence's few new tokens, optionally
split along the KV axis (flash-decoding) and merged afterwards with the same statistics. All items
are processed together, vectorized over items and heads; the only Python loop is over KV tiles
(plus a loop over KV heads around each matmul, which lets BLAS read K/V straight from the gathered
[n, tile, Hkv, D] layout instead of copying it into head-major order). Items are sorted by how many
keys they visit, so the items still active at tile t are a prefix and finished ones cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels.metadata import AttentionMetadata

# The running max starts at this finite floor rather than -inf, so exp(m_old - m_new) and
# exp(s - m) never evaluate (-inf) - (-inf): a row with no visible key so far keeps den = 0, acc = 0.
M_FLOOR = -1e30
# Sequences with at most this many new tokens take the decode path (one item per sequence).
DECODE_MAX_QUERY_LEN = 8
DEFAULT_Q_TILE = 64
DEFAULT_KV_TILE = 256


def merge_attention_states(
    m_a: torch.Tensor,
    den_a: torch.Tensor,
    acc_a: torch.Tensor,
    m_b: torch.Tensor,
    den_b: torch.Tensor,
    acc_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine the softmax states of one query row over two disjoint key sets A and B.

    A state over keys K with scores s_k and values v_k is (m, den, acc) with m >= max_k s_k,
    den = sum_k exp(s_k - m) and acc = sum_k exp(s_k - m) v_k, so exp(m) * den is the softmax
    denominator and exp(m) * acc the numerator restricted to K, and acc / den is attention over K.
    Numerators and denominators add across disjoint sets once brought to a common reference max.
    Shapes: m, den [...]; acc [..., D].
    """
    m = torch.maximum(m_a, m_b)
    w_a = torch.exp(m_a - m)
    w_b = torch.exp(m_b - m)
    den = den_a * w_a + den_b * w_b
    acc = torch.addcmul(acc_b * w_b.unsqueeze(-1), acc_a, w_a.unsqueeze(-1))
    return m, den, acc


@dataclass
class _Items:
    """Units of work, one row per item (int64 tensors [W]); items own disjoint (row, key) pairs."""

    seq: torch.Tensor  # sequence index, for its block table
    row0: torch.Tensor  # first packed query row
    nrows: torch.Tensor  # number of query rows (<= max_rows)
    qpos0: torch.Tensor  # position of the first query row
    kv_start: torch.Tensor  # first key position to visit
    kv_end: torch.Tensor  # one past the last key position to visit
    max_rows: int

    def select(self, index: torch.Tensor, device: torch.device) -> _Items:
        fields = (self.seq, self.row0, self.nrows, self.qpos0, self.kv_start, self.kv_end)
        return _Items(*(f[index].to(device) for f in fields), self.max_rows)


def _host_lengths(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_lens, seq_lens, first packed row) per sequence, as CPU tensors for planning."""
    qlen = torch.tensor(meta.query_lens_host, dtype=torch.int64)
    slen = torch.tensor(meta.seq_lens_host, dtype=torch.int64)
    return qlen, slen, torch.cumsum(qlen, 0) - qlen


def _prefill_items(meta: AttentionMetadata, seqs: torch.Tensor, q_tile: int) -> _Items:
    """One item per query tile of each sequence in seqs; a tile visits keys 0 .. its last position."""
    qlen, slen, row0 = (x[seqs] for x in _host_lengths(meta))
    tiles = (qlen + q_tile - 1) // q_tile
    owner = torch.repeat_interleave(torch.arange(len(seqs)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    start = (torch.arange(int(tiles.sum())) - first_tile[owner]) * q_tile  # row offset in sequence
    nrows = torch.clamp(qlen[owner] - start, max=q_tile)
    qpos0 = slen[owner] - qlen[owner] + start
    return _Items(
        seqs[owner], row0[owner] + start, nrows, qpos0, torch.zeros_like(qpos0), qpos0 + nrows, q_tile
    )


def _decode_items(meta: AttentionMetadata, seqs: torch.Tensor, num_splits: int) -> _Items:
    """num_splits items per sequence (split-major): all its query rows, 1/num_splits of its keys each."""
    qlen, slen, row0 = (x[seqs].repeat(num_splits) for x in _host_lengths(meta))
    chunk = (slen + num_splits - 1) // num_splits
    split = torch.arange(num_splits).repeat_interleave(len(seqs))
    kv_start = split * chunk
    kv_end = torch.minimum(kv_start + chunk, slen)  # empty (end <= start) for surplus splits
    qpos0 = slen - qlen
    return _Items(seqs.repeat(num_splits), row0, qlen, qpos0, kv_start, kv_end, int(qlen.max()))


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    items: _Items,
    kv_tile: int,
    num_splits: int,
    out: torch.Tensor,
) -> None:
    """Run the items and write their rows of out ([T + 1, Hq, D]; row T absorbs padding rows)."""
    t_rows, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    bs = meta.block_size
    dev = q.device

    kv_len = (items.kv_end - items.kv_start).clamp_min(0)
    order = torch.argsort(kv_len, descending=True, stable=True)
    n_tiles = -(-int(kv_len.max()) // kv_tile)
    tile_starts = torch.arange(n_tiles).unsqueeze(1) * kv_tile
    active = (kv_len[order].unsqueeze(0) > tile_starts).sum(1).tolist()  # items alive at each tile
    it = items.select(order, dev)
    w, rows_per_item = len(order), items.max_rows
    mg = rows_per_item * group  # rows of one item's matrix: (query row, head within group)

    j = torch.arange(rows_per_item, device=dev)
    valid = j < it.nrows.unsqueeze(1)  # [W, M]
    # Row r may see key p iff p <= qlim[r]: causal and inside the item's key range; -1 for padding.
    qlim = torch.minimum(it.qpos0.unsqueeze(1) + j, it.kv_end.unsqueeze(1) - 1).masked_fill(~valid, -1)
    qlim = qlim.repeat_interleave(group, dim=1).unsqueeze(-1)  # [W, M*G, 1]
    rows = torch.where(valid, it.row0.unsqueeze(1) + j, t_rows)  # padding rows -> out row T
    q_items = q.index_select(0, rows.clamp_max(t_rows - 1).flatten()).view(w, rows_per_item, hkv, group, d)
    q_items = q_items.permute(2, 0, 1, 3, 4).reshape(hkv, w, mg, d).float() * scale

    m = torch.full((hkv, w, mg), M_FLOOR, device=dev)
    den = torch.zeros((hkv, w, mg), device=dev)
    acc = torch.zeros((hkv, w, mg, d), device=dev)
    scores = torch.empty((hkv, w, mg, kv_tile), device=dev)
    pv = torch.empty((hkv, w, mg, d), device=dev)
    tables = meta.block_tables.index_select(0, it.seq)
    last_col = tables.shape[1] - 1
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    offsets = torch.arange(kv_tile, device=dev)

    for t, n in enumerate(active):
        kpos = it.kv_start[:n, None] + (t * kv_tile + offsets)  # [n, kv_tile]
        # Gather only this tile's slots; positions past a sequence's end read padding, masked below.
        col = torch.div(kpos, bs, rounding_mode="floor").clamp_max_(last_col)
        slot = (tables[:n].gather(1, col) * bs + kpos % bs).view(-1)
        k = k_flat.index_select(0, slot).view(n, kv_tile, hkv, d).float()
        v = v_flat.index_select(0, slot).view(n, kv_tile, hkv, d).float()
        s, p = scores[:, :n], pv[:, :n]
        for h in range(hkv):
            torch.bmm(q_items[h, :n], k[:, :, h].transpose(1, 2), out=s[h])
        s.masked_fill_(kpos.unsqueeze(1) > qlim[:n], float("-inf"))
        m_t = s.amax(-1).clamp_min_(M_FLOOR)
        s.sub_(m_t.unsqueeze(-1)).exp_()
        den_t = s.sum(-1)
        for h in range(hkv):
            torch.bmm(s[h], v[:, :, h], out=p[h])
        m[:, :n], den[:, :n], acc[:, :n] = merge_attention_states(
            m[:, :n], den[:, :n], acc[:, :n], m_t, den_t, p
        )

    if num_splits > 1:
        # Back to split-major item order, then fold the splits of each sequence together.
        inv = torch.argsort(order).to(dev)
        m, den, acc = (x.index_select(1, inv).unflatten(1, (num_splits, -1)) for x in (m, den, acc))
        state = (m[:, 0], den[:, 0], acc[:, 0])
        for i in range(1, num_splits):
            state = merge_attention_states(*state, m[:, i], den[:, i], acc[:, i])
        _, den, acc = state
        rows = rows.index_select(0, inv[: w // num_splits])
    # den == 0 only for padding rows (no visible key); their acc is 0, so they come out as 0, not NaN.
    res = acc / den.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    res = res.unflatten(2, (rows_per_item, group)).permute(1, 2, 0, 3, 4).reshape(-1, hq, d)
    out.index_copy_(0, rows.flatten(), res.to(out.dtype))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dtype != k_cache.dtype or k_cache.shape != v_cache.shape or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} does not fit the cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )


def _run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    groups: list[tuple[_Items, int]],
    kv_tile: int,
) -> torch.Tensor:
    _check(q, k_cache, v_cache)
    out = q.new_empty((q.shape[0] + 1, q.shape[1], q.shape[2]))
    for items, num_splits in groups:
        _attend(q, k_cache, v_cache, meta, scale, items, kv_tile, num_splits, out)
    return out[:-1]


def tiled_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    q_tile: int = DEFAULT_Q_TILE,
    kv_tile: int = DEFAULT_KV_TILE,
) -> torch.Tensor:
    """Varlen causal attention of packed new tokens over keys read from the paged cache, including any
    cached prefix (prefix-cache hits, chunked prefill). q: [T, Hq, D]; caches [N, block, Hkv, D]."""
    seqs = torch.arange(meta.num_seqs)
    return _run(q, k_cache, v_cache, meta, scale, [(_prefill_items(meta, seqs, q_tile), 1)], kv_tile)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_tile: int = DEFAULT_KV_TILE,
    num_splits: int = 1,
) -> torch.Tensor:
    """Attention for sequences with one or a few new tokens (speculative verification), reading K/V
    through block tables; with num_splits > 1 each sequence's keys are split into that many ranges,
    processed side by side and merged with their (m, den) statistics."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    items = _decode_items(meta, torch.arange(meta.num_seqs), num_splits)
    return _run(q, k_cache, v_cache, meta, scale, [(items, num_splits)], kv_tile)


def tiled_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """A mixed batch: sequences with few new tokens go the decode way, the rest the prefill way."""
    qlen = torch.tensor(meta.query_lens_host, dtype=torch.int64)
    is_decode = qlen <= DECODE_MAX_QUERY_LEN
    groups = []
    decode_seqs = torch.nonzero(is_decode).flatten()
    if len(decode_seqs):
        groups.append((_decode_items(meta, decode_seqs, 1), 1))
    prefill_seqs = torch.nonzero(~is_decode).flatten()
    if len(prefill_seqs):
        groups.append((_prefill_items(meta, prefill_seqs, DEFAULT_Q_TILE), 1))
    return _run(q, k_cache, v_cache, meta, scale, groups, DEFAULT_KV_TILE)
