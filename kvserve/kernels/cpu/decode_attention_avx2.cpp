// Decode attention on AVX2 (the avx2 path's build: no AVX-512), bf16 or float32 caches: decode_attention.cpp's
// tiled online softmax with K and V read where they lie in the cache and widened to float32 in registers,
// each widened vector serving a block of up to kBlockRows query rows of its KV head (a decode step's 3 query
// heads per KV head, in SmolLM2):
//   scores [row][key] = q_row . K [key]       kBlockRows rows x kScoreKeys keys of sums in registers, reduced
//                                              four keys at a time
//   out [row][d]     += P [row][key] . V [key] kBlockRows rows x kPartVectors vectors of sums in registers
// The products are float32 multiply-adds of exactly widened values. What makes it cheaper per tile than the
// widened kernel it replaces on this path, which regroups and widens each tile into buffers and reads them back
// (figures: benchmarks/RESULTS.md, "Decode attention on AVX2 without regrouped tiles"):
// - nothing is copied: no regrouped tile is written and read back, and each key's widening is done once for
//   a block of rows, not once per row as loads of a bf16 row would be;
// - the softmax is rescaled lazily, as in decode_attention_bf16.cpp: each row's exponentials are taken against
//   a reference max that moves only when a tile's max exceeds it by more than kRescaleAbove, so a tile costs
//   no exp of its own and no pass over the row's output; the reference cancels in out / l.
// Keys past a tile's count are never read: score blocks of four keys read the last key again in their place
// (its scores lie past `visible` and are masked), and P.V stops at the count.
#include "decode_attention_chunks.h"
#include "work_claims.h"

#include <atomic>

