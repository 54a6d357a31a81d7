// Decode attention on Intel AMX tiles (bf16 caches): decode_attention.cpp's tiled online softmax, with
// the two products of each step -- scores q.k and the probability-weighted sum of V -- done as tile
// matrix products (TDPBF16PS: bf16 pairs multiplied exactly, summed in float32).
//
// Orientation, chosen so that K is read from the cache as it lies:
//   scores^T [key][row] = K [key][d] . Q^T          (16 K rows of a cache block are an A tile as they
//                                                    lie; Q^T, built once per item, is the B tile)
//   out [row][d]       += P [row][key] . V [key][d] (V regrouped into key pairs, the B-tile layout;
//                                                    P rounded to bf16 as FlashAttention does, the
//                                                    row sums l kept in float32)
// Work items are (sequence, KV head); query rows go in chunks of 16 (a tile's rows), one chunk for
// SmolLM2's 3 query heads per KV head up to 5 new tokens. Keys go in steps of 32: two 16-key score
// tiles (each inside one cache block: the dispatcher sends only block sizes that are multiples of 16,
// so all 16 rows lie in the block even when fewer keys are valid -- the rest are masked, their V rows
// zeroed), then one P.V product of depth 32.
//
// Why the output stays in tile registers: AMX tiles are not renamed, so storing the output after
// every step and rescaling it (as the vector kernel does) serializes the whole step on the
// products' latency; that version was barely faster than the AVX-512 kernel. Here the output tiles
// accumulate across steps, and the softmax is rescaled lazily: each row's exponentials are taken
// against a reference max m that moves only when a step's max exceeds it by more than kRescaleAbove
// (then the output tiles are stored, scaled and reloaded, rarely after the first steps). Every
// probability is then <= e^kRescaleAbove, far inside float32 and bf16 range, and the result is the
// same softmax: the reference cancels in out / l.
#include "amx.h"
#include "decode_attention.h"
#include "work_claims.h"

#include <atomic>

