// The AMX product shared by linear_amx and quant_linear (amx_product.h).
#include "amx_product.h"
#include "work_claims.h"

namespace kvserve::amx_product {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

#define TILE_A0 0
#define TILE_A1 1
#define TILE_B0 2
#define TILE_B1 3
#define TILE_C00 4  // rows 0-15 x columns 0-15 of the 32 x 32 block
#define TILE_C01 5
#define TILE_C10 6
#define TILE_C11 7

// Where one block of the product goes: y's row stride, the block's first column in y and how many of
// its 32 columns (gated: 16) are stored.
struct Output {
  uint16_t* y;
  int64_t stride, column, valid_columns;
  bool gated;
};

// One 32 x 32 block of the product (16 x 32 with one row tile): the rows of x from `a0` on (16 x
// kRowTiles of them, readable; stride k) times the pair's tiles b0 and b1 (k_steps tiles each), stored
// as y's rows m0 .. m0 + valid_rows - 1.
template <int kRowTiles>
void block_product(const uint16_t* a0, const uint16_t* b0, const uint16_t* b1, int64_t k_steps, int64_t k, int64_t m0,
                   int64_t valid_rows, const Output& out) {
  static_assert(kRowTiles == 1 || kRowTiles == 2);
  const uint16_t* a1 = a0 + kRows * k;
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
  const auto store = [](uint16_t* dst, __m512 v, int64_t columns) {
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((uint32_t{1} << std::min<int64_t>(columns, 16)) - 1),
                             (__m256i)_mm512_cvtneps_pbh(v));
  };
  for (int64_t r = 0; r < valid_rows; ++r) {
    const __m512 left = _mm512_load_ps(&c[r][0]), right = _mm512_load_ps(&c[r][kCols]);
    uint16_t* row = out.y + (m0 + r) * out.stride + out.column;
    if (out.gated) {  // left: 16 gate columns, right: their up columns
      store(row, silu_times(left, right), kCols);
    } else {
      store(row, left, out.valid_columns);
      if (out.valid_columns > kCols) store(row + kCols, right, out.valid_columns - kCols);
    }
  }
}

}  // namespace

at::Tensor linear(const at::Tensor& x, int64_t n, bool gated, const PairTiles& tiles) {
  const int64_t rows = x.size(0), k = x.size(1), k_steps = k / kDepth, columns = gated ? n / 2 : n;
  TORCH_CHECK(k % kDepth == 0, "AMX product: K must be a multiple of ", kDepth, ", got ", k);
  TORCH_CHECK(!gated || columns % kCols == 0, "AMX product: a gated W needs halves of whole tiles, got ", n, " rows");
  auto y = at::empty({rows, columns}, x.options());
  if (rows == 0) return y;
  const uint16_t* x_data = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
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
  const int64_t pair_columns = gated ? kCols : 2 * kCols, pairs = (columns + pair_columns - 1) / pair_columns;
  parallel_claims(0, pairs, [=, &tiles](int64_t begin, int64_t end) {
    uint16_t* scratch = thread_scratch<uint16_t>(kScratchRows * k);
    const TileConfig config = tile_config();
    _tile_loadconfig(&config);
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint16_t* b0 = tiles(pair, scratch);
      const uint16_t* b1 = b0 + k_steps * kTileElems;
      const Output o{out, columns, pair * pair_columns, std::min(pair_columns, columns - pair * pair_columns), gated};
      for (int64_t block = 0; block < full_blocks; ++block) {
        const int64_t m0 = block * 2 * kRows;
        block_product<2>(x_data + m0 * k, b0, b1, k_steps, k, m0, 2 * kRows, o);
      }
      const int64_t m0 = full_blocks * 2 * kRows;
      if (tail_tiles == 2) block_product<2>(tail_data, b0, b1, k_steps, k, m0, tail_rows, o);
      if (tail_tiles == 1) block_product<1>(tail_data, b0, b1, k_steps, k, m0, tail_rows, o);
    }
    _tile_release();
  });
  return y;
}
#endif

}  // namespace kvserve::amx_product
