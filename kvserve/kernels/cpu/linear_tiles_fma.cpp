// y = x @ W^T for bf16 activations of a few to a few hundred rows on float32 FMAs (AVX-512 or AVX2),
// reading the weight in linear_amx's packed layout: the batched products where the CPU has no AMX.
//
// Why not oneDNN's bf16 kernel there: on CPUs whose VDPBF16PS issues at half the rate of float32 FMAs
// (Intel's), widening both operands to float32 and using FMAs has twice the peak, and where oneDNN has
// no bf16 kernel at all (AVX2) it multiplies float32 weights of twice the bytes. Which is faster on the
// CPU at hand is measured, not assumed: kvserve/model/linear.py probes oneDNN and both forms of the tiles
// (below) once per process.
//
// The register block (tiles_fma.h): kRows rows of x times 32 columns of W, so the results are those of
// a float32 product of the bf16 values, up to the order of the sums. It multiplies on FMAs (x widened to
// float32 once per call) or, where the build has AVX512-BF16 and the process chose it, on VDPBF16PS (x as
// it is): tiles_fma.h says why both.
//
// Gated (the MLP's up projection): as linear_amx, each 32-column block holds 16 gate columns and their 16
// up columns, and the epilogue stores silu(gate) * up.
#include "ops.h"
#include "tiles_fma.h"
#include "work_claims.h"

namespace kvserve {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace tiles_fma;

// Rows m0 .. m0 + R - 1 of x (bf16 or float32, as the register block reads it; row stride k) times
// column blocks 2 * pair and 2 * pair + 1, stored as y's rows (bf16, n columns; gated: n / 2).
template <int R, typename X>
void block_product(const X* x, const uint16_t* packed, int64_t k, int64_t m0, int64_t pair, int64_t n, bool gated,
                   uint16_t* y) {
  alignas(64) float c[R][2 * kBlockCols];
  accumulate<R>(x + m0 * k, k, packed, pair, c);
  for (int r = 0; r < R; ++r) {
    if (gated) {  // columns 0-15: gate, 16-31: their up columns
      float gated_row[kBlockCols];
      for (int v = 0; v < kVectorsPerBlock; ++v) {
        const WideLanes gate = lanes_load(&c[r][v * kLanes], WideLanes{});
        const WideLanes up = lanes_load(&c[r][kBlockCols + v * kLanes], WideLanes{});
        lanes_store(&gated_row[v * kLanes], silu_times(gate, up));
      }
      uint16_t* out = y + (m0 + r) * (n / 2) + pair * kBlockCols;
      for (int j = 0; j < kBlockCols; ++j) out[j] = from_float<uint16_t>(gated_row[j]);
    } else {
      uint16_t* out = y + (m0 + r) * n + pair * 2 * kBlockCols;
      for (int j = 0; j < 2 * kBlockCols; ++j) out[j] = from_float<uint16_t>(c[r][j]);
    }
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
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t full_blocks = rows / kRows;
  const int tail = static_cast<int>(rows % kRows);
  with_a_type([&](auto a_type) {
    // x as the register block reads it: bf16 pairs in the VDPBF16PS form, else float32.
    using X = decltype(a_type);
    const at::Tensor xs = std::is_same_v<X, uint16_t> ? x.contiguous() : x.to(at::kFloat).contiguous();
    const X* x_data = static_cast<const X*>(xs.data_ptr());
    // Each thread walks its own run of 32-column blocks front to back and reuses each for every row block
    // while it sits in L1/L2, as linear_amx does.
    parallel_claims(0, n / (2 * kBlockCols), [=](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        for (int64_t block = 0; block < full_blocks; ++block)
          block_product<kRows>(x_data, w, k, block * kRows, pair, n, gated, out);
        with_rows(tail, [&](auto tail_rows) {
          block_product<decltype(tail_rows)::value>(x_data, w, k, full_blocks * kRows, pair, n, gated, out);
        });
      }
    });
  });
  return y;
}
#else
at::Tensor linear_tiles_fma(at::Tensor, at::Tensor, bool) { TORCH_CHECK(false, "this build has no AVX2/FMA kernels"); }
#endif

void set_tile_products(bool panels, bool long_chunks, bool bf16_pairs) {
  tiles_fma::choice.panels = panels;
  tiles_fma::choice.long_chunks = long_chunks;
  tiles_fma::choice.bf16_pairs = bf16_pairs && tiles_fma::kBf16Pairs;
}

std::tuple<bool, bool, bool> tile_products() {
  return {tiles_fma::choice.panels, tiles_fma::choice.long_chunks, tiles_fma::choice.bf16_pairs};
}

}  // namespace kvserve
