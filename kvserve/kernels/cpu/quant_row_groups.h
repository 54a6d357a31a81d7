// Row groups: a quantized matrix with the blocks of kRows = 8 rows interleaved, so the batch-1 GEMV
// multiplies eight rows at once with each 32-bit lane of a vector holding one row (quant_gemv.cpp). The
// GGML layout (quant_blocks.h) keeps each block's scales beside its values, so a GEMV over it spends
// scalar work per block and row (two half-float conversions, a scale product, a broadcast, a horizontal
// sum per row at the end) that a row group spends once per eight rows. kvserve/model/quantized.py packs
// the groups at load (`QuantizedTensor.interleaved`); the bytes are a permutation of GGML's, no more.
//
// Group block b of rows 8g .. 8g+7 (Base = Q4_0, Q4_1, Q5_0, Q8_0 or Q4_K, whose blocks are [fields][qs]:
// 16 qs bytes for the 4- and 5-bit types, 32 for Q8_0, 128 for Q4_K; the fields kFieldWidths: f16 d, then
// Q4_1's f16 m, Q5_0's 32 fifth bits qh, Q4_K's f16 dmin and its 12 scale bytes one field each; or Q6_K,
// whose blocks are [qs][fields]: 192 qs bytes (its 128 bytes of low nibbles ql, then its 64 of high bit
// pairs qh), then its 16 signed scale bytes one field each and its f16 d):
//   [field 0 of rows 0-7][field 1 of rows 0-7] ... [qs: kQsBytes / 4 vectors of 32 bytes]
// where byte 4r + t of qs vector j is byte 4j + t of row r's qs. A 4- or 5-bit type's qs byte holds
// element i in its low nibble and element i + 16 in its high one (GGML's), so the low nibbles of vector j
// are elements 4j .. 4j+3 of each row, lane r, and its high nibbles elements 16 + 4j .. 16 + 4j + 3; Q5_0's
// qh of row r (bit i: element i's fifth bit) is dword r of its field, lane r too; Q8_0's vector j holds
// elements 4j .. 4j+3 of each row as signed bytes. Q4_K's qs byte 32c + l holds element 64c + l low and
// 64c + 32 + l high, so vector 8c + j holds elements 4j .. 4j+3 of sub-block 2c (low nibbles) and of
// sub-block 2c + 1 (high); scale byte j of the eight rows is one 8-byte field, a lane per row once widened.
// Q6_K's element 128h + 32t + l (h < 2, t < 4, l < 32) is nibble t / 2 of ql byte 64h + 32 (t % 2) + l
// with bit pair t of qh byte 32h + l above it, so its 32 elements 4i .. 4i+3 of chunk 4h + t are in ql
// vector 16h + 8 (t % 2) + i and qh vector 32 + 8h + i; its scale bytes are fields as Q4_K's.
//
// The matrix is uint8 [N / 8, K / kElems * kBytes]; a type number kRowGroupTypeOffset + Base::kType names
// it to the kernels (kvserve/model/quantized.py: ROW_GROUP_TYPE_OFFSET, the same number).
#pragma once

#include <array>
#include <numeric>

#include "quant_blocks.h"

namespace kvserve::quant {

constexpr int64_t kRowGroupTypeOffset = 256;  // above every GGML type number

// The bytes of each field before a block's qs, in GGML's order: its row group's fields.
constexpr std::array<int64_t, 1> field_widths(Q4_0) { return {2}; }     // d
constexpr std::array<int64_t, 1> field_widths(Q8_0) { return {2}; }     // d
constexpr std::array<int64_t, 2> field_widths(Q4_1) { return {2, 2}; }  // d, m
constexpr std::array<int64_t, 2> field_widths(Q5_0) { return {2, 4}; }  // d, qh
constexpr std::array<int64_t, 14> field_widths(Q4_K) {
  return {2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
}  // d, dmin, scales
constexpr std::array<int64_t, 17> field_widths(Q6_K) {
  return {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2};
}  // scales, d (after the qs)

template <typename Base>
struct RowGroup {
  static_assert(std::is_same_v<Base, Q4_0> || std::is_same_v<Base, Q4_1> || std::is_same_v<Base, Q5_0> ||
                std::is_same_v<Base, Q8_0> || std::is_same_v<Base, Q4_K> || std::is_same_v<Base, Q6_K>);
  using BaseBlock = Base;
  static constexpr int64_t kRows = 8, kElems = Base::kElems, kBytes = kRows * Base::kBytes;
  static constexpr int64_t kType = kRowGroupTypeOffset + Base::kType;
  static constexpr int64_t kQsBytes = std::is_same_v<Base, Q8_0>   ? 32
                                      : std::is_same_v<Base, Q4_K> ? 128
                                      : std::is_same_v<Base, Q6_K> ? 192
                                                                   : 16;
  static constexpr int64_t kQsVectors = kQsBytes / 4;
  static constexpr auto kFieldWidths = field_widths(Base{});
  static constexpr int64_t kFieldBytes = Base::kBytes - kQsBytes;
  static constexpr int64_t kQsOffset = kRows * kFieldBytes;
  static constexpr bool kQsFirst = std::is_same_v<Base, Q6_K>;  // in GGML's block; a group's fields come first
  static_assert(std::accumulate(kFieldWidths.begin(), kFieldWidths.end(), int64_t{0}) == kFieldBytes);

  // Row r's block in GGML's layout (Base::kBytes bytes) from group block `group`.
  static void gather(const uint8_t* group, int64_t r, uint8_t* block) {
    int64_t field_offset = 0, block_offset = kQsFirst ? kQsBytes : 0;
    for (const int64_t width : kFieldWidths) {
      std::memcpy(block + block_offset, group + field_offset + width * r, width);
      field_offset += kRows * width;
      block_offset += width;
    }
    const int64_t qs_offset = kQsFirst ? 0 : kFieldBytes;
    for (int64_t j = 0; j < kQsVectors; ++j)
      std::memcpy(block + qs_offset + 4 * j, group + kQsOffset + 32 * j + 4 * r, 4);
  }

  // Row r's Base::kElems values of group block `group`, exactly as Base::dequantize (one row: the
  // embedding's gather; quant_group_dequantize.h serves whole groups).
  template <typename Out>
  static void dequantize_row(const uint8_t* group, int64_t r, Out* out) {
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
    case RowGroup<Q5_0>::kType:
      return fn(RowGroup<Q5_0>{});
    case RowGroup<Q4_K>::kType:
      return fn(RowGroup<Q4_K>{});
    case RowGroup<Q6_K>::kType:
      return fn(RowGroup<Q6_K>{});
    case RowGroup<Q8_0>::kType:
      return fn(RowGroup<Q8_0>{});
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

// Weight row `row` (K values) dequantized into out, in either layout, exactly as Block's base type does.
template <typename Block, typename Out>
inline void dequantize_row(const uint8_t* blocks, int64_t row_bytes, int64_t row, int64_t k, Out* out) {
  constexpr int64_t kRows = rows_per_stored_row<Block>();
  const uint8_t* stored = blocks + row / kRows * row_bytes;
  for (int64_t b = 0; b < k / Block::kElems; ++b) {
    if constexpr (kRows == 1)
      Block::dequantize(stored + b * Block::kBytes, out + b * Block::kElems);
    else
      Block::dequantize_row(stored + b * Block::kBytes, row % kRows, out + b * Block::kElems);
  }
}

}  // namespace kvserve::quant
