// Shared by the decode attention kernels (decode_attention.cpp: float32 widened, AVX-512, AVX2 and
// portable; decode_attention_bf16.cpp: AVX512-BF16; decode_attention_amx.cpp: Intel AMX tiles): the problem
// description, the tile of keys and the walk over them, the online softmax step and the prefetch of the next
// tile.
#pragma once

#include "common.h"
#include "work_claims.h"

namespace kvserve {

constexpr int64_t kTile = 16;

// One decode_attention call (the tensors' layout is described in decode_attention.cpp).
struct DecodeProblem {
  int64_t hq, hkv, dim, block_size, q_row_stride, q_head_stride, table_width;
  const int64_t *tables, *seq_lens, *cu_seqlens_q, *seq_ids;
  int64_t num_seqs;
  float scale;
  int64_t window;  // a query at position p sees keys p - window + 1 .. p; 0: keys 0 .. p (no window)
  // Set for one part of a key split (decode_attention_key_split.h): each row's output goes here in float32,
  // normalized over the part's keys, with its log-sum-exp in `lse`, instead of into out.
  float* partial = nullptr;
  float* lse = nullptr;  // per row: m + log l, the scaled scores' log-sum-exp over the part's keys
};

// The first key a query at `position` sees: 0, or with a window its window's first key.
inline int64_t first_visible_key(int64_t position, int64_t window) {
  return window > 0 && position >= window ? position - window + 1 : 0;
}

// A vector kernel's work item is one sequence and this many of its KV heads. Whole sequences (all heads)
// read each tile's K/V rows as one contiguous run, faster with the cache cold, as it is between a step's
// layers, than one item per head. One head per item only where there are too few sequences to keep every
// thread busy (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
inline int64_t heads_per_item(int64_t seqs, int64_t hkv, int64_t threads) { return seqs >= 2 * threads ? hkv : 1; }
inline int64_t heads_per_item(const DecodeProblem& p) {
  return heads_per_item(p.num_seqs, p.hkv, at::get_num_threads());
}

// The first key of the first tile a query row at `position` reads: its window's start (0 without a
// window), rounded down to a tile inside its cache block. A run of rows in query_row's order reads from
// its first row's, whose window starts earliest. Tiles hold up to kTile keys of one cache block, so no key
// index is divided per key.
inline int64_t first_tile_key(const DecodeProblem& p, int64_t position) {
  const int64_t first = first_visible_key(position, p.window);
  const int64_t block_start = first / p.block_size * p.block_size;
  return block_start + (first - block_start) / kTile * kTile;
}

// The number of keys in the tile starting at key kv_start of a sequence of slen keys.
inline int64_t tile_keys(const DecodeProblem& p, int64_t kv_start, int64_t slen) {
  return std::min({kTile, p.block_size - kv_start % p.block_size, slen - kv_start});
}

// The element offset of key `key`'s row of KV head `head` in a cache ([blocks, block_size, Hkv, D]), for the
// sequence with block table `table`.
inline int64_t cache_row(const DecodeProblem& p, const int64_t* table, int64_t key, int64_t head) {
  return (table[key / p.block_size] * p.block_size + key % p.block_size) * p.hkv * p.dim + head * p.dim;
}

// Where query row r of a KV head reads and writes: row r of KV head `kv_head` is new token
// r / group of its sequence (0-based among the sequence's new tokens), query head
// kv_head * group + r % group. The same for every kernel, so both agree on the row order.
struct QueryRow {
  int64_t token, q_head;
};
inline QueryRow query_row(int64_t r, int64_t kv_head, int64_t group) {
  return {r / group, kv_head * group + r % group};
}

// One past the last key a chunk of query rows sees: its last row (rows are in query_row's order, so
// the latest token) sees keys up to its own position, and no row of the chunk sees further.
inline int64_t chunk_keys_end(int64_t slen, int64_t qlen, int64_t group, int64_t first_row, int64_t rows) {
  return slen - qlen + query_row(first_row + rows - 1, 0, group).token + 1;
}

// Contiguous ranges of work items (parts), of about equal cost, for the threads to claim (work_claims.h):
// claim_count's number, so a preempted thread holds up a call by one part. Item i is sequence
// seq_ids[i / items_per_seq] and `heads` of its KV heads (items_per_seq = hkv / heads). A step mixing
// prefill chunks with decode rows has items whose costs differ 100-fold, so equal item counts
// (at::parallel_for's split) could leave one thread with all the prefill. Cost of an item: per head, for
// each chunk of chunk_rows query rows, the keys it scans (up to its last row's position, in steps of
// step_keys) plus one step for setting the chunk up.
class ItemSplit {
 public:
  ItemSplit(const DecodeProblem& p, int64_t heads, int64_t chunk_rows, int64_t step_keys)
      : cost_(p.num_seqs * (p.hkv / heads) + 1, 0) {
    const int64_t group = p.hq / p.hkv, items_per_seq = p.hkv / heads, items = p.num_seqs * items_per_seq;
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq = p.seq_ids[item / items_per_seq];
      const int64_t qlen = p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq], slen = p.seq_lens[seq];
      int64_t cost = 0;
      for (int64_t first_row = 0; first_row < qlen * group; first_row += chunk_rows) {
        const int64_t rows = std::min(chunk_rows, qlen * group - first_row);
        cost += (chunk_keys_end(slen, qlen, group, first_row, rows) + step_keys - 1) / step_keys + 1;
      }
      cost_[item + 1] = cost_[item] + heads * cost;
    }
    parts_ = claim_count(items);
  }
  int64_t parts() const { return parts_; }
  // The first item of part `part` (part == parts(): one past the last item).
  int64_t first_item(int64_t part) const {
    if (part >= parts_) return static_cast<int64_t>(cost_.size()) - 1;
    const int64_t target = cost_.back() * part / parts_;
    return std::lower_bound(cost_.begin(), cost_.end(), target) - cost_.begin();
  }

 private:
  std::vector<int64_t> cost_;  // prefix sums: cost_[i] is the cost of items 0 .. i-1
  int64_t parts_;
};

