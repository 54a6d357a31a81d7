// y = x @ W^T for any number of rows of x (decode batches, prefill chunks), W [N, K] in GGUF blocks
// (GGML's layout or row groups, quant_row_groups.h).
//
// Each thread takes panels of kPanelRows weight rows: it dequantizes a panel into a float32 tile of its
// own (kPanelRows x K floats, sized to stay in L2), exactly as gguf.quants.dequantize would, then
// multiplies every row of x with it. So the weights are read once per call at their quantized size and
// the products see the same float32 values as dequantize-then-matmul: the results differ from that
// reference only in the order of the float32 sums. bf16 x takes one of four products:
// - with AMX: each panel of 32 weight rows is packed straight into B tiles (quant_pack_tiles.h) and
//   multiplied on amx_product.h's product, the dense bf16 weights' own (linear_amx), gated included, so
//   the results are the dense bf16 engine's, up to the order of the sums;
// - with AVX512-BF16 where the tile products are off (set_tile_products; KVSERVE_BATCHED_PRODUCT=onednn):
//   the panel is dequantized into bf16 and multiplied on VDPBF16PS (quant_linear_bf16.cpp), so the results
//   are again the dense bf16 engine's;
// - on AVX-512 without AMX where the tile products are on (in the form the process's probe timed faster:
//   kvserve/model/linear.py): x is packed once per call in pack_tiles' layout and each panel multiplies
//   it in register blocks of tiles_fma.h (panel rows as the broadcast operand, rows of x as the packed
//   one). In the blocks' VDPBF16PS form the panel is dequantized to bf16, so the results are the dense
//   bf16 engine's; in their FMA form it is float32, so they are dequantize-then-matmul's; either up to
//   the order of the sums. Not on AVX2: there its 5-row blocks lost to the micro-kernel below
//   (benchmarks/RESULTS.md, "FMA tiles");
// - otherwise the float32 micro-kernel below, on x widened to float32.
//
// Micro-kernel (outer-product form): x is packed once per call, K-major in blocks of kLanes rows
// (pack_x_columns), so per k one load brings kLanes rows' values; kXVectors such vectors times kWRows rows of
// the tile, each tile value broadcast once for kXVectors multiply-adds. The kXVectors x kWRows accumulators
// hold one result per lane, each summed in k's order: 12 accumulators + 3 x vectors + 1 broadcast fill
// AVX2's 16 registers, and a k step's 7 loads issue well within the 6 cycles of its 12 FMAs (two FMA
// pipes). The earlier dot-product form (a horizontal sum per result, each tile vector loaded for 3 rows of
// x) ran well below oneDNN's float32 GEMM (benchmarks/RESULTS.md, "Quantized panels in outer-product form
// on AVX2").
#include "amx_product.h"
#include "ops.h"
#include "quant_group_dequantize.h"
#include "quant_linear_bf16.h"
#include "quant_pack_tiles.h"
#include "tiles_fma.h"
#include "work_claims.h"

namespace kvserve {
namespace {

// 32 rows x K floats: 72 KiB at K = 576, 192 KiB at K = 1,536 (L2 is 512 KiB-2 MiB on current x86).
constexpr int64_t kPanelRows = bf16_panel::kPanelRows;
static_assert(kPanelRows % quant::RowGroup<quant::Q4_1>::kRows == 0, "a panel holds whole row groups");
#if defined(__AVX2__) && defined(__FMA__)
using PanelLanes = __m256;  // AVX-512 builds too (float32 x takes this kernel there): the form measured
#else
using PanelLanes = float;
#endif
constexpr int64_t kLanes = sizeof(PanelLanes) / sizeof(float);
constexpr int kXVectors = 3, kWRows = 4;
static_assert(kPanelRows % kWRows == 0, "a panel is whole chunks of kWRows rows");

// x [rows, k] contiguous -> packed [ceil(rows / kLanes)][k][kLanes] float32: block b, column e holds rows
// b * kLanes .. + kLanes - 1 of column e side by side, rows past the last zero.
template <typename In>
void pack_x_columns(const In* x, int64_t rows, int64_t k, float* packed) {
  at::parallel_for(0, (rows + kLanes - 1) / kLanes, 1, [=](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* block = packed + b * k * kLanes;
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t row = b * kLanes + i;
        for (int64_t e = 0; e < k; ++e) block[e * kLanes + i] = row < rows ? to_float(x[row * k + e]) : 0.f;
      }
    }
  });
}

