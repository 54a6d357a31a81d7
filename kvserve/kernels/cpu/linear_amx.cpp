// y = x @ W^T for bf16 activations of a few dozen to a few hundred rows on Intel AMX tiles: the
// batched decode step's projections and LM head.
//
// Why not oneDNN here: at 100 rows its packed kernel took far longer than the weight stream alone, and
// the tiles need far less; the weight stream and the products did not overlap
// (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
// Here each thread walks its own contiguous run of the packed weight once, front to back (the hardware
// prefetcher's best case), and reuses each 32-column panel for every row block
// while it sits in L1/L2. (Software prefetch of the next panel during the current one changed nothing
// measurable.)
//
// Layout: the weight is packed once at load (kvserve/model/linear.py) into B tiles,
// packed[n_block][k_step] = 16 key-pairs x 16 columns x 2, i.e. element (n, k) of the 16 x 32 slice at
// [(k / 2) * 32 + n * 2 + k % 2]: the VNNI layout TDPBF16PS reads. Rows of x are A tiles as they lie
// (16 rows x 32 bf16, the row stride K). Register blocking: 2 row tiles x 2 column tiles -> 4 float32
// result tiles, so each loaded tile feeds two products.
//
// Gated (the MLP's up projection, `gated` true): the weight is [gate; up] with its rows interleaved in
// 16s before packing (gate 0-15, up 0-15, gate 16-31, ...: kvserve/model/linear.py), so each 32-column
// block holds 16 gate columns and their 16 up columns, and the epilogue stores silu(gate) * up from the
// float32 results: y is [M, N/2], one rounding to bf16, no separate silu_mul pass over a [M, N] product.
#include "amx.h"
#include "ops.h"

namespace kvserve {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t kRows = 16, kCols = 16, kDepth = 32;  // one tile product: [16 x 32] . [32 x 16]
constexpr int64_t kTileElems = kDepth * kCols;          // bf16 elements in one packed B tile

#define TILE_A0 0
#define TILE_A1 1
#define TILE_B0 2
#define TILE_B1 3
#define TILE_C00 4  // rows 0-15 x columns 0-15 of the 32 x 32 block
#define TILE_C01 5
#define TILE_C10 6
#define TILE_C11 7

// One 32 x 32 block of the product (16 x 32 with one row tile): the rows of x from `a0` on (16 x
// kRowTiles of them, readable; stride k) times column blocks 2 * pair and 2 * pair + 1 of the packed
// weight, stored as y's rows m0 .. m0 + valid_rows - 1 (y has n columns; gated: n / 2, see above).
template <int kRowTiles>
void block_product(const uint16_t* a0, const uint16_t* packed, int64_t k_steps, int64_t k, int64_t m0,
                   int64_t valid_rows, int64_t pair, int64_t n, bool gated, uint16_t* y) {
  static_assert(kRowTiles == 1 || kRowTiles == 2);
  const uint16_t* a1 = a0 + kRows * k;
  const uint16_t* b0 = packed + 2 * pair * k_steps * kTileElems;
  const uint16_t* b1 = b0 + k_steps * kTileElems;
  _tile_zero(TILE_C00);
  _tile_zero(TILE_C01);
  if constexpr (kRowTiles == 2) {
    _tile_zero(TILE_C10);
    _tile_zero(TILE_C11);
  }
  for (int64_t s = 0; s < k_steps; ++s) {
    _tile_loadd(TILE_A0, a0 + s * kDepth, k * 2);
    _tile_loadd(TILE_B0, b0 + s * kTileElems, kCols * 4);
    _tile_loadd(TILE_B1, b1 + s * kTileElems, kCols * 4);
    _tile_dpbf16ps(TILE_C00, TILE_A0, TILE_B0);
    _tile_dpbf16ps(TILE_C01, TILE_A0, TILE_B1);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(TILE_A1, a1 + s * kDepth, k * 2);
      _tile_dpbf16ps(TILE_C10, TILE_A1, TILE_B0);
      _tile_dpbf16ps(TILE_C11, TILE_A1, TILE_B1);
    }
  }
  alignas(64) float c[2 * kRows][2 * kCols];
  _tile_stored(TILE_C00, &c[0][0], sizeof(c[0]));
  _tile_stored(TILE_C01, &c[0][kCols], sizeof(c[0]));
  if constexpr (kRowTiles == 2) {
    _tile_stored(TILE_C10, &c[kRows][0], sizeof(c[0]));
    _tile_stored(TILE_C11, &c[kRows][kCols], sizeof(c[0]));
  }
  const auto store = [](uint16_t* dst, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
  };
  for (int64_t r = 0; r < valid_rows; ++r) {
    const __m512 left = _mm512_load_ps(&c[r][0]), right = _mm512_load_ps(&c[r][kCols]);
    if (gated) {  // left: 16 gate columns, right: their up columns
      store(y + (m0 + r) * (n / 2) + pair * kCols, silu_times(left, right));
    } else {
      store(y + (m0 + r) * n + pair * 2 * kCols, left);
      store(y + (m0 + r) * n + pair * 2 * kCols + kCols, right);
    }
  }
}

}  // namespace

