// The float32-FMA tile product's register block, shared by linear_tiles_fma.cpp (rows of x times a
// packed weight) and quant_linear.cpp (rows of a dequantized weight panel times packed x).
//
// Operands: `a`, R rows of float32 (row stride k), and a bf16 matrix B packed in pack_tiles' layout
// (kvserve/model/linear.py): for each 16-column block, the key pairs in order, each pair 16 columns x 2
// bf16 (element (n, k) at (k / 2) * 32 + n * 2 + k % 2 within the block). A 32-bit lane holds B[n, k] (k
// even) in bits 0-15 and B[n, k + 1] in bits 16-31, so a shift left by 16 gives B[n, k] as float32 and a
// mask of the high half B[n, k + 1] (bf16 widens to float32 exactly).
//
// Register blocking: R rows of `a` times 32 columns (two 16-column blocks) in float32 accumulators for
// the whole of k; each widened vector of B feeds R FMAs, each broadcast value of `a` one per vector of
// the pass's columns. The products are exact and summed in float32 in key order.
//
// Where the build has AVX512-BF16, `a` may be bf16 too: then B's lanes are not widened, each row's key
// pair is broadcast as one 32-bit word, and one VDPBF16PS adds both of its products to a lane (32
// products per instruction against an FMA's 16; oneDNN's bf16 kernel is built on the same instruction).
// The products are still exact bf16 x bf16 in float32; VDPBF16PS flushes subnormal inputs and results to
// zero and adds the odd key's product before the even key's.
//
// Which form runs is the process's choice (set_tile_products, ops.h), not the build's: AMD's Zen 4 issues
// VDPBF16PS at the FMA rate, so the bf16 form does twice the work per instruction there, while Intel's
// cores issue it at half the FMA rate, where the float32 form is twice as fast (benchmarks/RESULTS.md,
// "VDPBF16PS tiles" and "Both tile forms, chosen by a probe").
#pragma once

#include <atomic>
#include <type_traits>

#include "common.h"

namespace kvserve::tiles_fma {

// The process's tile products without AMX, as set_tile_products last set them (off until then):
// - panels: quant_linear multiplies bf16 x in these register blocks (packed_x_times_panels);
// - long_chunks: quant_linear's chunks past kLongChunkRows take linear_tiles_fma on W dequantized whole;
// - bf16_pairs: the register blocks take bf16 `a` on VDPBF16PS, where the build has it.
struct Choice {
  std::atomic<bool> panels{false}, long_chunks{false}, bf16_pairs{false};
};
inline Choice choice;

// Whether `a` may be bf16 (the VDPBF16PS form above).
#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kBlockCols = 16;              // columns per packed block
constexpr int64_t kPairElems = 2 * kBlockCols;  // bf16 elements per key pair of one block
constexpr int kLanes = sizeof(WideLanes) / 4;   // float32 lanes per vector
constexpr int kVectorsPerBlock = kBlockCols / kLanes;
// Vectors of columns accumulated together in one pass over k (at most): all 32 columns of a pair of
// blocks with 512-bit vectors, 16 per pass (two passes) with 256-bit ones.
constexpr int kPassVectors = 2;
// Rows per register block: the accumulators (kRows * kPassVectors), the widened B vectors (2 *
// kPassVectors) and one row's two broadcasts fill the register file (32 zmm, 16 ymm) without spilling.
constexpr int kRows = kLanes == 16 ? 12 : 5;

// B[n, k] and B[n, k + 1] as float32 for the kLanes columns whose key pairs start at p.
inline void widen_pairs(const uint16_t* p, WideLanes& even, WideLanes& odd) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
}

// fn(float{}) or, where the build has the VDPBF16PS form and the process chose it, fn(uint16_t{}): the
// element type of the register block's `a` operand as a compile-time type.
template <typename Fn>
decltype(auto) with_a_type(Fn&& fn) {
  if constexpr (kBf16Pairs) {
    if (choice.bf16_pairs.load(std::memory_order_relaxed)) return fn(uint16_t{});
  }
  return fn(float{});
}

