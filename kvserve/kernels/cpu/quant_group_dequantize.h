// Weight rows dequantized as whole rows, in either layout (GGML's or row groups, quant_row_groups.h): the
// panel products' fixed cost (quant_linear.cpp, quant_pack_tiles.h), exactly as each base type's
// dequantize (and gguf) computes the values.
//
// A row group holds eight rows' values a 32-bit lane per row (elements 4j .. 4j+3 of each row in its
// vector j), the form its GEMV multiplies. Here, with AVX2 and F16C, a group's values come out eight rows
// at a time as the GEMV unpacks them (group_lanes.h), are transposed as 8 x 8 dwords into each row's 32
// consecutive elements, then scaled as GGML's layout is (quant_blocks.h: widen32). The rows' scales are
// computed as vectors, lane by lane the same float32 operations as the base type's scalar ones, and read
// back from an array per row. Without AVX2 each row is gathered into GGML's layout and dequantized there.
#pragma once

#include "group_lanes.h"
#include "quant_row_groups.h"

namespace kvserve::quant {

#ifdef KVSERVE_HAS_GROUP_LANES8
// Eight vectors of eight rows' dwords (dword r of v[j]: row r's dword j) as eight rows (dword j of
// rows[r]: the same): per 128-bit lane (rows 0-3, 4-7) pairs of j, then quads, then halves.
inline void transpose_8x8_dwords(const __m256i* v, __m256i* rows) {
  __m256i pairs[8], quads[8];
  for (int j = 0; j < 8; j += 2) {
    pairs[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);      // rows 0, 1 | 4, 5: j, j + 1
    pairs[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);  // rows 2, 3 | 6, 7
  }
  for (int h = 0; h < 2; ++h)      // h: j 0-3 or 4-7
    for (int s = 0; s < 2; ++s) {  // s: rows 0, 1 | 4, 5 or rows 2, 3 | 6, 7
      quads[4 * h + 2 * s] = _mm256_unpacklo_epi64(pairs[4 * h + s], pairs[4 * h + 2 + s]);  // row 2s | 2s + 4
      quads[4 * h + 2 * s + 1] = _mm256_unpackhi_epi64(pairs[4 * h + s], pairs[4 * h + 2 + s]);
    }
  for (int p = 0; p < 4; ++p) {  // quads[p]: rows p | p + 4, j 0-3; quads[4 + p]: the same rows, j 4-7
    rows[p] = _mm256_permute2x128_si256(quads[p], quads[4 + p], 0x20);
    rows[p + 4] = _mm256_permute2x128_si256(quads[p], quads[4 + p], 0x31);
  }
}

// 32 elements of each of the eight rows from their eight lane vectors q (signed bytes: the value, or for
// kAdd the unsigned level), row r times scale_low[r] (its first 16) and scale_high[r] (its last 16), plus
// add[r] where kAdd, into out + r * stride.
template <bool kAdd, typename Out>
inline void widen_rows(const __m256i* q, const float* scale_low, const float* scale_high, const float* add, Out* out,
                       int64_t stride) {
  __m256i rows[8];
  transpose_8x8_dwords(q, rows);
  for (int r = 0; r < 8; ++r)
    widen32<kAdd>(rows[r], scale_low[r], scale_high[r], kAdd ? add[r] : 0.f, out + r * stride);
}

// Row r of the 32-element types from its 16 GGML-order qs bytes and its scale fields, as Base::dequantize does.
template <typename Base, typename Out>
inline void dequantize_qs(__m128i qs, const uint8_t* group, int64_t r, Out* out) {
  constexpr int64_t kRows = RowGroup<Base>::kRows;
  const float d = half_to_float(group + 2 * r);
  if constexpr (std::is_same_v<Base, Q4_1>)
    widen32<true>(nibbles32(qs), d, d, half_to_float(group + 2 * kRows + 2 * r), out);
  else if constexpr (std::is_same_v<Base, Q5_0>)
    widen32<false>(
        _mm256_sub_epi8(_mm256_or_si256(nibbles32(qs), high_bits32(group + 2 * kRows + 4 * r)), _mm256_set1_epi8(16)),
        d, d, 0.f, out);
  else
    widen32<false>(_mm256_sub_epi8(nibbles32(qs), _mm256_set1_epi8(8)), d, d, 0.f, out);
}

// The eight rows of group block `group` into out + r * stride (row r's kElems values).
template <typename Group, typename Out>
void dequantize_group(const uint8_t* group, Out* out, int64_t stride) {
  using L = GroupLanes8;
  using Base = typename Group::BaseBlock;
  const uint8_t* qs = group + Group::kQsOffset;
  if constexpr (std::is_same_v<Base, Q8_0>) {
    alignas(32) float d[8];
    _mm256_store_ps(d, L::halves(group, 0));
    __m256i q[8];
    for (int j = 0; j < 8; ++j) q[j] = L::load(qs + 32 * j, 0);
    widen_rows<false>(q, d, d, nullptr, out, stride);
  } else if constexpr (std::is_same_v<Base, Q4_K>) {
    const __m256 d = L::halves(group, 0), dmin = L::halves(group + 16, 0);
    __m256i s[12];  // byte j of each row's 12 scale bytes, lane r
    for (int j = 0; j < 12; ++j) s[j] = L::byte_lanes(group + 32 + 8 * j, 0);
    for (int sub = 0; sub < 8; ++sub) {  // elements 32 sub .. 32 sub + 31
      __m256i sc, mn;
      q4_k_scale_min<L>(s, sub, sc, mn);
      alignas(32) float scale[8], minus_offset[8];  // x - o == x + -o, as Q4_K::dequantize adds it
      _mm256_store_ps(scale, d * L::to_float(sc));
      _mm256_store_ps(minus_offset, -(dmin * L::to_float(mn)));
      __m256i q[8];  // elements 4t .. 4t+3 of the sub-block
      for (int t = 0; t < 8; ++t) q[t] = q4_k_values<L>(qs, 0, sub, t);
      widen_rows<true>(q, scale, scale, minus_offset, out + 32 * sub, stride);
    }
  } else if constexpr (std::is_same_v<Base, Q6_K>) {
    const __m256 d = L::halves(group + kQ6KD, 0);
    for (int chunk = 0; chunk < 8; ++chunk) {  // elements 32 chunk .. 32 chunk + 31
      __m256 halves[2];
      q6_k_chunk_scales<L>(group, 0, chunk, d, halves);
      alignas(32) float scale[2][8];
      for (int half = 0; half < 2; ++half) _mm256_store_ps(scale[half], halves[half]);
      __m256i q[8];
      for (int i = 0; i < 8; ++i) q[i] = _mm256_sub_epi8(q6_k_values<L>(qs, 0, chunk, i), L::bytes(32));
      widen_rows<false>(q, scale[0], scale[1], nullptr, out + 32 * chunk, stride);
    }
  } else {
    const __m256i v0 = L::load(qs, 0), v1 = L::load(qs + 32, 0), v2 = L::load(qs + 64, 0), v3 = L::load(qs + 96, 0);
    // Dword r of v_j is row r's qs bytes 4j .. 4j+3; per 128-bit lane, rows 0-3 and 4-7.
    const __m256i rows01 = _mm256_unpacklo_epi32(v0, v1), rows23 = _mm256_unpackhi_epi32(v0, v1);
    const __m256i rows01_high = _mm256_unpacklo_epi32(v2, v3), rows23_high = _mm256_unpackhi_epi32(v2, v3);
    const __m256i row_pairs[4] = {
        _mm256_unpacklo_epi64(rows01, rows01_high), _mm256_unpackhi_epi64(rows01, rows01_high),
        _mm256_unpacklo_epi64(rows23, rows23_high), _mm256_unpackhi_epi64(rows23, rows23_high)};  // rows p | p + 4
    for (int p = 0; p < 4; ++p) {
      dequantize_qs<Base>(_mm256_castsi256_si128(row_pairs[p]), group, p, out + p * stride);
      dequantize_qs<Base>(_mm256_extracti128_si256(row_pairs[p], 1), group, p + 4, out + (p + 4) * stride);
    }
  }
}
#else
template <typename Group, typename Out>
void dequantize_group(const uint8_t* group, Out* out, int64_t stride) {
  for (int64_t r = 0; r < Group::kRows; ++r) Group::dequantize_row(group, r, out + r * stride);
}
#endif

// Weight rows n0 .. n0 + rows - 1 (n0 and rows whole groups in row groups) dequantized into tile
// (row r at tile + r * k; float32, or bf16 bits as quant_blocks.h rounds them), in either layout.
template <typename Block, typename Out>
inline void dequantize_rows_into(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t rows, int64_t k,
                                 Out* tile) {
  constexpr int64_t kRows = rows_per_stored_row<Block>();
  for (int64_t r = 0; r < rows; r += kRows)
    for (int64_t b = 0; b < k / Block::kElems; ++b) {
      const uint8_t* block = blocks + (n0 + r) / kRows * row_bytes + b * Block::kBytes;
      if constexpr (kRows == 1)
        Block::dequantize(block, tile + r * k + b * Block::kElems);
      else
        dequantize_group<Block>(block, tile + r * k + b * Block::kElems, k);
    }
}

}  // namespace kvserve::quant
