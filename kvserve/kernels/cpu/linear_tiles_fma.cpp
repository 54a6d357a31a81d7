// y = x @ W^T for bf16 activations of a few to a few hundred rows on float32 FMAs (AVX-512 or AVX2),
// reading the weight in linear_amx's packed layout: the batched products where the CPU has no AMX.
//
// Why not oneDNN's bf16 kernel there: on CPUs whose VDPBF16PS issues at half the rate of float32 FMAs
// (Intel's), widening both operands to float32 and using FMAs has twice the peak, and where oneDNN has
// no bf16 kernel at all (AVX2) it multiplies float32 weights of twice the bytes. Which is faster on the
// CPU at hand is measured, not assumed: kvserve/model/linear.py probes both once per process.
//
// Layout (pack_tiles, kvserve/model/linear.py): for each 16-column block of W, the key pairs in order,
// each pair 16 columns x 2 bf16 (element (n, k) at (k / 2) * 32 + n * 2 + k % 2 within the block). A
// 32-bit lane holds W[n, k] (k even) in bits 0-15 and W[n, k + 1] in bits 16-31, so a shift left by 16
// gives W[n, k] as float32 and a mask of the high half W[n, k + 1] (bf16 widens to float32 exactly). x
// is widened once per call.
//
// Register blocking: kRows rows of x times 32 columns (two 16-column blocks) held in float32
// accumulators for the whole of k; each widened weight vector feeds kRows FMAs, each broadcast x value
// one per vector of the 32 columns. The products are exact and summed in float32, in key order (so the
// results are those of a float32 product of the bf16 values, up to the order of the sums).
//
// Gated (the MLP's up projection): as linear_amx, each 32-column block holds 16 gate columns and their 16
// up columns, and the epilogue stores silu(gate) * up.
#include "common.h"
#include "ops.h"

