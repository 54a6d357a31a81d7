// Decode attention for fewer sequences than the threads can share, with each sequence's keys split into
// parts (flash-decoding's split-KV): a vector kernel's work item is a sequence and some of its KV heads,
// so a batch of one SmolLM2 row is 3 items on 2 threads (one thread scans two thirds of the keys) and one
// Gemma 3 row, a single KV head, is 1 item (one thread scans all). Each part is run as a sequence of its
// own -- the same decode row over a window of the part's keys -- and leaves its rows in float32 with their
// log-sum-exp; the parts of a row are then merged exactly: out = sum_i w_i o_i / sum_i w_i, w_i = exp(lse_i
// - max lse), rounded once to the output dtype (figures: benchmarks/RESULTS.md, "Decode attention split
// by keys").
#pragma once

#include "decode_attention.h"

#include <cmath>
#include <memory>
#include <vector>

namespace kvserve {

// A split pays where the busiest thread's unsplit share of K/V bytes exceeds an even share by at least
// this: a split costs a few microseconds per call (the parts' copies and merge, an item's setup per part),
// about what reading this many bytes takes (figures: benchmarks/RESULTS.md, "Decode attention split by keys").
constexpr int64_t kMinExcessBytes = 192 << 10;

// A vector kernel's work items for a problem of `seqs` sequences.
inline int64_t vector_items(int64_t seqs, int64_t hkv, int64_t threads) {
  return seqs * (hkv / heads_per_item(seqs, hkv, threads));
}

// The keys sequence `seq`'s decode row sees: its last `window` keys, or all of them.
inline int64_t decode_row_keys(const DecodeProblem& p, int64_t seq) {
  return p.seq_lens[seq] - first_visible_key(p.seq_lens[seq] - 1, p.window);
}

// How many keys each part of a split holds (the most keys a row sees, over the number of parts), or 0 where
// no split applies. A split applies where the threads get unequal shares of the items -- `threads` > 1 and
// fewer than 2 sequences per thread (single KV heads per item), their count not a multiple of the threads --
// by at least kMinExcessBytes (counting every sequence as long as the longest), and every row is a decode
// row (one new token). Not for several sequences of a single KV head (Gemma 3): there the parts only even
// out whole-sequence items, which measured neutral to slower; with several KV heads they also become
// whole-sequence items, whose K/V rows are read as one run (heads_per_item). The fewest parts whose items
// share out evenly; where a sliding window cuts a sequence's keys, only a number of parts that divides the
// window, so that the parts (each a window of its own) tile it exactly.
inline int64_t key_split_part_keys(const DecodeProblem& p, int64_t threads, int64_t element_bytes) {
  const int64_t items = vector_items(p.num_seqs, p.hkv, threads);
  if (threads < 2 || p.num_seqs >= 2 * threads || items % threads == 0 || (p.num_seqs > 1 && p.hkv == 1)) return 0;
  int64_t max_keys = 0;
  bool window_cuts = false;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t seq = p.seq_ids[s], keys = decode_row_keys(p, seq);
    if (p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq] != 1) return 0;
    window_cuts = window_cuts || keys < p.seq_lens[seq];
    max_keys = std::max(max_keys, keys);
  }
  const int64_t busiest = (items + threads - 1) / threads, item_bytes = max_keys * 2 * p.dim * element_bytes;
  if ((busiest * threads - items) * item_bytes < kMinExcessBytes * threads) return 0;
  int64_t parts = 2;  // at most `threads`: then num_seqs * threads items, or that times hkv, share out
  while (vector_items(p.num_seqs * parts, p.hkv, threads) % threads != 0) ++parts;
  if (window_cuts && p.window % parts != 0) return 0;
  return (max_keys + parts - 1) / parts;
}

// Runs `vector_kernel(problem, q, out)` (a vector kernel of decode_attention.cpp) over parts of part_keys
// keys (key_split_part_keys) of the keys each sequence's row sees and merges them into out's rows. Part i of
// a sequence of n keys is keys n - (i + 1) * part_keys .. n - i * part_keys - 1 (from its first visible key
// for the last), run as a sequence of n - i * part_keys keys whose query sees a window of part_keys; its
// table row and query row are copied, so the parts are sequences 0 .. V - 1 of a problem of their own.
template <typename T, typename VectorKernel>
void decode_attention_key_split(const DecodeProblem& p, int64_t part_keys, const T* q, T* out,
                                const VectorKernel& vector_kernel) {
  const int64_t hq = p.hq, dim = p.dim, width = p.table_width;

  std::vector<int64_t> tables, seq_lens, first_part(p.num_seqs + 1, 0);  // sequence s: parts first_part[s] ..
  std::vector<T> q_rows;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t seq = p.seq_ids[s], first_key = p.seq_lens[seq] - decode_row_keys(p, seq);
    const T* q_row = q + p.cu_seqlens_q[seq] * p.q_row_stride;
    for (int64_t keys_end = p.seq_lens[seq]; keys_end > first_key; keys_end -= part_keys) {
      tables.insert(tables.end(), p.tables + seq * width, p.tables + (seq + 1) * width);
      seq_lens.push_back(keys_end);
      for (int64_t h = 0; h < hq; ++h)
        q_rows.insert(q_rows.end(), q_row + h * p.q_head_stride, q_row + h * p.q_head_stride + dim);
    }
    first_part[s + 1] = static_cast<int64_t>(seq_lens.size());
  }
  const int64_t count = first_part.back();
  std::vector<int64_t> rows(count + 1), ids(count);  // part v: query row v, sequence v
  for (int64_t v = 0; v <= count; ++v) rows[v] = v;
  for (int64_t v = 0; v < count; ++v) ids[v] = v;
  const std::unique_ptr<float[]> partial(new float[count * hq * dim]), lse(new float[count * hq]);  // not zeroed

  DecodeProblem split = p;
  split.q_row_stride = hq * dim;
  split.q_head_stride = dim;
  split.tables = tables.data();
  split.seq_lens = seq_lens.data();
  split.cu_seqlens_q = rows.data();
  split.seq_ids = ids.data();
  split.num_seqs = count;
  split.window = part_keys;
  split.partial = partial.get();
  split.lse = lse.get();
  vector_kernel(split, q_rows.data(), static_cast<T*>(nullptr));

  std::vector<float> sum(dim);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t first = first_part[s], n = first_part[s + 1] - first;
    for (int64_t h = 0; h < hq; ++h) {
      float max_lse = -INFINITY, total = 0.f;
      for (int64_t i = 0; i < n; ++i) max_lse = std::max(max_lse, lse[(first + i) * hq + h]);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float w = std::exp(lse[(first + i) * hq + h] - max_lse);
        const float* o = &partial[((first + i) * hq + h) * dim];
        for (int64_t d = 0; d < dim; ++d) sum[d] += w * o[d];
        total += w;
      }
      store_normalized(out + (p.cu_seqlens_q[p.seq_ids[s]] * hq + h) * dim, sum.data(), total, dim);
    }
  }
}

}  // namespace kvserve