// y[i][j] = x row i . tile row j for i < x_rows (<= XV * kLanes) of the XV packed blocks at xp and j < w_rows
// (<= kWRows) of the tile rows at w (k apart; all kWRows rows are read), each rounded once to y's dtype.
template <int XV, typename Out>
inline void packed_rows_times_tile_rows(const float* xp, int64_t x_rows, const float* w, int64_t w_rows, int64_t k,
                                        Out* y, int64_t y_stride) {
  PanelLanes acc[kWRows][XV];
  for (int j = 0; j < kWRows; ++j)
    for (int v = 0; v < XV; ++v) acc[j][v] = splat<PanelLanes>(0.f);
  for (int64_t e = 0; e < k; ++e) {
    PanelLanes xv[XV];
    for (int v = 0; v < XV; ++v) {
      xv[v] = lanes_load(xp + (v * k + e) * kLanes, PanelLanes{});
#if defined(__AVX2__) && defined(__FMA__)
      // Held in a register: GCC otherwise folds the load into each of the vector's kWRows multiply-adds,
      // 16 loads a k step in place of 7, more than the load ports issue in its FMAs' 6 cycles.
      asm("" : "+x"(xv[v]));
#endif
    }
    for (int j = 0; j < kWRows; ++j) {
      const PanelLanes wj = splat<PanelLanes>(w[j * k + e]);
      for (int v = 0; v < XV; ++v) acc[j][v] = lanes_fma(wj, xv[v], acc[j][v]);
    }
  }
  float sums[kWRows][XV * kLanes];
  for (int j = 0; j < kWRows; ++j)
    for (int v = 0; v < XV; ++v) lanes_store(&sums[j][v * kLanes], acc[j][v]);
  for (int64_t i = 0; i < x_rows; ++i)
    for (int64_t j = 0; j < w_rows; ++j) y[i * y_stride + j] = from_float<Out>(sums[j][i]);
}

// Rows [0, rows) of packed x times tile rows [0, w_rows) into y[:, 0:w_rows] (row stride y_stride). The tile
// holds kPanelRows rows, those past w_rows up to a whole kWRows zeroed.
template <typename Out>
void packed_x_times_tile(const float* xp, int64_t rows, const float* tile, int64_t w_rows, int64_t k, Out* y,
                         int64_t y_stride) {
  constexpr int64_t block_rows = kXVectors * kLanes;
  for (int64_t m = 0; m < rows; m += block_rows) {
    const int64_t x_rows = std::min(block_rows, rows - m);
    const float* x_block = xp + m * k;
    for (int64_t j = 0; j < w_rows; j += kWRows) {
      const int64_t chunk = std::min<int64_t>(kWRows, w_rows - j);
      Out* y_block = y + m * y_stride + j;
      if (x_rows > 2 * kLanes)
        packed_rows_times_tile_rows<3>(x_block, x_rows, tile + j * k, chunk, k, y_block, y_stride);
      else if (x_rows > kLanes)
        packed_rows_times_tile_rows<2>(x_block, x_rows, tile + j * k, chunk, k, y_block, y_stride);
      else
        packed_rows_times_tile_rows<1>(x_block, x_rows, tile + j * k, chunk, k, y_block, y_stride);
    }
  }
}
static_assert(kXVectors == 3, "packed_x_times_tile dispatches on 1-3 vectors of rows");

#if defined(__AVX512F__)
// x [rows, k] bf16, contiguous, packed as pack_tiles packs a weight, rows padded with
// zeros to `padded`: word (a, c, d, b) = x's pair (row 16a + b, columns 32c + 2d, +1), i.e. per 16 rows
// and 32 columns a 16 x 16 transpose of 32-bit pairs. One pass, blocks of 16 rows over the threads, where
// the torch form (pad, permute, contiguous) took three, each a dispatch (benchmarks/RESULTS.md, "Decode
// attention on AVX512-BF16").
void pack_x_pairs(const uint16_t* x, int64_t rows, int64_t padded, int64_t k, uint32_t* packed) {
  const int64_t chunks = k / 32;
  at::parallel_for(0, padded / 16, 1, [=](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      for (int64_t b = 0; b < 16; ++b) {
        const int64_t row = 16 * a + b;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(x + row * k);
        uint32_t* dst = packed + a * chunks * 256 + b;
        for (int64_t c = 0; c < chunks; ++c)
          for (int64_t d = 0; d < 16; ++d) dst[(c * 16 + d) * 16] = row < rows ? src[c * 16 + d] : 0u;
      }
    }
  });
}

