// Decode attention on AVX512-BF16 (bf16 caches, CPUs without AMX or with it switched off):
// decode_attention.cpp's tiled online softmax, with both products of a tile done by VDPBF16PS (bf16 pairs
// multiplied exactly, summed in float32) on K and V as they lie in the cache:
//   scores [row][key] = q_row . K [key]       sixteen keys' sums in registers, reduced together
//   out [row][d]     += P [row][key] . V [key] V's keys paired by VPUNPCK{L,H}WD in registers; P rounded to
//                                              bf16 as FlashAttention does (and decode_attention_amx.cpp),
//                                              the row sums l kept in float32
// Work items are decode_attention.cpp's (a sequence and heads_per_item of its KV heads), split among threads by
// their cost (ItemSplit) so that prefill rows, which this kernel takes too (kvserve/kernels/attention_cpu.py),
// do not load one thread; each head's rows go through the keys in chunks of kChunkRows. What makes this
// kernel cheaper per tile, and why it exists (figures: benchmarks/RESULTS.md, "Decode attention on AVX512-BF16"):
// - nothing is copied: K and V are read from their cache blocks, keys past a tile's count by masked
//   loads (zeros, no fault), so neither a regrouped nor a widened tile is written and read back;
// - the softmax is rescaled lazily, as on AMX: each row's exponentials are taken against a reference max
//   that moves only when a tile's max exceeds it by more than kRescaleAbove, so a tile costs no exp of
//   its own and no pass over the row's output; the reference cancels in out / l;
// - a tile's P.V keeps the output of up to kRowsPerPass rows in registers and pairs each two V rows once
//   for all of them (a decode step's 3 query heads per KV head, in SmolLM2).
#include "decode_attention_chunks.h"
#include "work_claims.h"

#include <atomic>

namespace kvserve {

namespace {
std::atomic<bool> bf16_enabled{true};
}  // namespace

bool set_bf16_attention(bool enabled) { return bf16_enabled.exchange(enabled); }

#ifdef __AVX512BF16__
namespace {

constexpr int64_t kPairDims = 32;    // bf16 elements of one 64-byte register: one V row's slice
constexpr int64_t kRowsPerPass = 8;  // P.V rows held in registers at once: 2 per 32-dim slice, 16 in all
// Query rows of each head taken through the keys together: every decode row of a sequence (up to 8 new
// tokens of 4 query heads per KV head), and a prefill in chunks whose output rows stay in L1 (3 heads x 32
// rows x 64 dims, or 32 x 256, of float32 sums: 24-32 KB).
constexpr int64_t kChunkRows = 32;
constexpr float kRescaleAbove = 8.f;  // natural-log units: probabilities stay <= e^8 ~ 3e3
// Prefetches asked for after each head's scores and after its P.V, the rest after the tile's last
// head (PacedPrefetch, decode_attention.h), into L2: 48 lines into L2 were the best measured, 1.5x
// faster than the best batch into L1 (figures: benchmarks/RESULTS.md, "Decode attention on AVX512-BF16").
constexpr int64_t kPrefetchBatch = 48;

// Lines asked for after each row's scores as well, where a tile holds more than those two batches per head
// ask for: the rest in equal shares, so that none waits for the tile's end. Gemma 3's tiles (one KV head of
// 256 dims) hold 256 lines, and leaving 160 of them to the end made its attention 1.45x slower; SmolLM2's
// tiles (64 lines per head) need none (benchmarks/RESULTS.md, "Decode attention's prefetch in row shares").
inline int64_t row_prefetch_share(int64_t lines, int64_t heads, int64_t rows) {
  const int64_t left = lines - 2 * kPrefetchBatch * heads;
  return left > 0 ? (left + heads * rows - 1) / (heads * rows) : 0;
}

// Lane j of the result is the sum of the 16 lanes of v[j]: a transpose-and-add tree of 45 shuffles
// and adds for all sixteen, where sixteen separate horizontal sums cost ~130.
inline __m512 sum_lanes_of_each(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of four vectors, in order
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // the four 128-bit lanes summed in pairs
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// All 32 lanes of key j's row where j < nkeys, none past it (a masked load reads nothing there).
inline __mmask32 key_mask(int64_t j, int64_t nkeys) { return j < nkeys ? ~__mmask32{0} : __mmask32{0}; }

// Lane j: q . k_j for a tile's keys (rows key_stride elements apart), 0 past nkeys. All kTile keys at
// once, so their sums stay in registers.
inline __m512 tile_scores(const uint16_t* __restrict q, const uint16_t* __restrict k, int64_t key_stride, int64_t nkeys,
                          int64_t dim) {
  __m512 acc[kTile];
  for (int64_t j = 0; j < kTile; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += kPairDims) {
    const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kTile; ++j) {
      const __m512i kj = _mm512_maskz_loadu_epi16(key_mask(j, nkeys), k + j * key_stride + i);
      acc[j] = _mm512_dpbf16_ps(acc[j], qi, (__m512bh)kj);
    }
  }
  return sum_lanes_of_each(acc);
}

// One row's softmax state: the reference max m (the largest score seen when it last moved) and the
// lane-wise sum l of its exponentials; the output row lives in the item's accumulator rows.
struct RowSoftmax {
  float m = -1e30f;  // a finite floor: the first tile's rescale factor exp(m - max) is then 0, not NaN
  __m512 l = _mm512_setzero_ps();
};

// The tile's probabilities for one row: exp(scale * score - m) in the lanes it sees, 0 elsewhere, written
// as bf16 pairs (p_2i, p_2i+1) for VDPBF16PS and added to l in float32. Moves m, rescaling l and the
// row's output, where the tile's max exceeds it by more than kRescaleAbove.
inline void tile_probabilities(__m512 scores, __mmask16 seen, float scale, RowSoftmax& row, float* __restrict out_row,
                               int64_t dim, uint32_t* __restrict p_pairs) {
  const __m512 s = _mm512_mul_ps(scores, _mm512_set1_ps(scale));
  const float tile_max = _mm512_mask_reduce_max_ps(seen, s);
  if (tile_max > row.m + kRescaleAbove) {
    const __m512 alpha = _mm512_set1_ps(fast_exp(row.m - tile_max));
    for (int64_t d = 0; d < dim; d += 16)
      _mm512_storeu_ps(out_row + d, _mm512_mul_ps(_mm512_loadu_ps(out_row + d), alpha));
    row.l = _mm512_mul_ps(row.l, alpha);
    row.m = tile_max;
  }
  const __m512 p = _mm512_maskz_mov_ps(seen, fast_exp(_mm512_sub_ps(s, _mm512_set1_ps(row.m))));
  row.l = _mm512_add_ps(row.l, p);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs), (__m256i)_mm512_cvtneps_pbh(p));
}