namespace kvserve {

namespace {
std::atomic<bool> amx_enabled{true};
}  // namespace

bool set_amx_attention(bool enabled) { return amx_enabled.exchange(enabled); }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t kChunkRows = 16;     // query rows per tile
constexpr int64_t kDimsPerChunk = 32;  // bf16 elements in one 64-byte tile row
constexpr int64_t kStepKeys = 2 * kTile;
constexpr int64_t kMaxDim = 64;       // four output tiles of 16 float32 columns
constexpr float kRescaleAbove = 8.f;  // natural-log units: probabilities stay <= e^8 ~ 3e3
// Chunks with at least this many query rows take the softmax step across rows (softmax_across_rows);
// fewer rows (a decode step's 3 per KV head) go row by row, where the cost is per row.
constexpr int64_t kRowsForSoftmaxAcrossRows = 8;
// Prefetches asked for at each of six points through a decode step (PacedPrefetch, decode_attention.h),
// the rest after its last product. 16 was the best batch size measured
// (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
constexpr int64_t kPrefetchBatch = 16;

// Tile registers, all 16 rows x 64 bytes. Macros, not constants: GCC's _tile_* intrinsics paste the
// register number into the instruction text.
#define TILE_SCORES 0  // scores^T [16 keys][16 rows] float32
#define TILE_KEYS 1    // K [16 keys][32 dims] bf16, read from the cache block
#define TILE_B 2       // the B operand: Q^T [16 dim pairs][16 rows] or V [16 key pairs][16 dims], bf16 pairs
#define TILE_PROBS 3   // P [16 rows][32 keys] bf16
#define TILE_OUT0 4    // out [16 rows][16 dims] float32: dims 0-15, then 16-31, 32-47, 48-63
#define TILE_OUT1 5
#define TILE_OUT2 6
#define TILE_OUT3 7

// values[i][d][0..1] = (v[2i][d], v[2i+1][d]) for a block's kTile/2 key pairs: the B-tile layout.
// Rows at or past `nkeys` are zeros, not the block's stale rows: their probability is 0, and 0 times a
// stale NaN would still be NaN.
void regroup_value_pairs(const uint16_t* __restrict v, int64_t key_stride, int64_t nkeys, int64_t dim,
                         uint16_t* __restrict values) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t pair = 0; pair < kTile / 2; ++pair) {
    const uint16_t* first = v + 2 * pair * key_stride;
    const uint16_t* second = first + key_stride;
    uint16_t* dst = values + pair * dim * 2;
    for (int64_t d = 0; d < dim; d += kDimsPerChunk) {
      const __m512i a = 2 * pair < nkeys ? _mm512_loadu_si512(first + d) : _mm512_setzero_si512();
      const __m512i b = 2 * pair + 1 < nkeys ? _mm512_loadu_si512(second + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(dst + 2 * d + kDimsPerChunk, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// The output tiles to and from `acc` [16 rows][dim] float32 (dim 32 or 64: two or four tiles).
void store_output(float* acc, int64_t dim) {
  _tile_stored(TILE_OUT0, acc, dim * 4);
  _tile_stored(TILE_OUT1, acc + 16, dim * 4);
  if (dim == kMaxDim) {
    _tile_stored(TILE_OUT2, acc + 32, dim * 4);
    _tile_stored(TILE_OUT3, acc + 48, dim * 4);
  }
}

void load_output(const float* acc, int64_t dim) {
  _tile_loadd(TILE_OUT0, acc, dim * 4);
  _tile_loadd(TILE_OUT1, acc + 16, dim * 4);
  if (dim == kMaxDim) {
    _tile_loadd(TILE_OUT2, acc + 32, dim * 4);
    _tile_loadd(TILE_OUT3, acc + 48, dim * 4);
  }
}

// out += P . V over one step, V regrouped [16 key pairs][dim][2] (rows dim * 4 bytes apart).
void accumulate_output(const uint16_t* probs, const uint16_t* values, int64_t dim) {
  _tile_loadd(TILE_PROBS, probs, kStepKeys * 2);
  _tile_loadd(TILE_B, values, dim * 4);
  _tile_dpbf16ps(TILE_OUT0, TILE_PROBS, TILE_B);
  _tile_loadd(TILE_B, values + 32, dim * 4);
  _tile_dpbf16ps(TILE_OUT1, TILE_PROBS, TILE_B);
  if (dim == kMaxDim) {
    _tile_loadd(TILE_B, values + 64, dim * 4);
    _tile_dpbf16ps(TILE_OUT2, TILE_PROBS, TILE_B);
    _tile_loadd(TILE_B, values + 96, dim * 4);
    _tile_dpbf16ps(TILE_OUT3, TILE_PROBS, TILE_B);
  }
}

// Element offsets j * kChunkRows, j = 0..15: gathering at them from &buffer[0][r] of a [..][kChunkRows]
// buffer reads its column r.
inline __m512i column_offsets() {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(kChunkRows));
}

// One step's online softmax for all rows of a chunk at once: lane r of each vector is query row r,
// read from the stored score tiles (scores_t [key][row]) as they lie. Row by row, each of 16 rows paid
// two gathers and two horizontal reductions per step; across rows the step costs the same whatever
// the number of rows. Same arithmetic as the row loop: lazy reference max m, probabilities exp(s - m)
// summed into l in float32 and rounded to bf16 into P [row][key] for the P.V product. Lanes whose
// last_key is -1 (past the chunk's rows) see no key and keep p = 0. Sets alpha (1 where m stayed);
// returns whether any row's m moved, so that its output needs rescaling.
bool softmax_across_rows(float* __restrict scores_t, const int32_t* last_key, int64_t step, float scale, float* m,
                         float* l, float* alpha, uint16_t* __restrict probs) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i last = _mm512_load_si512(last_key);
  const __m512 floor = _mm512_set1_ps(-1e30f), scale_v = _mm512_set1_ps(scale);
  const auto seen = [&](int64_t key) {
    return _mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(static_cast<int32_t>(key)));
  };
  __m512 step_max = floor;
  for (int64_t k = 0; k < kStepKeys; ++k) {  // unseen keys (also a skipped half's stale scores) -> floor
    const __m512 s = _mm512_mask_mul_ps(floor, seen(step + k), _mm512_load_ps(scores_t + k * kChunkRows), scale_v);
    _mm512_store_ps(scores_t + k * kChunkRows, s);
    step_max = _mm512_max_ps(step_max, s);
  }
  __m512 ref = _mm512_load_ps(m), sum = _mm512_load_ps(l), factor = _mm512_set1_ps(1.f);
  const __mmask16 moved = _mm512_cmp_ps_mask(step_max, _mm512_add_ps(ref, _mm512_set1_ps(kRescaleAbove)), _CMP_GT_OQ);
  if (moved) {
    const __m512 new_ref = _mm512_mask_mov_ps(ref, moved, step_max);
    factor = _mm512_mask_mov_ps(factor, moved, fast_exp(_mm512_sub_ps(ref, new_ref)));
    sum = _mm512_mul_ps(sum, factor);
    ref = new_ref;
    _mm512_store_ps(m, ref);
  }
  _mm512_store_ps(alpha, factor);
  alignas(64) uint32_t pairs[kStepKeys / 2][kChunkRows];  // [key pair][row]: bf16 (p_2i, p_2i+1) of row r
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t i = 0; i < kStepKeys / 2; ++i) {
    const int64_t k = 2 * i;
    const __m512 p0 =
        _mm512_maskz_mov_ps(seen(step + k), fast_exp(_mm512_sub_ps(_mm512_load_ps(scores_t + k * kChunkRows), ref)));
    const __m512 p1 = _mm512_maskz_mov_ps(
        seen(step + k + 1), fast_exp(_mm512_sub_ps(_mm512_load_ps(scores_t + (k + 1) * kChunkRows), ref)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    _mm512_store_si512(pairs[i], _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
  }
  _mm512_store_ps(l, sum);
  // P's row r is column r of `pairs`.
  const __m512i column = column_offsets();
  for (int64_t r = 0; r < kChunkRows; ++r) {
    _mm512_store_si512(probs + r * kStepKeys, _mm512_i32gather_epi32(column, &pairs[0][r], 4));
  }
  return moved != 0;
}

// The same step row by row, for chunks of few rows: each row's 32 scores are a column of the stored
// tiles (two gathers), reduced horizontally. Returns whether any row's m moved.
bool softmax_row_by_row(const float* scores_t, const int32_t* last_key, int64_t rows, int64_t step, float scale,
                        float* m, float* l, float* alpha, uint16_t* __restrict probs) {
  const __m512i key_rows = column_offsets();
  const __m512 scale_v = _mm512_set1_ps(scale), floor = _mm512_set1_ps(-1e30f);
  bool rescale = false;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = last_key[r] - step + 1;  // last_key < slen
    const __mmask16 seen_low = first_lanes(visible), seen_high = first_lanes(visible - kTile);
    const __m512 low = _mm512_mask_mul_ps(floor, seen_low, _mm512_i32gather_ps(key_rows, scores_t + r, 4), scale_v);
    const __m512 high = _mm512_mask_mul_ps(
        floor, seen_high, _mm512_i32gather_ps(key_rows, scores_t + kTile * kChunkRows + r, 4), scale_v);
    const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(low, high));
    alpha[r] = 1.f;
    if (step_max > m[r] + kRescaleAbove) {
      alpha[r] = fast_exp(m[r] - step_max);
      l[r] *= alpha[r];
      m[r] = step_max;
      rescale = true;
    }
    const __m512 ref = _mm512_set1_ps(m[r]);
    const __m512 p_low = _mm512_maskz_mov_ps(seen_low, fast_exp(_mm512_sub_ps(low, ref)));
    const __m512 p_high = _mm512_maskz_mov_ps(seen_high, fast_exp(_mm512_sub_ps(high, ref)));
    l[r] += _mm512_reduce_add_ps(_mm512_add_ps(p_low, p_high));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * kStepKeys), (__m256i)_mm512_cvtneps_pbh(p_low));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * kStepKeys + kTile), (__m256i)_mm512_cvtneps_pbh(p_high));
  }
  return rescale;
}

}  // namespace

