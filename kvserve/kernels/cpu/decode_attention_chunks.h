// The walk the vector kernels with lazy softmax (decode_attention_bf16.cpp, decode_attention_avx2.cpp) share:
// the threads claim parts of equal cost (ItemSplit) of the work items (a sequence and heads_per_item of its KV
// heads); each item's query rows of each head go through the keys in chunks of up to chunk_rows, so that a
// prefill's output rows stay in L1 across the tiles and each chunk reads only the keys its rows see; each
// chunk goes through its tiles of keys (decode_attention.h) while the next tile's K/V rows are asked for:
// the first chunk reads the item's keys from memory and asks for each next tile; later chunks find them in
// cache; the item's last tile asks for the next item's first. Each kernel computes a chunk's tiles and keeps
// its own per-row state.
#pragma once

#include "decode_attention.h"

namespace kvserve {

// One chunk of an item's query rows: rows first_row .. first_row + rows - 1 (in query_row's order) of each of
// `heads` KV heads from first_head. Chunk row r is row first_row + r % rows of KV head first_head + r / rows.
struct DecodeChunk {
  // Work item `item` (sequence seq_ids[item / (hkv / heads)]) from its row first_row, up to chunk_rows rows.
  DecodeChunk(const DecodeProblem& problem, int64_t item, int64_t item_heads, int64_t first, int64_t chunk_rows)
      : p(&problem),
        seq(problem.seq_ids[item / (problem.hkv / item_heads)]),
        first_head(item % (problem.hkv / item_heads) * item_heads),
        heads(item_heads),
        first_row(first),
        row0(problem.cu_seqlens_q[seq]),
        qlen(problem.cu_seqlens_q[seq + 1] - row0),
        slen(problem.seq_lens[seq]),
        rows(std::min(chunk_rows, qlen * group() - first_row)),
        table(problem.tables + seq * problem.table_width) {}

  const DecodeProblem* p;
  int64_t seq, first_head, heads, first_row;
  int64_t row0, qlen, slen;  // the sequence's first query row in q, its new tokens and its keys
  int64_t rows;              // per head
  const int64_t* table;      // the sequence's block table

  int64_t group() const { return p->hq / p->hkv; }
  QueryRow row(int64_t r) const { return query_row(first_row + r % rows, first_head + r / rows, group()); }
  // The row's query in q [T, Hq, D], and its row in out ((token row) * hq + query head; store_row's `at`).
  template <typename T>
  const T* query(const T* q, int64_t r) const {
    const QueryRow at = row(r);
    return q + (row0 + at.token) * p->q_row_stride + at.q_head * p->q_head_stride;
  }
  int64_t output_row(int64_t r) const {
    const QueryRow at = row(r);
    return (row0 + at.token) * p->hq + at.q_head;
  }
  // The last key row r sees (causal: up to its own position) and the first (its window's).
  int64_t last_key(int64_t r) const { return slen - qlen + row(r).token; }
  int64_t first_key(int64_t r) const { return first_visible_key(last_key(r), p->window); }
};

// Work items [begin, end) of one thread: for each chunk, start(chunk); then for each tile of keys the chunk
// sees, with the next tile's lines planned in `prefetch` (the kernel asks for them as it computes),
// tile(chunk, kv_start, nkeys, tile_at) (tile_at: cache_row of the chunk's first head at kv_start); then
// finish(chunk).
template <typename T, _mm_hint Hint, typename Start, typename OnTile, typename Finish>
void walk_chunks(const DecodeProblem& p, int64_t heads, int64_t chunk_rows, int64_t begin, int64_t end,
                 const T* k_cache, const T* v_cache, PacedPrefetch<T, Hint>& prefetch, Start&& start, OnTile&& tile,
                 Finish&& finish) {
  const int64_t group = p.hq / p.hkv;
  const auto chunk_at = [&](int64_t item, int64_t first_row) {
    return DecodeChunk(p, item, heads, first_row, chunk_rows);
  };
  for (int64_t item = begin; item < end; ++item) {
    const int64_t head_rows = chunk_at(item, 0).qlen * group;  // each head's rows
    for (int64_t first_row = 0; first_row < head_rows; first_row += chunk_rows) {
      const DecodeChunk chunk = chunk_at(item, first_row);
      const bool first_chunk = first_row == 0, last_chunk = first_row + chunk_rows >= head_rows;
      start(chunk);
      const int64_t keys_end = chunk_keys_end(chunk.slen, chunk.qlen, group, first_row, chunk.rows);
      for (int64_t kv_start = first_tile_key(p, chunk.last_key(0)), nkeys; kv_start < keys_end; kv_start += nkeys) {
        nkeys = tile_keys(p, kv_start, keys_end);
        if (first_chunk && kv_start + nkeys < keys_end) {
          prefetch.plan(p, chunk.table, kv_start + nkeys, kTile, keys_end, k_cache, v_cache, chunk.first_head, heads);
        } else if (last_chunk && kv_start + nkeys >= keys_end && item + 1 < end) {
          const DecodeChunk next = chunk_at(item + 1, 0);
          prefetch.plan(p, next.table, first_tile_key(p, next.slen - next.qlen), kTile, next.slen, k_cache, v_cache,
                        next.first_head, heads);
        }
        tile(chunk, kv_start, nkeys, cache_row(p, chunk.table, kv_start, chunk.first_head));
      }
      finish(chunk);
    }
  }
}

}  // namespace kvserve
