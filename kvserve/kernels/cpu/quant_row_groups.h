// Row groups: a quantized matrix with the blocks of kRows = 8 rows interleaved, so the batch-1 GEMV
// multiplies eight rows at once with each 32-bit lane of a vector holding one row (quant_gemv.cpp). The
// GGML layout (quant_blocks.h) keeps each block's scales beside its values, so a GEMV over it spends
// scalar work per block and row (two half-float conversions, a scale product, a broadcast, a horizontal
// sum per row at the end) that a row group spends once per eight rows. kvserve/model/quantized.py packs
// the groups at load (`QuantizedTensor.interleaved`); the bytes are a permutation of GGML's, no more.
//
// Group block b of rows 8g .. 8g+7 (Base = Q4_0 or Q4_1, whose blocks are [f16 fields][qs 16 bytes]):
//   [field 0 of rows 0-7: 8 x f16][field 1 of rows 0-7 (Q4_1's m)][qs: 4 vectors of 32 bytes]
// where byte 4r + t of qs vector j is byte 4j + t of row r's qs. A qs byte holds element i in its low
// nibble and element i + 16 in its high one (GGML's), so the low nibbles of vector j are elements
// 4j .. 4j+3 of each row, lane r, and its high nibbles elements 16 + 4j .. 16 + 4j + 3.
//
// The matrix is uint8 [N / 8, K / 32 * kBytes]; a type number kRowGroupTypeOffset + Base::kType names
// it to the kernels (kvserve/model/quantized.py: ROW_GROUP_TYPE_OFFSET, the same number).
#pragma once

#include "quant_blocks.h"

namespace kvserve::quant {

constexpr int64_t kRowGroupTypeOffset = 256;  // above every GGML type number

template <typename Base>
struct RowGroup {
  static_assert(std::is_same_v<Base, Q4_0> || std::is_same_v<Base, Q4_1>);
  static constexpr int64_t kRows = 8, kElems = Base::kElems, kBytes = kRows * Base::kBytes;
  static constexpr int64_t kType = kRowGroupTypeOffset + Base::kType;
  static constexpr int64_t kFieldBytes = Base::kBytes - 16;  // Q4_0: d; Q4_1: d, m
  static constexpr int64_t kQsOffset = kRows * kFieldBytes;

  // Row r's block in GGML's layout (Base::kBytes bytes) from group block `group`.
  static void gather(const uint8_t* group, int64_t r, uint8_t* block) {
    for (int64_t f = 0; f < kFieldBytes / 2; ++f) std::memcpy(block + 2 * f, group + f * 2 * kRows + 2 * r, 2);
    for (int64_t j = 0; j < 4; ++j) std::memcpy(block + kFieldBytes + 4 * j, group + kQsOffset + 32 * j + 4 * r, 4);
  }

  // Row r of the group block dequantized, exactly as Base::dequantize (and gguf) computes it: the same
  // vector operations on the row's 16 qs bytes, gathered into a register (a copy through memory would
  // stall on store forwarding: four 4-byte stores read back as one 16-byte load).
  static void dequantize_row(const uint8_t* group, int64_t r, float* out) {
#ifdef KVSERVE_QUANT_AVX2
    const uint8_t* qs = group + kQsOffset + 4 * r;
    int32_t dwords[4];
    for (int j = 0; j < 4; ++j) std::memcpy(&dwords[j], qs + 32 * j, 4);
    const __m256i q = nibbles32(_mm_setr_epi32(dwords[0], dwords[1], dwords[2], dwords[3]));
    const float d = half_to_float(group + 2 * r);
    if constexpr (std::is_same_v<Base, Q4_1>)
      widen32<true>(q, d, d, half_to_float(group + 2 * kRows + 2 * r), out);
    else
      widen32<false>(_mm256_sub_epi8(q, _mm256_set1_epi8(8)), d, d, 0.f, out);
    return;
#endif
    uint8_t block[Base::kBytes];
    gather(group, r, block);
    Base::dequantize(block, out);
  }
};

// The block layouts quant_gemv and quant_linear multiply: GGML's (any row count) and the row groups.
template <typename Fn>
decltype(auto) visit_kernel_type(int64_t type, Fn&& fn) {
  switch (type) {
    case RowGroup<Q4_0>::kType:
      return fn(RowGroup<Q4_0>{});
    case RowGroup<Q4_1>::kType:
      return fn(RowGroup<Q4_1>{});
  }
  return visit_type(type, [&](auto block) { return fn(block); });
}

// Rows per stored row of a layout: 1 for GGML's, kRows for a row group.
template <typename Block>
constexpr int64_t rows_per_stored_row() {
  if constexpr (requires { Block::kRows; })
    return Block::kRows;
  else
    return 1;
}

// Row n's block b dequantized into out (Block::kElems floats), in either layout.
template <typename Block>
inline void dequantize_block(const uint8_t* blocks, int64_t row_bytes, int64_t n, int64_t b, float* out) {
  constexpr int64_t kRows = rows_per_stored_row<Block>();
  const uint8_t* block = blocks + (n / kRows) * row_bytes + b * Block::kBytes;
  if constexpr (kRows == 1)
    Block::dequantize(block, out);
  else
    Block::dequantize_row(block, n % kRows, out);
}

}  // namespace kvserve::quant