// out[r] += sum_j p[r][j] v[j] for N rows (p_pairs: kTile / 2 pairs per row; out rows `dim` apart, in
// pair order), V's keys rows key_stride apart, zeros past nkeys. Each two keys' rows are paired once per
// 32-dim slice for all N rows, whose sums stay in registers across the tile.
template <int64_t N>
inline void accumulate_rows(const uint32_t* __restrict p_pairs, const uint16_t* __restrict v, int64_t key_stride,
                            int64_t nkeys, int64_t dim, float* __restrict out) {
  for (int64_t c = 0; c < dim; c += kPairDims) {
    __m512 low[N], high[N];
    for (int64_t r = 0; r < N; ++r) {
      low[r] = _mm512_loadu_ps(out + r * dim + c);
      high[r] = _mm512_loadu_ps(out + r * dim + c + 16);
    }
#pragma GCC unroll 8
    for (int64_t pair = 0; pair < kTile / 2; ++pair) {
      const uint16_t* first = v + 2 * pair * key_stride + c;
      const __m512i a = _mm512_maskz_loadu_epi16(key_mask(2 * pair, nkeys), first);
      const __m512i b = _mm512_maskz_loadu_epi16(key_mask(2 * pair + 1, nkeys), first + key_stride);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int64_t r = 0; r < N; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p_pairs[r * kTile / 2 + pair]));
        low[r] = _mm512_dpbf16_ps(low[r], pr, lo);
        high[r] = _mm512_dpbf16_ps(high[r], pr, hi);
      }
    }
    for (int64_t r = 0; r < N; ++r) {
      _mm512_storeu_ps(out + r * dim + c, low[r]);
      _mm512_storeu_ps(out + r * dim + c + 16, high[r]);
    }
  }
}

// accumulate_rows over `rows` rows, kRowsPerPass at a time (the count a template argument, so the sums
// are registers).
inline void accumulate_tile(const uint32_t* p_pairs, const uint16_t* v, int64_t key_stride, int64_t nkeys, int64_t rows,
                            int64_t dim, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    const uint32_t* p = p_pairs + r0 * kTile / 2;
    float* o = out + r0 * dim;
    switch (std::min(kRowsPerPass, rows - r0)) {
      case 1:
        accumulate_rows<1>(p, v, key_stride, nkeys, dim, o);
        break;
      case 2:
        accumulate_rows<2>(p, v, key_stride, nkeys, dim, o);
        break;
      case 3:
        accumulate_rows<3>(p, v, key_stride, nkeys, dim, o);
        break;
      case 4:
        accumulate_rows<4>(p, v, key_stride, nkeys, dim, o);
        break;
      case 5:
        accumulate_rows<5>(p, v, key_stride, nkeys, dim, o);
        break;
      case 6:
        accumulate_rows<6>(p, v, key_stride, nkeys, dim, o);
        break;
      case 7:
        accumulate_rows<7>(p, v, key_stride, nkeys, dim, o);
        break;
      default:
        accumulate_rows<8>(p, v, key_stride, nkeys, dim, o);
        break;
    }
  }
  static_assert(kRowsPerPass == 8, "accumulate_tile's cases cover 1 .. kRowsPerPass rows");
}