// out's row for a query: acc / l, rounded once to the output dtype. l >= 1: in both kernels the
// reference m is one of the row's own scores, whose term exp(0) = 1 is in l.
template <typename T>
inline void store_normalized(T* __restrict dst, const float* __restrict acc, float l, int64_t dim) {
  const float inv = 1.f / l;
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) dst[i] = from_float<T>(acc[i] * inv);
}

// Where a kernel leaves output row `at` ((token row) * hq + query head), acc / l: in out, or for a key
// split's part in p.partial with the row's log-sum-exp m + log l (p = exp(scale * q.k - m) in both kernels).
template <typename T>
inline void store_row(const DecodeProblem& p, T* out, int64_t at, const float* acc, float m, float l) {
  if (p.partial == nullptr) {
    store_normalized(out + at * p.dim, acc, l, p.dim);
    return;
  }
  store_normalized(p.partial + at * p.dim, acc, l, p.dim);
  p.lse[at] = m + std::log(l);
}

// One row's online-softmax step for keys `first` .. `visible` - 1 of a tile (first < visible; keys before
// `first` lie outside the row's window): turns the raw scores q.k into p_j = exp(scale * q.k_j - m_new),
// 0 outside those keys, where m_new is the running max including this tile; adds their sum to l after
// rescaling it, and returns alpha = exp(m_old - m_new), the factor the row's accumulator must be rescaled
// by. In the widest lanes the build has (one AVX-512 register per tile, two AVX2 ones).
inline float softmax_tile(float* __restrict scores, int64_t first, int64_t visible, float scale, float& m, float& l) {
  using V = WideLanes;
  constexpr int64_t lanes = sizeof(V) / sizeof(float), parts = kTile / lanes;
  static_assert(kTile % lanes == 0, "a tile is whole registers");
  const V floor = splat<V>(-1e30f);
  V s[parts], max_so_far = floor;
  for (int64_t i = 0; i < parts; ++i) {  // scores past `visible` are not defined: -1e30 for the max
    s[i] = lanes_first(visible - i * lanes, lanes_load(scores + i * lanes, V{}) * splat<V>(scale), floor);
    s[i] = lanes_first(first - i * lanes, floor, s[i]);  // nor are those before `first` seen
    max_so_far = lanes_max(max_so_far, s[i]);
  }
  const float tile_max = reduce_max(max_so_far);
  const float m_new = m > tile_max ? m : tile_max;
  const float alpha = fast_exp(m - m_new);
  V sum = splat<V>(0.f);
  for (int64_t i = 0; i < parts; ++i) {  // and 0 after the exp
    V p = lanes_first(visible - i * lanes, fast_exp(s[i] - splat<V>(m_new)), splat<V>(0.f));
    p = lanes_first(first - i * lanes, splat<V>(0.f), p);
    lanes_store(scores + i * lanes, p);
    sum = sum + p;
  }
  l = l * alpha + reduce_add(sum);
  m = m_new;
  return alpha;
}