// Long prefill chunks (more than kLongChunkRows rows) of bf16 x on AMX, or on AVX512-BF16 without AMX
// where the tile products are on: W dequantized whole into bf16, then the product the dense bf16 engine
// runs on such chunks (oneDNN's, or linear_tiles_fma's where kvserve/model/linear.py's probe finds the
// tiles faster there too: tiles_fma::choice.long_chunks). The panels read all of x again for each pair of
// tiles (AMX) or each panel, which costs little up to 512 rows and lost to oneDNN at 2,048 rows: by 5-15 %
// on the FMA tiles (benchmarks/RESULTS.md, "Q8_0 row groups"), by 1.2-2.1x on the AMX tiles (RESULTS.md,
// "Quantized panels packed into AMX tiles"). The copy, one matrix at a time, costs a small part of the
// product (its weights are read once more).
constexpr int64_t kLongChunkRows = 512;

#if defined(__AVX512BF16__)
template <typename Block>
at::Tensor dequantized_bf16(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k) {
  auto out = at::empty({n, k}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* dst = raw<c10::BFloat16>(out);
  parallel_claims(0, (n + kPanelRows - 1) / kPanelRows, [=](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t n0 = panel * kPanelRows;
      quant::dequantize_rows_into<Block>(w, row_bytes, n0, std::min(kPanelRows, n - n0), k, dst + n0 * k);
    }
  });
  return out;
}
#endif

// y [m, n] = x [m, k] @ W^T for bf16 x, W's rows from `blocks`: x packed as pack_tiles packs a weight
// (rows padded with zeros to whole 32-row pairs of blocks), then per panel of dequantized rows (bf16
// where the register block takes bf16 pairs, else float32), register blocks of tiles_fma::kRows panel
// rows times 32 rows of x (16 where the last pair's rows fit in its first block), stored transposed into
// y. Each 32 rows of x meet every register block of the panel in turn, so they are read from L1 while
// the panel's rows stay in L2; the other order (each register block over all of x) read x from L3 once
// per register block. `gated` (W = [gate; up], each half whole row groups): the panel holds gate rows
// n0.. and their up rows, and y [m, n / 2] = silu(gate) * up from the float32 results, as quant_gemv
// gates them.
template <typename Block>
at::Tensor packed_x_times_panels(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k,
                                 bool gated) {
  using namespace tiles_fma;
  const int64_t rows = x.size(0), padded = (rows + 31) / 32 * 32, columns = gated ? n / 2 : n;
  auto y = at::empty({rows, columns}, x.options());
  if (rows == 0) return y;
  const at::Tensor xc = x.contiguous(), packed = at::empty({padded, k}, x.options());
  pack_x_pairs(raw<c10::BFloat16>(xc), rows, padded, k, reinterpret_cast<uint32_t*>(raw<c10::BFloat16>(packed)));
  const uint16_t* xs = raw<c10::BFloat16>(packed);
  uint16_t* ys = raw<c10::BFloat16>(y);
  const int64_t panels = (columns + kPanelRows - 1) / kPanelRows;
  with_a_type([&](auto a_type) {
    parallel_claims(0, panels, [=](int64_t begin, int64_t end) {
      using Tile = decltype(a_type);
      const FlushDenormals ftz;
      Tile* tile = thread_scratch<Tile>(2 * kPanelRows * k);  // gated: the panel's gate rows, then its up rows
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t n0 = panel * kPanelRows, w_rows = std::min(kPanelRows, columns - n0);
        quant::dequantize_rows_into<Block>(w, row_bytes, n0, w_rows, k, tile);
        if (gated) quant::dequantize_rows_into<Block>(w, row_bytes, columns + n0, w_rows, k, tile + w_rows * k);
        for (int64_t pair = 0; pair < padded / 32; ++pair) {
          const int64_t valid = std::min<int64_t>(2 * kBlockCols, rows - pair * 2 * kBlockCols);
          for (int64_t r0 = 0; r0 < w_rows; r0 += kRows) {
            with_rows(static_cast<int>(std::min<int64_t>(kRows, w_rows - r0)), [&](auto block_rows) {
              constexpr int R = decltype(block_rows)::value;
              // The last pair's rows of x: its first block alone where they fit in it.
              const auto product = [&](const Tile* panel_rows, float (*out)[2 * kBlockCols]) {
                if (valid <= kBlockCols)
                  accumulate<R, 1>(panel_rows, k, xs, pair, out);
                else
                  accumulate<R, 2>(panel_rows, k, xs, pair, out);
              };
              alignas(64) float c[R][2 * kBlockCols];
              product(tile + r0 * k, c);
              if (gated) {
                alignas(64) float up[R][2 * kBlockCols];
                product(tile + (w_rows + r0) * k, up);
                for (int r = 0; r < R; ++r)
                  for (int64_t j = 0; j < valid; ++j) c[r][j] = silu_times(c[r][j], up[r][j]);
              }
              for (int64_t j = 0; j < valid; ++j)
                for (int r = 0; r < R; ++r)
                  ys[(pair * 2 * kBlockCols + j) * columns + n0 + r0 + r] = from_float<uint16_t>(c[r][j]);
            });
          }
        }
      }
    });
  });
  return y;
}
#endif

