// Rows of a quantized weight packed into AMX B tiles (amx_product.h's layout: per 16 weight rows and 32
// k, the pair of k values 2p, 2p + 1 of row n at dword 16p + n), so that quant_linear's panels multiply
// on the same tiles as the dense bf16 weights. Each value is the one quant_blocks.h's dequantization
// gives in bf16: the reference's float32 operations, then one rounding to nearest even.
//
// - Row groups of the 32-element types (Q4_0, Q4_1, Q5_0, Q8_0) and of Q6_K: straight from the groups'
//   vectors (Q6_K's unpacked as its GEMV unpacks them). Two groups (16 rows) of vector t hold elements
//   4t .. 4t+3 of every row, a dword per row (quant_row_groups.h): widened to float32 a row at a time per
//   four lanes, scaled by their rows' d (and m; Q6_K: d times the scale of their 16 elements), rounded to
//   bf16, they are the k pairs 2t and 2t + 1 of all 16 rows, which one two-source permutation per pair
//   picks into a tile row. No transpose, no per-row scalar work.
// - Every other layout (GGML's, Q4_K's groups): the rows dequantized to bf16 as they lie
//   (dequantize_rows_into), then each 16-row x 32-k slice transposed as 16 x 16 dwords.
#pragma once

#include "amx_product.h"
#include "group_lanes.h"
#include "quant_group_dequantize.h"

#if defined(__AVX512BF16__)
namespace kvserve::quant {

using amx_product::kDepth, amx_product::kTileElems;

// 16 rows of 16 dwords (row n at rows + n * stride dwords; rows past `valid` read as zeros) transposed
// into out: dword 16p + n = row n's dword p. Three stages: 4 x 4 dword transposes within 128-bit lanes
// per four rows, then 4 x 4 transposes of 128-bit lanes across the four-row blocks.
inline void transpose_16x16_dwords(const uint32_t* rows, int64_t stride, int64_t valid, uint32_t* out) {
  __m512i r[16], x[16];
  for (int n = 0; n < 16; ++n) r[n] = n < valid ? _mm512_loadu_si512(rows + n * stride) : _mm512_setzero_si512();
  for (int q = 0; q < 4; ++q) {  // rows 4q .. 4q+3: x[4j + q] lane L = their dword 4L + j
    const __m512i* a = r + 4 * q;
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    x[q] = _mm512_unpacklo_epi64(t0, t2);
    x[4 + q] = _mm512_unpackhi_epi64(t0, t2);
    x[8 + q] = _mm512_unpacklo_epi64(t1, t3);
    x[12 + q] = _mm512_unpackhi_epi64(t1, t3);
  }
  for (int j = 0; j < 4; ++j) {  // dword 4L + j of all 16 rows: lane L of x[4j], x[4j + 1], x[4j + 2], x[4j + 3]
    const __m512i* v = x + 4 * j;
    const __m512i s0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), s1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), s3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
    _mm512_storeu_si512(out + 16 * j, _mm512_shuffle_i32x4(s0, s2, 0x88));
    _mm512_storeu_si512(out + 16 * (4 + j), _mm512_shuffle_i32x4(s0, s2, 0xDD));
    _mm512_storeu_si512(out + 16 * (8 + j), _mm512_shuffle_i32x4(s1, s3, 0x88));
    _mm512_storeu_si512(out + 16 * (12 + j), _mm512_shuffle_i32x4(s1, s3, 0xDD));
  }
}

#ifdef KVSERVE_HAS_GROUP_LANES16
template <typename Block>
constexpr bool kPacksFromGroups = std::is_same_v<Block, RowGroup<Q4_0>> || std::is_same_v<Block, RowGroup<Q4_1>> ||
                                  std::is_same_v<Block, RowGroup<Q5_0>> || std::is_same_v<Block, RowGroup<Q8_0>> ||
                                  std::is_same_v<Block, RowGroup<Q6_K>>;