at::Tensor linear_amx(at::Tensor x, at::Tensor packed, bool gated) {
  RECORD_FUNCTION("kvserve::linear_amx", {});  // named in torch profiler traces
  TORCH_CHECK(amx_permitted(), "linear_amx needs AMX-BF16 (amx_available() is false here)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "x and packed must be bf16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) % 2 == 0 && packed.size(2) == kTileElems,
              "packed must be [N/16 (even), K/32, 512] (pack_tiles' layout)");
  const int64_t rows = x.size(0), k = x.size(1), k_steps = packed.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(k == k_steps * kDepth, "x has ", k, " columns, the packed weight ", k_steps * kDepth);
  auto y = at::empty({rows, gated ? n / 2 : n}, x.options());
  if (rows == 0) return y;
  const uint16_t* x_data = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Whole 32-row blocks are read from x as it lies. Tile loads read 16 whole rows, so the last rows
  // (fewer than 32) are copied into a zero-padded block of one or two tiles: padding all of x would
  // copy every row of every product.
  const int64_t full_blocks = rows / (2 * kRows), tail_rows = rows % (2 * kRows);
  const int64_t tail_tiles = (tail_rows + kRows - 1) / kRows;
  at::Tensor tail;
  if (tail_rows > 0) {
    tail = at::zeros({tail_tiles * kRows, k}, x.options());
    tail.narrow(0, 0, tail_rows).copy_(x.narrow(0, full_blocks * 2 * kRows, tail_rows));
  }
  const uint16_t* tail_data =
      tail_rows > 0 ? reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, n / (2 * kCols), 1, [=](int64_t begin, int64_t end) {
    const TileConfig config = tile_config();
    _tile_loadconfig(&config);
    for (int64_t pair = begin; pair < end; ++pair) {
      for (int64_t block = 0; block < full_blocks; ++block) {
        const int64_t m0 = block * 2 * kRows;
        block_product<2>(x_data + m0 * k, w, k_steps, k, m0, 2 * kRows, pair, n, gated, out);
      }
      const int64_t m0 = full_blocks * 2 * kRows;
      if (tail_tiles == 2) block_product<2>(tail_data, w, k_steps, k, m0, tail_rows, pair, n, gated, out);
      if (tail_tiles == 1) block_product<1>(tail_data, w, k_steps, k, m0, tail_rows, pair, n, gated, out);
    }
    _tile_release();
  });
  return y;
}
#else
at::Tensor linear_amx(at::Tensor, at::Tensor, bool) { TORCH_CHECK(false, "this build has no AMX kernels"); }
#endif

}  // namespace kvserve