#if defined(__AVX512BF16__)
// W [n, k] (n a multiple of 32) dequantized into bf16 in pack_tiles' layout (kvserve/model/linear.py, the
// AMX B tiles' own), straight from its blocks (quant_pack_tiles.h): a long chunk's weight for
// linear_tiles_fma, without a dense copy to permute. `gated` (W = [gate; up]): the 16-row blocks
// interleaved gate, up, gate, up (linear.py's _interleave_halves), for the tiles' gated epilogue.
template <typename Block>
at::Tensor dequantized_tiles(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, bool gated) {
  constexpr int64_t kCols = tiles_fma::kBlockCols;
  auto out = at::empty({n / kCols, k / 32, 512}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* dst = raw<c10::BFloat16>(out);
  parallel_claims(0, n / kCols, [=](int64_t begin, int64_t end) {
    uint16_t* rows_scratch = thread_scratch<uint16_t>(kCols * k);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = gated ? block % 2 * (n / 2) + block / 2 * kCols : block * kCols;
      quant::pack_rows_into_tiles<Block>(w, row_bytes, n0, kCols, k, dst + block * kCols * k, rows_scratch);
    }
  });
  return out;
}
#endif

}  // namespace

at::Tensor quant_linear(at::Tensor x, at::Tensor blocks, int64_t type, bool gated) {
  RECORD_FUNCTION("kvserve::quant_linear", {});  // named in torch profiler traces
  return quant::visit_kernel_type(type, [&](auto block) {
    using Block = decltype(block);
    constexpr int64_t kStoredRows = quant::rows_per_stored_row<Block>();
    const int64_t k = quant::columns_of<Block>(blocks), rows = x.size(0), n = blocks.size(0) * kStoredRows;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, ", k, "]");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    TORCH_CHECK(!gated || n % 2 == 0, "a gated W = [gate; up] has an even number of rows, got ", n);
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    const int64_t row_bytes = blocks.size(1);
    // Where a form returns the product, silu_mul follows it if gated.
    const auto gate = [gated](const at::Tensor& y) { return gated ? silu_mul(y) : y; };
#if defined(__AVX512BF16__)
    const bool on_tiles = !amx_permitted() && tiles_fma::choice.panels.load();
    if (x.scalar_type() == at::kBFloat16 && rows > kLongChunkRows && (amx_permitted() || on_tiles)) {
      if (on_tiles && tiles_fma::choice.long_chunks.load() && n % 32 == 0 && k % 32 == 0)
        return linear_tiles_fma(x, dequantized_tiles<Block>(w, row_bytes, n, k, gated), gated);
      return gate(at::linear(x, dequantized_bf16<Block>(w, row_bytes, n, k)));
    }
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (x.scalar_type() == at::kBFloat16 && amx_permitted()) {
      using amx_product::kCols;
      const bool fused = gated && (n / 2) % kCols == 0;  // each half whole tiles
      const auto pack = [=](int64_t n0, int64_t count, uint16_t* tiles, uint16_t* rows_scratch) {
        if (count > 0)
          quant::pack_rows_into_tiles<Block>(w, row_bytes, n0, count, k, tiles, rows_scratch);
        else
          std::memset(tiles, 0, k * kCols * sizeof(uint16_t));
      };
      // A pair's tiles: weight rows 32p .. 32p+31 (those up to n), or gated 16 gate rows and their up rows.
      const at::Tensor y = amx_product::linear(x.contiguous(), n, fused, [=](int64_t pair, uint16_t* scratch) {
        uint16_t* second = scratch + k * kCols;
        uint16_t* rows_scratch = second + k * kCols;
        const int64_t n0 = fused ? pair * kCols : 2 * pair * kCols, n1 = fused ? n / 2 + n0 : n0 + kCols;
        pack(n0, std::clamp<int64_t>(n - n0, 0, kCols), scratch, rows_scratch);
        pack(n1, std::clamp<int64_t>(n - n1, 0, kCols), second, rows_scratch);
        return static_cast<const uint16_t*>(scratch);
      });
      return fused || !gated ? y : silu_mul(y);
    }
#endif
#if defined(__AVX512F__)
    if (x.scalar_type() == at::kBFloat16 && !amx_permitted() && tiles_fma::choice.panels.load()) {
      const bool fused = gated && (n / 2) % kStoredRows == 0;  // each half whole row groups
      const at::Tensor y = packed_x_times_panels<Block>(x, w, row_bytes, n, k, fused);
      return fused ? y : gate(y);
    }
#endif
    if constexpr (bf16_panel::kAvailable) {
      if (x.scalar_type() == at::kBFloat16) {
        // Native bf16 products: the weights meet x rounded to bf16, as the dense bf16 engine's do.
        const at::Tensor xc = x.contiguous();
        auto y = at::empty({rows, n}, x.options());
        if (rows == 0) return gate(y);
        bf16_panel::linear(
            raw<c10::BFloat16>(xc), rows, k, n,
            [=](int64_t n0, int64_t w_rows, uint16_t* panel) {
              quant::dequantize_rows_into<Block>(w, row_bytes, n0, w_rows, k, panel);
            },
            raw<c10::BFloat16>(y));
        return gate(y);
      }
    }
    auto y = at::empty({rows, n}, x.options());
    if (rows == 0) return gate(y);
    const at::Tensor xc = x.contiguous();
    const at::Tensor packed = at::empty({(rows + kLanes - 1) / kLanes * kLanes * k}, x.options().dtype(at::kFloat));
    float* xp = packed.data_ptr<float>();
    const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
    KVSERVE_DISPATCH(x.scalar_type(), [&] {
      pack_x_columns(raw<scalar_t>(xc), rows, k, xp);
      raw_t<scalar_t>* ys = raw<scalar_t>(y);
      parallel_claims(0, panels, [=](int64_t begin, int64_t end) {
        float* tile = thread_scratch<float>(kPanelRows * k);
        for (int64_t panel = begin; panel < end; ++panel) {
          const int64_t n0 = panel * kPanelRows, w_rows = std::min(kPanelRows, n - n0);
          quant::dequantize_rows_into<Block>(w, row_bytes, n0, w_rows, k, tile);
          const int64_t whole = (w_rows + kWRows - 1) / kWRows * kWRows;
          std::fill(tile + w_rows * k, tile + whole * k, 0.f);
          packed_x_times_tile(xp, rows, tile, w_rows, k, ys + n0, n);
        }
      });
    });
    return gate(y);
  });
}