namespace kvserve {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kBlockCols = 16;                 // columns per packed block
constexpr int64_t kPairElems = 2 * kBlockCols;     // bf16 elements per key pair of one block
constexpr int kLanes = sizeof(WideLanes) / 4;      // float32 lanes per vector
constexpr int kVectors = 2 * kBlockCols / kLanes;  // vectors per 32 columns
constexpr int kVectorsPerBlock = kBlockCols / kLanes;
// Vectors of columns accumulated together in one pass over k: all 32 columns with 512-bit vectors, 16
// per pass (two passes) with 256-bit ones.
constexpr int kPassVectors = 2, kPasses = kVectors / kPassVectors;
// Rows per register block: the accumulators (kRows * kPassVectors), the widened weights (2 *
// kPassVectors) and one row's two broadcasts fill the register file (32 zmm, 16 ymm) without spilling.
constexpr int kRows = kLanes == 16 ? 12 : 5;

// W[n, k] and W[n, k + 1] as float32 for the kLanes columns whose key pairs start at p.
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

// Rows m0 .. m0 + R - 1 of x (float32, row stride k) times column blocks 2 * pair and 2 * pair + 1,
// stored as y's rows (bf16, n columns; gated: n / 2).
template <int R>
void block_product(const float* x, const uint16_t* packed, int64_t k, int64_t m0, int64_t pair, int64_t n, bool gated,
                   uint16_t* y) {
  const uint16_t* blocks[2] = {packed + 2 * pair * k * kBlockCols, packed + (2 * pair + 1) * k * kBlockCols};
  const float* xr = x + m0 * k;
  alignas(64) float c[R][2 * kBlockCols];
  for (int pass = 0; pass < kPasses; ++pass) {
    WideLanes acc[R][kPassVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kPassVectors; ++v) acc[r][v] = splat<WideLanes>(0.f);
    for (int64_t pair_k = 0; pair_k < k / 2; ++pair_k) {
      WideLanes even[kPassVectors], odd[kPassVectors];
      for (int v = 0; v < kPassVectors; ++v) {
        const int column_vector = pass * kPassVectors + v;
        const uint16_t* block = blocks[column_vector / kVectorsPerBlock];
        widen_pairs(block + pair_k * kPairElems + (column_vector % kVectorsPerBlock) * 2 * kLanes, even[v], odd[v]);
      }
      // Row by row, so that only one row's two broadcasts are live beside the accumulators.
      for (int r = 0; r < R; ++r) {
        const WideLanes x_even = splat<WideLanes>(xr[r * k + 2 * pair_k]);
        const WideLanes x_odd = splat<WideLanes>(xr[r * k + 2 * pair_k + 1]);
        for (int v = 0; v < kPassVectors; ++v)
          acc[r][v] = lanes_fma(x_odd, odd[v], lanes_fma(x_even, even[v], acc[r][v]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kPassVectors; ++v) lanes_store(&c[r][(pass * kPassVectors + v) * kLanes], acc[r][v]);
  }
  for (int r = 0; r < R; ++r) {
    if (gated) {  // columns 0-15: gate, 16-31: their up columns
      float gated_row[kBlockCols];
      for (int v = 0; v < kVectorsPerBlock; ++v) {
        const WideLanes gate = lanes_load(&c[r][v * kLanes], WideLanes{});
        const WideLanes up = lanes_load(&c[r][kBlockCols + v * kLanes], WideLanes{});
        const WideLanes one = splat<WideLanes>(1.f);
        lanes_store(&gated_row[v * kLanes], gate / (one + fast_exp(splat<WideLanes>(0.f) - gate)) * up);
      }
      uint16_t* out = y + (m0 + r) * (n / 2) + pair * kBlockCols;
      for (int j = 0; j < kBlockCols; ++j) out[j] = from_float<uint16_t>(gated_row[j]);
    } else {
      uint16_t* out = y + (m0 + r) * n + pair * 2 * kBlockCols;
      for (int j = 0; j < 2 * kBlockCols; ++j) out[j] = from_float<uint16_t>(c[r][j]);
    }
  }
}

template <int R = kRows>
void tail_product(int tail, const float* x, const uint16_t* packed, int64_t k, int64_t m0, int64_t pair, int64_t n,
                  bool gated, uint16_t* y) {
  if constexpr (R > 0) {
    if (tail == R) return block_product<R>(x, packed, k, m0, pair, n, gated, y);
    tail_product<R - 1>(tail, x, packed, k, m0, pair, n, gated, y);
  }
}

}  // namespace

at::Tensor linear_tiles_fma(at::Tensor x, at::Tensor packed, bool gated) {
  RECORD_FUNCTION("kvserve::linear_tiles_fma", {});  // named in torch profiler traces
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "x and packed must be bf16");
  TORCH_CHECK(x.dim() == 2, "x must be a [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) % 2 == 0 && packed.size(2) == 512,
              "packed must be [N/16 (even), K/32, 512] (pack_tiles' layout)");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * kBlockCols;
  TORCH_CHECK(k == packed.size(1) * 32, "x has ", k, " columns, the packed weight ", packed.size(1) * 32);
  auto y = at::empty({rows, gated ? n / 2 : n}, x.options());
  if (rows == 0) return y;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* x_data = xf.data_ptr<float>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t full_blocks = rows / kRows;
  const int tail = static_cast<int>(rows % kRows);
  // Each thread walks its own run of 32-column blocks front to back and reuses each for every row block
  // while it sits in L1/L2, as linear_amx does.
  at::parallel_for(0, n / (2 * kBlockCols), 1, [=](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      for (int64_t block = 0; block < full_blocks; ++block)
        block_product<kRows>(x_data, w, k, block * kRows, pair, n, gated, out);
      if (tail > 0) tail_product(tail, x_data, w, k, full_blocks * kRows, pair, n, gated, out);
    }
  });
  return y;
}
#else
at::Tensor linear_tiles_fma(at::Tensor, at::Tensor, bool) { TORCH_CHECK(false, "this build has no AVX2/FMA kernels"); }
#endif

}  // namespace kvserve