namespace kvserve {

namespace {
std::atomic<bool> avx2_enabled{true};
}  // namespace

bool set_avx2_attention(bool enabled) { return avx2_enabled.exchange(enabled); }

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
namespace {

constexpr int64_t kLanes = 8;
// Query rows whose products share each widened K or V vector: 3 x 4 score sums, or 3 x 4 output vectors,
// with the widened vector and the rows' three broadcasts, fill AVX2's 16 registers.
constexpr int kBlockRows = 3;
constexpr int kScoreKeys = 4;
constexpr int kPartVectors = 4;  // 32 dims of an output row per pass over a tile's keys
constexpr int64_t kPartDims = kPartVectors * kLanes;
// Query rows of each head taken through the keys together, as in decode_attention_bf16.cpp: every decode row
// of a sequence, and a prefill in chunks whose output rows stay in L1 (3 heads x 32 rows x 64 dims of float32).
constexpr int64_t kChunkRows = 32;
constexpr float kRescaleAbove = 8.f;  // natural-log units: probabilities stay <= e^8 ~ 3e3
// Prefetches into L2 (PacedPrefetch, decode_attention.h), asked for after each block of rows' scores and after
// its P.V: the next tile's lines in equal shares, at least this many each time, the rest after the tile's last
// head. Shares over the whole tile, not fixed batches: Gemma 3's tiles (one KV head of 256 dims, two blocks of
// rows) hold 256 lines, which fixed batches of 16 left mostly to the tile's end, as decode_attention_bf16.cpp
// found too. L2 rather than L1: faster for Gemma 3's tiles, the same for SmolLM2's (benchmarks/RESULTS.md,
// "Decode attention on AVX2 without regrouped tiles").
constexpr int64_t kPrefetchBatch = 16;
static_assert(kTile % kScoreKeys == 0 && kTile == 2 * kLanes, "a tile is two vectors of whole score blocks");

inline __m256 widened(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widened(const uint16_t* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));  // bf16 -> float32 exactly
}

// Lane j of the result: the sum of the eight lanes of v[j], for four vectors.
inline __m128 sum_lanes_of_four(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 halves = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half: a b c d
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

// scores[r * kTile + j] = q_r . k_j for R rows (q rows of float32 `dim` apart) and the keys j < nkeys of a
// tile (rows key_stride apart); lanes from nkeys on up to the next block of four hold the last key's scores
// again.
template <int R, typename T>
inline void block_scores(const float* __restrict q, const T* __restrict k, int64_t key_stride, int64_t nkeys,
                         int64_t dim, float* __restrict scores) {
  for (int64_t j0 = 0; j0 < nkeys; j0 += kScoreKeys) {
    const T* keys[kScoreKeys];
    for (int j = 0; j < kScoreKeys; ++j) keys[j] = k + std::min<int64_t>(j0 + j, nkeys - 1) * key_stride;
    __m256 acc[R][kScoreKeys];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kScoreKeys; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += kLanes) {
      for (int j = 0; j < kScoreKeys; ++j) {
        const __m256 kj = widened(keys[j] + i);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dim + i), kj, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(scores + r * kTile + j0, sum_lanes_of_four(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}
static_assert(kScoreKeys == 4, "block_scores reduces four keys at a time");

// out[r] += sum_{j < nkeys} p[r * kTile + j] v[j] for R rows (out rows `dim` apart), V's rows key_stride
// apart: per kPartDims dims, the R rows' sums in registers across the keys, each widened V vector used by all
// R rows.
template <int R, typename T>
inline void block_values(const float* __restrict p, const T* __restrict v, int64_t key_stride, int64_t nkeys,
                         int64_t dim, float* __restrict out) {
  for (int64_t c = 0; c < dim; c += kPartDims) {
    __m256 acc[R][kPartVectors];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kPartVectors; ++i) acc[r][i] = _mm256_loadu_ps(out + r * dim + c + i * kLanes);
    for (int64_t j = 0; j < nkeys; ++j) {
      __m256 pj[R];
      for (int r = 0; r < R; ++r) pj[r] = _mm256_set1_ps(p[r * kTile + j]);
      for (int i = 0; i < kPartVectors; ++i) {
        const __m256 vj = widened(v + j * key_stride + c + i * kLanes);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(pj[r], vj, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kPartVectors; ++i) _mm256_storeu_ps(out + r * dim + c + i * kLanes, acc[r][i]);
  }
}

// The rows of the next block where `left` rows of a head remain: kBlockRows, but two where four remain (a
// group of four query heads per KV head, Gemma 3's, as 2 + 2 rather than 3 + 1, whose block of one shares
// no widened vector).
inline int64_t block_rows_at(int64_t left) { return left == 4 ? 2 : std::min<int64_t>(kBlockRows, left); }

// The number of blocks block_rows_at cuts `rows` rows into.
inline int64_t row_blocks(int64_t rows) {
  int64_t blocks = 0;
  for (int64_t left = rows; left > 0; left -= block_rows_at(left)) ++blocks;
  return blocks;
}

// fn(std::integral_constant<int, rows>{}) for 1 <= rows <= kBlockRows.
template <typename Fn>
void with_block_rows(int64_t rows, Fn&& fn) {
  if (rows >= 3) return fn(std::integral_constant<int, 3>{});
  if (rows == 2) return fn(std::integral_constant<int, 2>{});
  fn(std::integral_constant<int, 1>{});
}
static_assert(kBlockRows == 3, "with_block_rows covers 1 .. kBlockRows rows");

// One row's softmax state: the reference max m (the largest scaled score seen when it last moved) and the
// lane-wise sum l of its exponentials; the output row lives in the item's accumulator rows.
struct RowSoftmax {
  float m = -1e30f;  // a finite floor: the first tile's rescale factor exp(m - max) is then ~0, not NaN
  __m256 l = _mm256_setzero_ps();
};

// The tile's probabilities for one row, in place of its scores: exp(scale * score - m) for keys first ..
// visible - 1 (0 < visible - first), 0 elsewhere, added to l. Moves m, rescaling l and the row's output, where
// the tile's max exceeds it by more than kRescaleAbove.
inline void tile_probabilities(float* __restrict scores, int64_t first, int64_t visible, float scale, RowSoftmax& row,
                               float* __restrict out_row, int64_t dim) {
  const __m256 floor = _mm256_set1_ps(-1e30f);
  __m256 s[2];
  for (int h = 0; h < 2; ++h) {
    s[h] = _mm256_mul_ps(_mm256_loadu_ps(scores + h * kLanes), _mm256_set1_ps(scale));
    s[h] = lanes_first(visible - h * kLanes, s[h], floor);
    s[h] = lanes_first(first - h * kLanes, floor, s[h]);
  }
  const float tile_max = reduce_max(_mm256_max_ps(s[0], s[1]));
  if (tile_max > row.m + kRescaleAbove) {
    const __m256 alpha = _mm256_set1_ps(fast_exp(row.m - tile_max));
    for (int64_t d = 0; d < dim; d += kLanes)
      _mm256_storeu_ps(out_row + d, _mm256_mul_ps(_mm256_loadu_ps(out_row + d), alpha));
    row.l = _mm256_mul_ps(row.l, alpha);
    row.m = tile_max;
  }
  for (int h = 0; h < 2; ++h) {
    __m256 p = fast_exp(_mm256_sub_ps(s[h], _mm256_set1_ps(row.m)));
    p = lanes_first(visible - h * kLanes, p, _mm256_setzero_ps());
    p = lanes_first(first - h * kLanes, _mm256_setzero_ps(), p);
    row.l = _mm256_add_ps(row.l, p);
    _mm256_storeu_ps(scores + h * kLanes, p);
  }
}

template <typename T>
void run_items(const DecodeProblem& p, const T* q, const T* k_cache, const T* v_cache, T* out) {
  const int64_t dim = p.dim, key_len = p.hkv * dim, heads = heads_per_item(p);
  const ItemSplit split(p, heads, kChunkRows, kTile);
  parallel_claims(0, split.parts(), [=, &split](int64_t first_part, int64_t last_part) {
    const FlushDenormals ftz;
    const int64_t max_rows = heads * kChunkRows;
    std::vector<float> out_rows(max_rows * dim), q_rows(max_rows * dim);  // per row: output sums; q widened
    std::vector<RowSoftmax> softmax(max_rows);
    std::vector<float> probs(max_rows * kTile);                    // per row: the tile's scores, then its probabilities
    std::vector<int64_t> first_key(max_rows), last_key(max_rows);  // per row: the first and last key it may see
    PacedPrefetch<T, _MM_HINT_T1> prefetch;                        // the next tile's K/V rows
    const auto start = [&](const DecodeChunk& chunk) {
      std::fill_n(out_rows.begin(), heads * chunk.rows * dim, 0.f);
      std::fill_n(softmax.begin(), heads * chunk.rows, RowSoftmax{});
      for (int64_t r = 0; r < heads * chunk.rows; ++r) {
        const T* q_row = chunk.query(q, r);
        for (int64_t d = 0; d < dim; ++d) q_rows[r * dim + d] = to_float(q_row[d]);
        last_key[r] = chunk.last_key(r);
        first_key[r] = chunk.first_key(r);
      }
    };
    const auto tile = [&](const DecodeChunk& chunk, int64_t kv_start, int64_t nkeys, int64_t tile_at) {
      const int64_t rows = chunk.rows;
      const int64_t steps = 2 * heads * row_blocks(rows);  // prefetch points: each block's scores and its P.V
      const int64_t share = std::max(kPrefetchBatch, (prefetch.lines() + steps - 1) / steps);
      for (int64_t head = 0; head < heads; ++head) {
        const T* k_tile = k_cache + tile_at + head * dim;
        const T* v_tile = v_cache + tile_at + head * dim;
        const int64_t r0 = head * rows;
        // fn(b, block_rows, block_keys) for the head's rows in blocks from row b, block_rows (a compile-time
        // constant) at a time, each block reading the keys its latest row sees (rows are in token order);
        // blocks that see none of the tile are skipped (their rows' probs are set to 0 below), and the next
        // share of prefetches is asked for after each.
        const auto each_block = [&](auto&& fn) {
          for (int64_t b = r0, block; b < r0 + rows; b += block) {
            block = block_rows_at(r0 + rows - b);
            const int64_t block_keys = std::min(nkeys, last_key[b + block - 1] - kv_start + 1);
            if (block_keys <= 0) continue;
            with_block_rows(block, [&](auto block_rows) { fn(b, block_rows, block_keys); });
            prefetch.issue(share);
          }
        };
        each_block([&](int64_t b, auto block_rows, int64_t block_keys) {
          block_scores<decltype(block_rows)::value>(&q_rows[b * dim], k_tile, key_len, block_keys, dim,
                                                    &probs[b * kTile]);
        });
        for (int64_t r = r0; r < r0 + rows; ++r) {
          const int64_t visible = std::min(nkeys, last_key[r] - kv_start + 1);
          const int64_t first = std::max<int64_t>(0, first_key[r] - kv_start);
          float* row_probs = &probs[r * kTile];
          if (visible <= first) {  // the tile lies wholly outside the row's keys
            std::fill(row_probs, row_probs + kTile, 0.f);
            continue;
          }
          tile_probabilities(row_probs, first, visible, p.scale, softmax[r], &out_rows[r * dim], dim);
        }
        each_block([&](int64_t b, auto block_rows, int64_t block_keys) {
          block_values<decltype(block_rows)::value>(&probs[b * kTile], v_tile, key_len, block_keys, dim,
                                                    &out_rows[b * dim]);
        });
      }
      prefetch.issue(-1);
    };
    const auto finish = [&](const DecodeChunk& chunk) {
      for (int64_t r = 0; r < heads * chunk.rows; ++r) {
        store_row(p, out, chunk.output_row(r), &out_rows[r * dim], softmax[r].m, reduce_add(softmax[r].l));
      }
    };
    walk_chunks(p, heads, kChunkRows, split.first_item(first_part), split.first_item(last_part), k_cache, v_cache,
                prefetch, start, tile, finish);
  });
}

}  // namespace

// Whether the kernel takes heads of `dim` now: whole 32-dim passes of P.V, and switched on.
inline bool takes_head_dim(int64_t dim) { return dim % kPartDims == 0 && avx2_enabled.load(); }

bool avx2_attention_applies(at::Tensor q) { return takes_head_dim(q.size(-1)); }

template <typename T>
bool decode_attention_avx2(const DecodeProblem& p, const T* q, const T* k_cache, const T* v_cache, T* out) {
  if (!takes_head_dim(p.dim)) return false;
  run_items(p, q, k_cache, v_cache, out);
  return true;
}
#else
bool avx2_attention_applies(at::Tensor) { return false; }

template <typename T>
bool decode_attention_avx2(const DecodeProblem&, const T*, const T*, const T*, T*) {
  return false;
}
#endif
template bool decode_attention_avx2(const DecodeProblem&, const float*, const float*, const float*, float*);
template bool decode_attention_avx2(const DecodeProblem&, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*);

}  // namespace kvserve