// Where the int8 GEMV's cost, which grows with each row, passes the panel product's, which is mostly the
// fixed cost of dequantizing W: on row groups (eight rows' scales and sums per vector) far later than on
// GGML's layout (a horizontal sum and scalar scales per weight row and row of x). Measured on Zen 4
// (benchmarks/RESULTS.md, "int8 decode batches"): row groups cross at 64-128 rows, GGML's at 8-16; whole
// decode steps of 100 rows ran 15-20 % faster on the GEMV (RESULTS.md, "Decode attention on
// AVX512-BF16"), hence 128 without AMX. With AMX, whose tiles make the panel product's own products
// cheap and whose panels are packed straight from the row groups, the two cross at about 16 rows, and
// decode steps of 32-64 rows ran 1.3-1.5x faster on the panels (RESULTS.md, "Quantized panels packed
// into AMX tiles"), hence 16; Q6_K's groups, whose GEMV unpacks six bits per value from two places (twice a
// 4-bit type's work per row chunk), at about 8 (RESULTS.md, "Q6_K row groups").
int64_t int8_max_rows(int64_t type) {
  return quant::visit_kernel_type(type, [](auto block) -> int64_t {
    using Block = decltype(block);
    if constexpr (quant::rows_per_stored_row<Block>() == 1)
      return 8;
    else if (!amx_permitted())
      return 128;
    else
      return std::is_same_v<Block, quant::RowGroup<quant::Q6_K>> ? 8 : 16;
  });
}

at::Tensor quant_product(at::Tensor x, at::Tensor blocks, int64_t type, bool decode_step, bool gated) {
  // Where quant_gemv does not build (no AVX2), no weights stay in blocks: quantized_linear.py probes it.
  const int64_t rows = x.size(0), most = decode_step ? int8_max_rows(type) : kGemvMaxRows;
  if (rows >= 1 && rows <= most) return quant_gemv(x, blocks, type, gated);
  return quant_linear(x, blocks, type, gated);
}

}  // namespace kvserve