// The row-group form: `rows` 8 or 16 (one group or two; the second tile half zero for one). Tile s holds
// the 32-element block s, or (Q6_K) chunk s % 8 of super-block s / 8, whose two 16-element halves each
// have their rows' own scale d * scale byte.
template <typename Group>
void pack_groups_into_tiles(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t rows, int64_t k,
                            uint16_t* tiles) {
  using L = GroupLanes16;
  constexpr bool kMin = std::is_same_v<Group, RowGroup<Q4_1>>;    // + m
  constexpr bool kFive = std::is_same_v<Group, RowGroup<Q5_0>>;   // fifth bits, - 16
  constexpr bool kEight = std::is_same_v<Group, RowGroup<Q8_0>>;  // signed bytes as they lie; else Q4_0: - 8
  constexpr bool kSix = std::is_same_v<Group, RowGroup<Q6_K>>;    // ql nibbles, qh bit pairs, - 32
  const uint8_t* group = blocks + n0 / Group::kRows * row_bytes;
  const int64_t second = rows > Group::kRows ? row_bytes : 0;  // stride 0: the first group again, then zeroed
  const __mmask16 valid = rows > Group::kRows ? 0xFFFF : 0x00FF;
  // Lane l of the four-row chunk c (bytes 16c .. 16c+15 of a vector) belongs to row 4c + l / 4.
  __m512i row_of_lane[4];
  for (int c = 0; c < 4; ++c)
    row_of_lane[c] =
        _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2),
                         _mm512_set1_epi32(4 * c));
  // Dword n of a tile row: row n's pair, from the low 32 bf16 (rows 0-7, a qword each) or the high.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  // The scale of each lane's row (lanes as `values` below hold them), from a vector of the 16 rows'.
  const auto per_lane = [&](__m512 row_values, __m512* lanes) {
    for (int c = 0; c < 4; ++c) lanes[c] = _mm512_permutexvar_ps(row_of_lane[c], row_values);
  };
  for (int64_t s = 0; s < k / kDepth; ++s) {
    const uint8_t* p = group + (kSix ? s / 8 : s) * Group::kBytes;
    uint16_t* tile = tiles + s * kTileElems;
    // Vector t's values (elements 4t .. 4t+3 of the 16 rows, signed bytes) times their rows' scales (and
    // plus Q4_1's m) into tile rows 2t and 2t + 1.
    const auto emit = [&](const int8_t* values, int t, const __m512* row_d, const __m512* row_m) {
      __m512 f[4];
      for (int c = 0; c < 4; ++c) {
        const __m128i chunk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + 16 * c));
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(chunk));
        // Q4_1's d * q + m in one fused step: d (an f16) times q (4 bits) is exact in float32, so rounding
        // once after the sum gives the reference's two roundings' value, bit for bit.
        f[c] = kMin ? _mm512_fmadd_ps(q, row_d[c], row_m[c]) : _mm512_mul_ps(q, row_d[c]);
      }
      const __m512i low = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), high = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
      _mm512_storeu_si512(tile + 2 * t * 32, _mm512_permutex2var_epi32(low, even, high));
      _mm512_storeu_si512(tile + (2 * t + 1) * 32, _mm512_permutex2var_epi32(low, odd, high));
    };
    const uint8_t* qs = p + Group::kQsOffset;
    if constexpr (kSix) {
      const int chunk = static_cast<int>(s % 8);
      __m512 half_scales[2], row_scale[2][4];  // the chunk's two 16-element halves
      q6_k_chunk_scales<L>(p, second, chunk, _mm512_maskz_mov_ps(valid, L::halves(p + kQ6KD, second)), half_scales);
      for (int half = 0; half < 2; ++half) per_lane(half_scales[half], row_scale[half]);
      for (int i = 0; i < 8; ++i) {
        alignas(64) int8_t values[64];
        _mm512_store_si512(values, _mm512_sub_epi8(q6_k_values<L>(qs, second, chunk, i), L::bytes(32)));
        emit(values, i, row_scale[i / 4], nullptr);
      }
      continue;
    }
    __m512 row_d[4], row_m[4];
    per_lane(_mm512_maskz_mov_ps(valid, L::halves(p, second)), row_d);
    per_lane(kMin ? _mm512_maskz_mov_ps(valid, L::halves(p + 2 * Group::kRows, second)) : _mm512_setzero_ps(), row_m);
    if constexpr (kEight) {
      for (int t = 0; t < 8; ++t) {
        alignas(64) int8_t values[64];
        _mm512_store_si512(values, L::load(qs + 32 * t, second));
        emit(values, t, row_d, row_m);
      }
    } else {
      const __m512i mask = L::bytes(0xF), qh = kFive ? L::load(p + 2 * Group::kRows, second) : L::zero();
      const __m512i offset = L::bytes(kFive ? 16 : 8);
      for (int j = 0; j < 4; ++j) {
        const __m512i w = L::load(qs + 32 * j, second);
        __m512i q[2] = {w & mask, L::srli16(w, 4) & mask};  // elements 4j .. (low nibbles), 16 + 4j .. (high)
        for (int h = 0; h < 2; ++h) {
          if constexpr (kFive) q[h] = q[h] | fifth_bits<L>(qh, j + 4 * h);
          if constexpr (!kMin) q[h] = _mm512_sub_epi8(q[h], offset);
          alignas(64) int8_t values[64];
          _mm512_store_si512(values, q[h]);
          emit(values, j + 4 * h, row_d, row_m);
        }
      }
    }
  }
}
#endif

// Weight rows n0 .. n0 + rows - 1 (rows <= 16; n0 and rows whole groups in row groups) as k / 32 B tiles
// at tiles (tile s: k 32s .. 32s+31); rows past `rows` zero. rows_scratch: room for 16 x k bf16 (the
// dequantized rows of the transposing form).
template <typename Block>
void pack_rows_into_tiles(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t rows, int64_t k,
                          uint16_t* tiles, uint16_t* rows_scratch) {
#ifdef KVSERVE_HAS_GROUP_LANES16
  if constexpr (kPacksFromGroups<Block>) {
    pack_groups_into_tiles<Block>(blocks, row_bytes, n0, rows, k, tiles);
    return;
  }
#endif
  dequantize_rows_into<Block>(blocks, row_bytes, n0, rows, k, rows_scratch);
  for (int64_t s = 0; s < k / kDepth; ++s)
    transpose_16x16_dwords(reinterpret_cast<const uint32_t*>(rows_scratch + s * kDepth), k / 2, rows,
                           reinterpret_cast<uint32_t*>(tiles + s * kTileElems));
}

}  // namespace kvserve::quant
#endif
