"""Tiled attention with online softmax over the paged KV cache (FlashAttention, Dao et al. 2022, Alg. 1).

Computes exactly softmax(QK^T * scale + causal mask) V without materializing the score matrix: each
unit of work keeps, per query row, a softmax state (m, den, acc) -- the paper's (m, l, O) -- over the
keys seen so far and folds in one KV tile at a time, rescaling the state by exp(m_old - m_new) when
the max grows and normalizing once at the end. States over disjoint key ranges (split-KV decode) are
combined by `merge_attention_states` (book §31.4, Example 31.2: combine tile statistics, never tile
averages). Scores, max and sums are float32 whatever the cache dtype.

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
# With kv_tile=None the tile length is chosen so one tile's working set (gathered K and V plus the
# score block, over all items) stays near this size: big enough that per-op overhead is amortized,
# small enough to stay in cache and in reused heap memory (measured on the CPU: benchmarks/attention.py).
TILE_BYTES = 16 << 20


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
    """Units of work; items own disjoint (query row, key) pairs. One int64 [6, W] tensor, so that
    sorting or moving all fields is one op, with rows:"""

    table: torch.Tensor
    max_rows: int  # the most query rows any item has

    @property
    def seq(self) -> torch.Tensor:  # sequence index, for its block table
        return self.table[0]

    @property
    def row0(self) -> torch.Tensor:  # first packed query row
        return self.table[1]

    @property
    def nrows(self) -> torch.Tensor:  # number of query rows, <= max_rows
        return self.table[2]

    @property
    def qpos0(self) -> torch.Tensor:  # position of the first query row
        return self.table[3]

    @property
    def kv_start(self) -> torch.Tensor:  # first key position to visit
        return self.table[4]

    @property
    def kv_end(self) -> torch.Tensor:  # one past the last key position to visit
        return self.table[5]

    def select(self, index: torch.Tensor, device: torch.device) -> _Items:
        return _Items(self.table[:, index].to(device), self.max_rows)


def _host_lengths(meta: AttentionMetadata, seqs: list[int] | None) -> tuple[torch.Tensor, ...]:
    """(sequence ids, query_lens, seq_lens, first packed row) of seqs (default all), as CPU tensors."""
    lens = torch.tensor([meta.query_lens_host, meta.seq_lens_host], dtype=torch.int64).view(2, -1)
    row0 = torch.cumsum(lens[0], 0) - lens[0]
    if seqs is None:
        return torch.arange(meta.num_seqs), lens[0], lens[1], row0
    ids = torch.tensor(seqs, dtype=torch.int64)
    return ids, lens[0, ids], lens[1, ids], row0[ids]


def _prefill_items(meta: AttentionMetadata, seqs: list[int] | None, q_tile: int) -> _Items:
    """One item per query tile of each sequence in seqs; a tile visits keys 0 .. its last position."""
    ids, qlen, slen, row0 = _host_lengths(meta, seqs)
    tiles = (qlen + q_tile - 1) // q_tile
    owner = torch.repeat_interleave(torch.arange(len(ids)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    start = (torch.arange(len(owner)) - first_tile[owner]) * q_tile  # row offset in the sequence
    nrows = torch.clamp(qlen[owner] - start, max=q_tile)
    qpos0 = slen[owner] - qlen[owner] + start
    table = torch.stack([ids[owner], row0[owner] + start, nrows, qpos0, torch.zeros_like(qpos0), qpos0 + nrows])
    return _Items(table, q_tile)


def _decode_items(meta: AttentionMetadata, seqs: list[int] | None, num_splits: int) -> _Items:
    """num_splits items per sequence (split-major): all its query rows, 1/num_splits of its keys each."""
    ids, qlen, slen, row0 = (x.repeat(num_splits) for x in _host_lengths(meta, seqs))
    chunk = (slen + num_splits - 1) // num_splits
    kv_start = torch.arange(num_splits).repeat_interleave(len(ids) // num_splits) * chunk
    kv_end = torch.minimum(kv_start + chunk, slen)  # empty (end <= start) for surplus splits
    table = torch.stack([ids, row0, qlen, slen - qlen, kv_start, kv_end])
    return _Items(table, int(qlen.max()))


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    items: _Items,
    kv_tile: int | None,
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
    w, rows_per_item = len(order), items.max_rows
    mg = rows_per_item * group  # rows of one item's matrix: (query row, head within group)
    longest = int(kv_len.max())
    if kv_tile is None:
        kv_tile = max(16, TILE_BYTES // (w * hkv * (2 * d + mg) * 4))
    n_tiles = -(-longest // kv_tile)
    kv_tile = -(-longest // n_tiles)  # same tile count, equal tiles: no padded tail past the longest
    tile_starts = torch.arange(n_tiles).unsqueeze(1) * kv_tile
    active = (kv_len[order].unsqueeze(0) > tile_starts).sum(1).tolist()  # items alive at each tile
    it = items.select(order, dev)

    j = torch.arange(rows_per_item, device=dev)
    valid = j < it.nrows.unsqueeze(1)  # [W, M]
    # Row r may see key p iff p <= qlim[r]: causal and inside the item's key range; -1 for padding.
    qlim = torch.minimum(it.qpos0.unsqueeze(1) + j, it.kv_end.unsqueeze(1) - 1).masked_fill(~valid, -1)
    qlim = qlim.unsqueeze(-1).expand(w, rows_per_item, group).reshape(w, mg, 1)  # per (row, head)
    rows = torch.where(valid, it.row0.unsqueeze(1) + j, t_rows)  # padding rows -> out row T
    q_items = q.index_select(0, rows.clamp_max(t_rows - 1).flatten()).view(w, rows_per_item, hkv, group, d)
    q_items = q_items.permute(2, 0, 1, 3, 4).reshape(hkv, w, mg, d).float() * scale

    m = torch.full((hkv, w, mg), M_FLOOR, device=dev)
    den = torch.zeros((hkv, w, mg), device=dev)
    acc = torch.zeros((hkv, w, mg, d), device=dev)
    scores = torch.empty((hkv, w, mg, kv_tile), device=dev)
    tables = meta.block_tables.index_select(0, it.seq)
    last_col = tables.shape[1] - 1
    # One row per slot: index_select on a 2-D view is several times faster than on [slots, Hkv, D].
    k_flat, v_flat = k_cache.view(-1, hkv * d), v_cache.view(-1, hkv * d)
    # Tiles are gathered into buffers reused across tiles: fresh large allocations page-fault anew.
    k_buf, v_buf = (torch.empty((w * kv_tile, hkv * d), dtype=k_cache.dtype, device=dev) for _ in range(2))
    widen = k_cache.dtype != torch.float32
    if widen:
        k32, v32 = (torch.empty((w * kv_tile, hkv * d), device=dev) for _ in range(2))
    offsets = torch.arange(kv_tile, device=dev)

    for t, n in enumerate(active):
        kpos = it.kv_start[:n, None] + (t * kv_tile + offsets)  # [n, kv_tile]
        # Gather only this tile's slots; positions past a sequence's end read padding, masked below.
        col = torch.div(kpos, bs, rounding_mode="floor").clamp_max_(last_col)
        slot = (tables[:n].gather(1, col) * bs + kpos % bs).view(-1)
        k, v = k_buf[: len(slot)], v_buf[: len(slot)]
        torch.index_select(k_flat, 0, slot, out=k)
        torch.index_select(v_flat, 0, slot, out=v)
        if widen:  # scores and sums in float32 whatever the cache dtype
            k, v = k32[: len(slot)].copy_(k), v32[: len(slot)].copy_(v)
        k, v = k.view(n, kv_tile, hkv, d), v.view(n, kv_tile, hkv, d)
        s = scores[:, :n]
        for h in range(hkv):
            torch.bmm(q_items[h, :n], k[:, :, h].transpose(1, 2), out=s[h])
        s.masked_fill_(kpos.unsqueeze(1) > qlim[:n], float("-inf"))
        # Alg. 1's update with the tile's probabilities taken relative to the new running max, so
        # only the running state is rescaled (by exp(m_old - m_new)) and P V accumulates in place.
        m_old = m[:, :n]
        m_new = torch.maximum(m_old, s.amax(-1))
        s.sub_(m_new.unsqueeze(-1)).exp_()
        alpha = torch.exp(m_old - m_new)
        den[:, :n].mul_(alpha).add_(s.sum(-1))
        acc_n = acc[:, :n].mul_(alpha.unsqueeze(-1))
        for h in range(hkv):
            acc_n[h].baddbmm_(s[h], v[:, :, h])
        m_old.copy_(m_new)

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
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the cache {tuple(k_cache.shape)} {k_cache.dtype}")


def _run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    groups: list[tuple[_Items, int]],
    kv_tile: int | None,
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
    kv_tile: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention of packed new tokens over keys read from the paged cache, including any
    cached prefix (prefix-cache hits, chunked prefill). q: [T, Hq, D]; caches [N, block, Hkv, D]."""
    return _run(q, k_cache, v_cache, meta, scale, [(_prefill_items(meta, None, q_tile), 1)], kv_tile)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_tile: int | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """Attention for sequences with one or a few new tokens (speculative verification), reading K/V
    through block tables; with num_splits > 1 each sequence's keys are split into that many ranges,
    processed side by side and merged with their (m, den) statistics."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    items = _decode_items(meta, None, num_splits)
    return _run(q, k_cache, v_cache, meta, scale, [(items, num_splits)], kv_tile)


def tiled_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """A mixed batch: sequences with few new tokens go the decode way, the rest the prefill way."""
    if meta.max_query_len <= DECODE_MAX_QUERY_LEN:  # all decoding: the common step, no partition
        groups = [(_decode_items(meta, None, 1), 1)]
    elif min(meta.query_lens_host) > DECODE_MAX_QUERY_LEN:
        groups = [(_prefill_items(meta, None, DEFAULT_Q_TILE), 1)]
    else:
        qlens = meta.query_lens_host
        decode = [i for i, n in enumerate(qlens) if n <= DECODE_MAX_QUERY_LEN]
        prefill = [i for i, n in enumerate(qlens) if n > DECODE_MAX_QUERY_LEN]
        groups = [(_decode_items(meta, decode, 1), 1), (_prefill_items(meta, prefill, DEFAULT_Q_TILE), 1)]
    return _run(q, k_cache, v_cache, meta, scale, groups, None)