// Where dimension d's sum lies in an output row accumulated from paired V rows: per 32 dims, the low
// unpack's 16 lanes (dims 0-3, 8-11, 16-19, 24-27 of the 32), then the high's (4-7, 12-15, 20-23, 28-31):
// VPUNPCK{L,H}WD pair within 128-bit lanes.
inline int64_t pair_order_index(int64_t d) {
  const int64_t e = d % kPairDims;
  return d - e + (e % 8) / 4 * 16 + e / 8 * 4 + e % 4;
}

}  // namespace

bool bf16_attention_applies(at::Tensor q, at::Tensor k_cache) {
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && q.size(-1) % kPairDims == 0 &&
         bf16_enabled.load();
}

bool decode_attention_bf16(const DecodeProblem& p, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                           uint16_t* out) {
  if (p.dim % kPairDims != 0 || !bf16_enabled.load()) return false;
  const int64_t dim = p.dim, key_len = p.hkv * dim, heads = heads_per_item(p);
  const ItemSplit split(p, heads, kChunkRows, kTile);
  parallel_claims(0, split.parts(), [=, &split](int64_t first_part, int64_t last_part) {
    const FlushDenormals ftz;
    const int64_t max_rows = heads * kChunkRows;
    std::vector<float> out_rows(max_rows * dim), natural(dim);  // per row: the output sums, in pair order
    std::vector<RowSoftmax> softmax(max_rows);
    std::vector<uint32_t> p_pairs(max_rows * kTile / 2);  // per row: the tile's probabilities, kTile / 2 bf16 pairs
    std::vector<const uint16_t*> q_rows(max_rows);
    std::vector<int64_t> first_key(max_rows), last_key(max_rows);  // per row: the first and last key it may see
    PacedPrefetch<uint16_t, _MM_HINT_T1> prefetch;                 // the next tile's K/V rows
    const auto start = [&](const DecodeChunk& chunk) {
      std::fill_n(out_rows.begin(), heads * chunk.rows * dim, 0.f);
      std::fill_n(softmax.begin(), heads * chunk.rows, RowSoftmax{});
      for (int64_t r = 0; r < heads * chunk.rows; ++r) {
        q_rows[r] = chunk.query(q, r);
        last_key[r] = chunk.last_key(r);
        first_key[r] = chunk.first_key(r);
      }
    };
    const auto tile = [&](const DecodeChunk& chunk, int64_t kv_start, int64_t nkeys, int64_t tile_at) {
      const int64_t rows = chunk.rows;
      const int64_t row_share = row_prefetch_share(prefetch.lines(), heads, rows);
      for (int64_t head = 0; head < heads; ++head) {
        const int64_t r0 = head * rows;
        for (int64_t r = r0; r < r0 + rows; ++r) {
          const __mmask16 seen = first_lanes(std::min(nkeys, last_key[r] - kv_start + 1)) &
                                 static_cast<__mmask16>(~first_lanes(first_key[r] - kv_start));
          uint32_t* row_pairs = &p_pairs[r * kTile / 2];
          if (seen == 0) {  // the tile lies wholly outside the row's keys
            std::fill(row_pairs, row_pairs + kTile / 2, 0u);
            continue;
          }
          const __m512 scores = tile_scores(q_rows[r], k_cache + tile_at + head * dim, key_len, nkeys, dim);
          tile_probabilities(scores, seen, p.scale, softmax[r], &out_rows[r * dim], dim, row_pairs);
          prefetch.issue(row_share);
        }
        prefetch.issue(kPrefetchBatch);
        accumulate_tile(&p_pairs[r0 * kTile / 2], v_cache + tile_at + head * dim, key_len, nkeys, rows, dim,
                        &out_rows[r0 * dim]);
        prefetch.issue(kPrefetchBatch);
      }
      prefetch.issue(-1);
    };
    const auto finish = [&](const DecodeChunk& chunk) {
      for (int64_t r = 0; r < heads * chunk.rows; ++r) {
        for (int64_t d = 0; d < dim; ++d) natural[d] = out_rows[r * dim + pair_order_index(d)];
        store_row(p, out, chunk.output_row(r), natural.data(), softmax[r].m, _mm512_reduce_add_ps(softmax[r].l));
      }
    };
    walk_chunks(p, heads, kChunkRows, split.first_item(first_part), split.first_item(last_part), k_cache, v_cache,
                prefetch, start, tile, finish);
  });
  return true;
}
#else
bool bf16_attention_applies(at::Tensor, at::Tensor) { return false; }
bool decode_attention_bf16(const DecodeProblem&, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*) {
  return false;
}
#endif

}  // namespace kvserve