// The K and V rows of an item's next keys, asked for a few cache lines at a time while the current keys
// are computed: cache blocks lie anywhere, so the hardware prefetcher loses the stream at every block
// boundary. Why a few at a time: a core has ~16 line-fill buffers, and the 128-384 prefetches of a tile
// asked for at once held the core until most of them had been sent, so the kernel's memory reads and its
// arithmetic ran one after the other (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
// Hint: the cache level asked for (_MM_HINT_T0: L1; _MM_HINT_T1: L2), the one measured best for each kernel.
template <typename T, _mm_hint Hint>
class PacedPrefetch {
 public:
  // Plans keys key .. min(key + nkeys, keys_end) - 1 of the sequence with block table `table`, the rows of
  // `heads` KV heads from `first_head`, replacing what is left of the previous plan: one run of rows per
  // cache block, walked line by line as they are asked for (no list of lines is built).
  void plan(const DecodeProblem& p, const int64_t* table, int64_t key, int64_t nkeys, int64_t keys_end,
            const T* k_cache, const T* v_cache, int64_t first_head, int64_t heads) {
    count_ = run_ = row_ = offset_ = 0;
    pairs_left_ = kMaxLines / 2;
    key_bytes_ = p.hkv * p.dim * static_cast<int64_t>(sizeof(T));
    row_bytes_ = heads * p.dim * static_cast<int64_t>(sizeof(T));
    const int64_t end = std::min(key + nkeys, keys_end);
    while (key < end && count_ < kMaxRuns) {  // runs of keys inside one block: one table look-up per run
      const int64_t run = std::min(p.block_size - key % p.block_size, end - key);
      const int64_t first = cache_row(p, table, key, first_head);
      runs_[count_++] = {reinterpret_cast<const char*>(k_cache + first), reinterpret_cast<const char*>(v_cache + first),
                         run};
      key += run;
    }
  }
  // The lines the plan will ask for in all.
  int64_t lines() const {
    int64_t keys = 0;
    for (int64_t i = 0; i < count_; ++i) keys += runs_[i].rows;
    return std::min(kMaxLines, 2 * keys * ((row_bytes_ + 63) / 64));
  }
  // Asks for the next `n` lines of the plan, a K line and its V line in turn (all that are left with n < 0).
  void issue(int64_t n) {
    for (int64_t asked = 0; (n < 0 || asked < n) && run_ < count_ && pairs_left_ > 0; asked += 2, --pairs_left_) {
      const int64_t at = row_ * key_bytes_ + offset_;
      _mm_prefetch(runs_[run_].k + at, Hint);
      _mm_prefetch(runs_[run_].v + at, Hint);
      offset_ += 64;
      if (offset_ >= row_bytes_) {  // the row's last line: on to the next key, or the next run
        offset_ = 0;
        if (++row_ == runs_[run_].rows) {
          row_ = 0;
          ++run_;
        }
      }
    }
  }

 private:
  static constexpr int64_t kMaxLines = 512;  // a plan past this (long rows) asks for its first lines only
  static constexpr int64_t kMaxRuns = 64;    // a plan of more keys than this, one per block, stops there
  struct Run {
    const char *k, *v;  // the run's first key's rows
    int64_t rows;       // keys, key_bytes_ apart
  };
  Run runs_[kMaxRuns];
  int64_t count_ = 0, run_ = 0, row_ = 0, offset_ = 0, pairs_left_ = 0, key_bytes_ = 0, row_bytes_ = 0;
};

// The AMX kernel (decode_attention_amx.cpp), for bf16 caches where amx_decode_supported says the
// shapes and the CPU allow it. The float32 overload computes nothing and returns false.
bool amx_decode_supported(const DecodeProblem& p);
bool decode_attention_amx(const DecodeProblem& p, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          uint16_t* out);
inline bool decode_attention_amx(const DecodeProblem&, const float*, const float*, const float*, float*) {
  return false;
}

// The AVX512-BF16 kernel (decode_attention_bf16.cpp), for bf16 caches: false, having computed nothing,
// where the build lacks AVX512-BF16, the head dim is not a multiple of 32 or set_bf16_attention is off. The float32
// overload computes nothing and returns false.
bool decode_attention_bf16(const DecodeProblem& p, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                           uint16_t* out);
inline bool decode_attention_bf16(const DecodeProblem&, const float*, const float*, const float*, float*) {
  return false;
}

// The AVX2 kernel (decode_attention_avx2.cpp), for bf16 and float32 caches: false, having computed nothing,
// where the build is not the avx2 path's (AVX2 without AVX-512), the head dim is not a multiple of 32 or
// set_avx2_attention is off.
template <typename T>
bool decode_attention_avx2(const DecodeProblem& p, const T* q, const T* k_cache, const T* v_cache, T* out);

}  // namespace kvserve