// c[r][j] = sum over k of a[r * k + e] * B[32 * pair + j, e], for r < R and the 16 * Blocks columns j of
// B's column blocks 2 * pair .. 2 * pair + Blocks - 1 (k even). Blocks is 1 where the pair's second block
// holds no column the caller needs (a panel product's last rows of x, quant_linear.cpp), whose work would
// otherwise cost as much as the first's. `a` is float32, or bf16 where kBf16Pairs.
template <int R, int Blocks = 2, typename A>
void accumulate(const A* a, int64_t k, const uint16_t* packed, int64_t pair, float (*c)[2 * kBlockCols]) {
  static_assert(Blocks == 1 || Blocks == 2);
  constexpr bool kPairs = std::is_same_v<A, uint16_t>;
  static_assert(std::is_same_v<A, float> || (kPairs && kBf16Pairs), "a is float32, or bf16 with AVX512-BF16");
  constexpr int kWidth = std::min(kPassVectors, Blocks * kVectorsPerBlock);  // vectors per pass
  constexpr int kBlockPasses = Blocks * kVectorsPerBlock / kWidth;
  const uint16_t* blocks[Blocks];
  for (int b = 0; b < Blocks; ++b) blocks[b] = packed + (2 * pair + b) * k * kBlockCols;
  for (int pass = 0; pass < kBlockPasses; ++pass) {
    WideLanes acc[R][kWidth];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kWidth; ++v) acc[r][v] = splat<WideLanes>(0.f);
    for (int64_t pair_k = 0; pair_k < k / 2; ++pair_k) {
      const uint16_t* lanes[kWidth];  // the key pair's B[n, k], B[n, k + 1] for each vector's columns
      for (int v = 0; v < kWidth; ++v) {
        const int column_vector = pass * kWidth + v;
        lanes[v] = blocks[column_vector / kVectorsPerBlock] + pair_k * kPairElems +
                   (column_vector % kVectorsPerBlock) * 2 * kLanes;
      }
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        __m512bh b[kWidth];
        for (int v = 0; v < kWidth; ++v) b[v] = (__m512bh)_mm512_loadu_si512(lanes[v]);
        for (int r = 0; r < R; ++r) {
          uint32_t a_pair;  // a[r, k] in bits 0-15, a[r, k + 1] in bits 16-31, as B's lanes hold theirs
          std::memcpy(&a_pair, a + r * k + 2 * pair_k, sizeof(a_pair));
          const __m512bh a_pairs = (__m512bh)_mm512_set1_epi32(static_cast<int>(a_pair));
          for (int v = 0; v < kWidth; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a_pairs, b[v]);
        }
#endif
      } else {
        WideLanes even[kWidth], odd[kWidth];
        for (int v = 0; v < kWidth; ++v) widen_pairs(lanes[v], even[v], odd[v]);
        // Row by row, so that only one row's two broadcasts are live beside the accumulators.
        for (int r = 0; r < R; ++r) {
          const WideLanes a_even = splat<WideLanes>(a[r * k + 2 * pair_k]);
          const WideLanes a_odd = splat<WideLanes>(a[r * k + 2 * pair_k + 1]);
          for (int v = 0; v < kWidth; ++v) acc[r][v] = lanes_fma(a_odd, odd[v], lanes_fma(a_even, even[v], acc[r][v]));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kWidth; ++v) lanes_store(&c[r][(pass * kWidth + v) * kLanes], acc[r][v]);
  }
}

// fn(std::integral_constant<int, rows>{}) for 1 <= rows <= kRows: a register block's row count as a
// compile-time constant, for the last block of fewer than kRows rows.
template <int R = kRows, typename Fn>
void with_rows(int rows, Fn&& fn) {
  if constexpr (R > 0) {
    if (rows == R) return fn(std::integral_constant<int, R>{});
    with_rows<R - 1>(rows, fn);
  }
}
#endif

}  // namespace kvserve::tiles_fma
