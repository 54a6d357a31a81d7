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
are processed together, vectorized over items and heads; the only Python loop is over KV tiles. K/V
rows are gathered per (slot, KV head), so a tile lands head-major and each of its two products is
one batched matmul over (item, KV head). Items are sorted by how many keys they visit, so the items
still active at tile t are a prefix and finished ones cost nothing.

Everything that depends only on the batch -- items, order, tiles, gather indices, causal masks, the
decode/prefill partition -- is a *plan*, built by the first layer and memoized on the
AttentionMetadata that every layer of the forward pass shares; each layer then only executes it:
gathers, two matmuls and the softmax update per tile (about a dozen torch ops for a plain decode
step, against ~70 when every layer planned for itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.intmath import div_ceil
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


def _window_start(kv_start: torch.Tensor, qpos0: torch.Tensor, window: int | None) -> torch.Tensor:
    """An item's first key to visit with a sliding window: none before its first row's window (so no
    released slot, kernels/metadata.py, is ever read)."""
    return kv_start if window is None else torch.maximum(kv_start, qpos0 - window + 1)


def _prefill_items(meta: AttentionMetadata, seqs: list[int] | None, q_tile: int, window: int | None) -> _Items:
    """One item per query tile of each sequence in seqs; a tile visits keys 0 (or its first row's window
    start) .. its last position."""
    ids, qlen, slen, row0 = _host_lengths(meta, seqs)
    tiles = (qlen + q_tile - 1) // q_tile  # tensors: div_ceil is for ints
    owner = torch.repeat_interleave(torch.arange(len(ids)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    start = (torch.arange(len(owner)) - first_tile[owner]) * q_tile  # row offset in the sequence
    nrows = torch.clamp(qlen[owner] - start, max=q_tile)
    qpos0 = slen[owner] - qlen[owner] + start
    kv_start = _window_start(torch.zeros_like(qpos0), qpos0, window)
    table = torch.stack([ids[owner], row0[owner] + start, nrows, qpos0, kv_start, qpos0 + nrows])
    return _Items(table, q_tile)


def _decode_items(meta: AttentionMetadata, seqs: list[int] | None, num_splits: int, window: int | None) -> _Items:
    """num_splits items per sequence (split-major): all its query rows, 1/num_splits of its keys each
    (of those its first row's window starts at, with a window)."""
    ids, qlen, slen, row0 = (x.repeat(num_splits) for x in _host_lengths(meta, seqs))
    first = _window_start(torch.zeros_like(slen), slen - qlen, window)
    chunk = (slen - first + num_splits - 1) // num_splits
    kv_start = first + torch.arange(num_splits).repeat_interleave(len(ids) // num_splits) * chunk
    kv_end = torch.minimum(kv_start + chunk, slen)  # empty (end <= start) for surplus splits
    table = torch.stack([ids, row0, qlen, slen - qlen, kv_start, kv_end])
    return _Items(table, int(qlen.max()))


@dataclass
class _Tile:
    """One KV tile of a plan: which cache rows to gather and which scores to hide."""

    n: int  # items still active: a prefix of the sorted items
    index: torch.Tensor  # int64 [n * Hkv * kv_tile]: row slot * Hkv + head of the [slots * Hkv, D] cache view
    mask_lo: int  # the mask covers items mask_lo .. mask_lo + len(mask) - 1
    mask: torch.Tensor | None  # bool [m, 1, R, 1, kv_tile], True where a key is hidden from a row; None: none is


@dataclass
class _Plan:
    """Everything about running one group of items that depends only on the metadata and the head shapes,
    built once per AttentionMetadata and reused by every layer. Items are in sorted order (longest key
    range first) when there are several tiles or empty items; else all are active at the one tile and
    keep the given order."""

    w: int  # items
    rows_per_item: int  # R: query rows per item, padding rows included
    kv_tile: int
    num_splits: int
    tiles: list[_Tile]
    # Rows of q and out viewed as [tokens * Hkv, G * D] (token * Hkv + head) per (item, KV head, query row).
    q_index: torch.Tensor | None  # int64 [W * Hkv * R], sorted items; None: q's rows are already in that order
    inv: torch.Tensor | None  # int64 [W]: sorted order -> split-major order; None: already in that order
    dest: torch.Tensor | None  # int64 [W / splits * Hkv * R], out row T * Hkv + head for padding; None: q's order
    floor_max: bool  # some row sees no key of its item: floor its first max at M_FLOOR (an exp(-inf + inf) guard)
    zero: torch.Tensor  # float32 scalar: the ignored input of baddbmm


def _plan(
    meta: AttentionMetadata,
    items: _Items,
    num_splits: int,
    kv_tile: int | None,
    t_rows: int,
    shape: tuple[int, int, int],
    dev: torch.device,
    window: int | None = None,
) -> _Plan:
    """Sort the items, cut their key ranges into tiles and precompute each tile's gather rows and causal
    (and sliding-window) mask. Padding query rows (items with fewer than R rows) are left unmasked: they see keys, stay
    finite and are discarded, so every row ends with den >= 1 and the final division needs no guard."""
    group, hkv, d = shape
    bs = meta.block_size
    kv_len = (items.kv_end - items.kv_start).clamp_min(0)
    w, rows_per_item = kv_len.numel(), items.max_rows
    mg = rows_per_item * group  # rows of one (item, KV head) matrix: (query row, head within group)
    longest = int(kv_len.max())
    if kv_tile is None:
        kv_tile = max(16, TILE_BYTES // (w * hkv * (2 * d + mg) * 4))
    n_tiles = div_ceil(longest, kv_tile)
    kv_tile = div_ceil(longest, n_tiles)  # same tile count, equal tiles: no padded tail past the longest
    # Sorted, the items active at a tile are a prefix; with one tile and no empty item, all are active.
    sort = n_tiles > 1 or int(kv_len.min()) == 0
    order = torch.argsort(kv_len, descending=True, stable=True) if sort else torch.arange(w)
    sorted_len = kv_len[order]
    active = (sorted_len.unsqueeze(0) > torch.arange(n_tiles).unsqueeze(1) * kv_tile).sum(1).tolist()
    it = items.select(order, dev)

    j = torch.arange(rows_per_item, device=dev)
    valid = j < it.nrows.unsqueeze(1)  # [W, R]
    # Row r may see key p iff p <= qlim[r]: causal and inside the item's key range; padding rows see all.
    qlim = torch.minimum(it.qpos0.unsqueeze(1) + j, it.kv_end.unsqueeze(1) - 1)
    floor_max = bool(((qlim < it.kv_start.unsqueeze(1)) & valid & (it.kv_end > it.kv_start).unsqueeze(1)).any())
    qlim = qlim.masked_fill(~valid, torch.iinfo(torch.int64).max)
    # With a window, row r sees p only if p > qpos - window too: padding rows keep seeing every key. A row
    # may then see no key of the first tile (later rows' windows start later): its max is floored.
    qlow = None
    if window is not None:
        qlow = (it.qpos0.unsqueeze(1) + j - window).masked_fill(~valid, -1)
        floor_max = True
    rows = torch.where(valid, it.row0.unsqueeze(1) + j, t_rows)  # [W, R]; padding rows -> out row T

    tables = meta.block_tables.index_select(0, it.seq)
    last_col = tables.shape[1] - 1
    offsets = torch.arange(kv_tile, device=dev)
    heads = torch.arange(hkv, device=dev).view(1, hkv, 1)
    tiles = []
    for t, n in enumerate(active):
        kpos = it.kv_start[:n, None] + (t * kv_tile + offsets)  # [n, kv_tile]
        # Positions past an item's end read padding table entries (any valid block): masked below.
        col = torch.div(kpos, bs, rounding_mode="floor").clamp_max_(last_col)
        slot = tables[:n].gather(1, col) * bs + kpos % bs
        index = (slot.unsqueeze(1) * hkv + heads).view(-1)  # [n, Hkv, kv_tile]: head-major per item
        hidden = kpos.unsqueeze(1) > qlim[:n].unsqueeze(2)  # [n, R, kv_tile]
        if qlow is not None:
            hidden |= kpos.unsqueeze(1) <= qlow[:n].unsqueeze(2)
        masked = torch.nonzero(hidden.flatten(1).any(1)).view(-1).tolist()
        mask = None
        if masked:  # items sorted by key count: the ones needing a mask here are (nearly) a contiguous run
            lo, hi = masked[0], masked[-1] + 1
            mask = hidden[lo:hi].view(hi - lo, 1, rows_per_item, 1, kv_tile).clone()  # not a view: hidden is big
        tiles.append(_Tile(n, index, masked[0] if masked else 0, mask))

    identity = n_tiles == 1 and num_splits == 1 and rows_per_item == 1 and w == t_rows
    identity = identity and bool((rows.view(-1) == torch.arange(w, device=dev)).all())
    # q and out are viewed as [tokens * Hkv, G * D]: one row per (token, KV head), indexed per
    # (item, KV head, query row), the order of the [W * Hkv, R * G, D] matrices the kernel runs.
    q_index = (rows.clamp_max(t_rows - 1).unsqueeze(1) * hkv + heads).flatten()
    inv = None
    if num_splits > 1 and sort:
        inv = torch.argsort(order).to(dev)
    if num_splits > 1:  # the output comes in split-major order, its first W / num_splits items
        rows = rows.index_select(0, inv[: w // num_splits]) if inv is not None else rows[: w // num_splits]
    dest = (rows.unsqueeze(1) * hkv + heads).flatten()
    return _Plan(
        w=w,
        rows_per_item=rows_per_item,
        kv_tile=kv_tile,
        num_splits=num_splits,
        tiles=tiles,
        q_index=None if identity else q_index,
        inv=inv,
        dest=None if identity else dest,
        floor_max=floor_max,
        zero=torch.zeros((), device=dev),
    )


def _execute(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, plan: _Plan) -> torch.Tensor:
    """One layer's attention for the items of a plan: [W' * Hkv, R * G, D] float32 outputs, one matrix
    per (sequence item, KV head) in the plan's output order (W' = W / num_splits)."""
    t_rows, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    w, r, kv_tile = plan.w, plan.rows_per_item, plan.kv_tile
    mg = r * group
    # One float32 [R * G, D] matrix per (item, KV head): q as rows of (token, KV head), gathered in
    # (item, KV head, row) order or already in it. to() and reshape() copy only what they must.
    qi = q.to(torch.float32, memory_format=torch.contiguous_format).reshape(t_rows * hkv, group * d)
    if plan.q_index is not None:
        qi = qi.index_select(0, plan.q_index)
    qi = qi.view(w * hkv, mg, d)
    # One row per (slot, head): the gather lands head-major, so each tile is one batched matmul.
    k_rows, v_rows = k_cache.view(-1, d), v_cache.view(-1, d)
    widen = k_cache.dtype != torch.float32  # scores and sums in float32 whatever the cache dtype
    for t, tile in enumerate(plan.tiles):
        nh = tile.n * hkv
        k = k_rows.index_select(0, tile.index)
        k = (k.float() if widen else k).view(nh, kv_tile, d)
        s = torch.baddbmm(plan.zero, qi[:nh], k.transpose(1, 2), beta=0, alpha=scale)  # [nh, R * G, kv_tile]
        if tile.mask is not None:
            lo = tile.mask_lo
            s.view(tile.n, hkv, r, group, kv_tile)[lo : lo + len(tile.mask)].masked_fill_(tile.mask, float("-inf"))
        v = v_rows.index_select(0, tile.index)
        v = (v.float() if widen else v).view(nh, kv_tile, d)
        if t == 0:  # the state starts empty (m = M_FLOOR, den = 0, acc = 0): nothing to rescale
            m = s.amax(-1, keepdim=True)
            if plan.floor_max:
                m.clamp_min_(M_FLOOR)
            s.sub_(m).exp_()
            den = s.sum(-1, keepdim=True)
            acc = torch.bmm(s, v)
            if nh < w * hkv:  # items with no key at all (surplus splits) keep the empty state
                tail = (w * hkv - nh, mg)
                m = torch.cat([m, m.new_full((*tail, 1), M_FLOOR)])
                den = torch.cat([den, den.new_zeros((*tail, 1))])
                acc = torch.cat([acc, acc.new_zeros((*tail, d))])
            continue
        # Alg. 1's update with the tile's probabilities taken relative to the new running max, so
        # only the running state is rescaled (by exp(m_old - m_new)) and P V accumulates in place.
        m_old = m[:nh]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        s.sub_(m_new).exp_()
        alpha = m_old.sub_(m_new).exp_()
        den[:nh].mul_(alpha).add_(s.sum(-1, keepdim=True))
        acc[:nh].mul_(alpha).baddbmm_(s, v)
        m_old.copy_(m_new)

    if plan.num_splits > 1:
        # Back to split-major item order, then fold the splits of each sequence together.
        m, den, acc = (x.view(w, hkv * mg, -1) for x in (m, den, acc))
        if plan.inv is not None:
            m, den, acc = (x.index_select(0, plan.inv) for x in (m, den, acc))
        m, den, acc = (x.unflatten(0, (plan.num_splits, -1)) for x in (m, den, acc))
        state = (m[0, ..., 0], den[0, ..., 0], acc[0])
        for i in range(1, plan.num_splits):
            state = merge_attention_states(*state, m[i, ..., 0], den[i, ..., 0], acc[i])
        _, den, acc = state
        den, acc = den.view(-1, mg, 1), acc.view(-1, mg, d)
    # Every row saw at least one key (padding rows are unmasked), so den >= 1: no 0 / 0.
    return acc.div_(den)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dtype != k_cache.dtype or k_cache.shape != v_cache.shape or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the cache {tuple(k_cache.shape)} {k_cache.dtype}")


def _run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key: tuple,
    make_groups: Callable[[], list[tuple[_Items, int]]],
    kv_tile: int | None,
    window: int | None = None,
) -> torch.Tensor:
    """Plan (once per metadata, key, window and head shapes), then execute. make_groups: (items,
    num_splits) pairs."""
    _check(q, k_cache, v_cache)
    t_rows, hq, d = q.shape
    hkv = k_cache.shape[2]
    key = ("tiled", *key, kv_tile, window, t_rows, hq, hkv, d, q.device)
    plans = meta.plans.get(key)
    if plans is None:
        shape = (hq // hkv, hkv, d)
        plans = [_plan(meta, items, ns, kv_tile, t_rows, shape, q.device, window) for items, ns in make_groups()]
        meta.plans[key] = plans
    if len(plans) == 1 and plans[0].dest is None:  # pure decode in batch order: the result is the output
        return _execute(q, k_cache, v_cache, scale, plans[0]).to(q.dtype).view(t_rows, hq, d)
    out = q.new_empty((t_rows + 1, hq, d))
    rows = out.view(-1, (hq // hkv) * d)  # one row per (token, KV head), as plan.dest indexes them
    for plan in plans:
        res = _execute(q, k_cache, v_cache, scale, plan)
        rows.index_copy_(0, plan.dest, res.view(len(plan.dest), -1).to(q.dtype))
    return out[:-1]


def tiled_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    q_tile: int = DEFAULT_Q_TILE,
    kv_tile: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention of packed new tokens over keys read from the paged cache, including any
    cached prefix (prefix-cache hits, chunked prefill). q: [T, Hq, D]; caches [N, block, Hkv, D]."""
    groups = lambda: [(_prefill_items(meta, None, q_tile, window), 1)]  # noqa: E731
    return _run(q, k_cache, v_cache, meta, scale, ("prefill", q_tile), groups, kv_tile, window)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_tile: int | None = None,
    num_splits: int = 1,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for sequences with one or a few new tokens (speculative verification), reading K/V
    through block tables; with num_splits > 1 each sequence's keys are split into that many ranges,
    processed side by side and merged with their (m, den) statistics."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    groups = lambda: [(_decode_items(meta, None, num_splits, window), num_splits)]  # noqa: E731
    return _run(q, k_cache, v_cache, meta, scale, ("decode", num_splits), groups, kv_tile, window)


def tiled_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """A mixed batch: sequences with few new tokens go the decode way, the rest the prefill way."""
    groups = lambda: _mixed_groups(meta, window)  # noqa: E731
    return _run(q, k_cache, v_cache, meta, scale, ("mixed",), groups, None, window)


def _mixed_groups(meta: AttentionMetadata, window: int | None) -> list[tuple[_Items, int]]:
    if meta.max_query_len <= DECODE_MAX_QUERY_LEN:  # all decoding: the common step, no partition
        groups = [(_decode_items(meta, None, 1, window), 1)]
    elif min(meta.query_lens_host) > DECODE_MAX_QUERY_LEN:
        groups = [(_prefill_items(meta, None, DEFAULT_Q_TILE, window), 1)]
    else:
        qlens = meta.query_lens_host
        decode = [i for i, n in enumerate(qlens) if n <= DECODE_MAX_QUERY_LEN]
        prefill = [i for i, n in enumerate(qlens) if n > DECODE_MAX_QUERY_LEN]
        groups = [
            (_decode_items(meta, decode, 1, window), 1),
            (_prefill_items(meta, prefill, DEFAULT_Q_TILE, window), 1),
        ]
    return groups