// No window here: a windowed layer's rows take the vector kernel (decode_attention.cpp), which has one.
bool amx_decode_supported(const DecodeProblem& p) {
  return amx_enabled && p.window == 0 && (p.dim == 32 || p.dim == kMaxDim) && p.block_size % kTile == 0 &&
         amx_permitted();
}

bool decode_attention_amx(const DecodeProblem& p, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          uint16_t* out) {
  const int64_t dim = p.dim, hq = p.hq, hkv = p.hkv, group = hq / hkv, key_len = hkv * dim;
  const int64_t dim_chunks = dim / kDimsPerChunk;
  const ItemSplit split(p, 1, kChunkRows, kStepKeys);
  parallel_claims(0, split.parts(), [=, &split](int64_t first_part, int64_t last_part) {
    const int64_t begin = split.first_item(first_part), end = split.first_item(last_part);
    const FlushDenormals ftz;
    const TileConfig config = tile_config();
    _tile_loadconfig(&config);
    alignas(64) float scores_t[kStepKeys * kChunkRows];       // [key][row]: two score tiles
    alignas(64) uint16_t probs[kChunkRows * kStepKeys] = {};  // [row][key]; rows past the chunk stay finite
    alignas(64) uint16_t values[kStepKeys * kMaxDim];         // [key pair][d][2]
    alignas(64) float acc[kChunkRows * kMaxDim];              // [row][d]
    alignas(64) uint32_t query_t[kMaxDim / 2 * kChunkRows];   // [dim pair][row] bf16 pairs
    alignas(64) float m[kChunkRows], l[kChunkRows], alpha[kChunkRows];
    alignas(64) int32_t last_key[kChunkRows];
    PacedPrefetch<uint16_t, _MM_HINT_T0> prefetch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = p.seq_ids[item / hkv], head = item % hkv;
      const int64_t row0 = p.cu_seqlens_q[seq], qlen = p.cu_seqlens_q[seq + 1] - row0, slen = p.seq_lens[seq];
      const int64_t* table = p.tables + seq * p.table_width;
      const int64_t head_rows = qlen * group;  // rows in query_row's order
      for (int64_t first_row = 0; first_row < head_rows; first_row += kChunkRows) {
        const int64_t rows = std::min(kChunkRows, head_rows - first_row);
        // Prefetching: an item's first chunk reads its keys from memory, so while each step computes it asks
        // for the next step's K/V (PacedPrefetch). Later chunks of the item (prefill) find them in cache and
        // ask for nothing: prefetching there only slowed them. The item's last step asks for the first step
        // of the next item.
        const bool first_chunk = first_row == 0, last_chunk = first_row + kChunkRows >= head_rows;
        std::fill(std::begin(query_t), std::end(query_t), 0u);
        std::fill(std::begin(m), std::end(m), -1e30f);  // a finite floor: exp(m_old - m_new) never sees (-inf) - (-inf)
        std::fill(std::begin(l), std::end(l), 0.f);
        std::fill(std::begin(last_key), std::end(last_key), -1);  // rows past the chunk see no key
        for (int64_t r = 0; r < rows; ++r) {
          const QueryRow row = query_row(first_row + r, head, group);
          const uint16_t* q_row = q + (row0 + row.token) * p.q_row_stride + row.q_head * p.q_head_stride;
          for (int64_t pair = 0; pair < dim / 2; ++pair)
            std::memcpy(&query_t[pair * kChunkRows + r], q_row + 2 * pair, 4);
          last_key[r] = static_cast<int32_t>(slen - qlen + row.token);  // causal: keys 0 .. its own position
        }
        _tile_zero(TILE_OUT0);
        _tile_zero(TILE_OUT1);
        _tile_zero(TILE_OUT2);
        _tile_zero(TILE_OUT3);
        const int64_t keys_end = chunk_keys_end(slen, qlen, group, first_row, rows);
        for (int64_t step = 0; step < keys_end; step += kStepKeys) {
          if (first_chunk && step + kStepKeys < keys_end) {
            prefetch.plan(p, table, step + kStepKeys, kStepKeys, keys_end, k_cache, v_cache, head, 1);
          } else if (last_chunk && step + kStepKeys >= keys_end && item + 1 < end) {
            const int64_t next_seq = p.seq_ids[(item + 1) / hkv];
            prefetch.plan(p, p.tables + next_seq * p.table_width, 0, kStepKeys, p.seq_lens[next_seq], k_cache, v_cache,
                          (item + 1) % hkv, 1);
          }
          // Two 16-key halves, each inside one block; a half no row sees is not read at all.
          for (int64_t half = 0; half < 2; ++half) {
            prefetch.issue(kPrefetchBatch);
            const int64_t key = step + half * kTile, nkeys = std::min(kTile, keys_end - key);
            if (nkeys <= 0) {
              std::memset(values + half * kTile * dim, 0, kTile * dim * sizeof(uint16_t));
              continue;
            }
            const int64_t at = cache_row(p, table, key, head);
            regroup_value_pairs(v_cache + at, key_len, nkeys, dim, values + half * kTile * dim);
            prefetch.issue(kPrefetchBatch);
            _tile_zero(TILE_SCORES);
            for (int64_t c = 0; c < dim_chunks; ++c) {
              _tile_loadd(TILE_KEYS, k_cache + at + c * kDimsPerChunk, key_len * 2);
              _tile_loadd(TILE_B, query_t + c * 16 * kChunkRows, kChunkRows * 4);
              _tile_dpbf16ps(TILE_SCORES, TILE_KEYS, TILE_B);
            }
            _tile_stored(TILE_SCORES, scores_t + half * kTile * kChunkRows, kChunkRows * 4);
          }
          prefetch.issue(kPrefetchBatch);
          const bool rescale = rows >= kRowsForSoftmaxAcrossRows
                                   ? softmax_across_rows(scores_t, last_key, step, p.scale, m, l, alpha, probs)
                                   : softmax_row_by_row(scores_t, last_key, rows, step, p.scale, m, l, alpha, probs);
          if (rescale && step > 0) {  // before the first step the output is still zero
            store_output(acc, dim);
            for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
              for (int64_t i = 0; i < dim; ++i) acc[r * dim + i] *= alpha[r];
            }
            load_output(acc, dim);
          }
          prefetch.issue(kPrefetchBatch);
          accumulate_output(probs, values, dim);
          prefetch.issue(-1);
        }
        store_output(acc, dim);
        for (int64_t r = 0; r < rows; ++r) {
          const QueryRow row = query_row(first_row + r, head, group);
          store_normalized(out + ((row0 + row.token) * hq + row.q_head) * dim, &acc[r * dim], l[r], dim);
        }
      }
    }
    _tile_release();
  });
  return true;
}
#else
bool amx_decode_supported(const DecodeProblem&) { return false; }
bool decode_attention_amx(const DecodeProblem&, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*) {
  return false;
}
#endif

}  // namespace kvserve
