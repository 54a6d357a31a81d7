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

// Where row tile `first_row`'s results go: the tile's rows are x's rows first_row .. first_row + rows - 1,
// of which the first `skip` were stored by the tile before it.
struct RowTile {
  int64_t first_row, skip, rows;
};

// Row tile i of x's `rows` rows. Every tile reads x's own rows, so no zero-padded copy of a partial
// tile is made (it cost about as much per call as the product of a small weight itself:
// benchmarks/RESULTS.md, "Figures behind the code's rules"):
// - under 32 rows (one block: decode batches and the steps that verify their drafts), the last tile
//   is configured as tall as the rows it has (tile_config_for_rows), so its products take only those rows;
// - from 32 rows on, tiles lie 16 rows apart, except that the last one, when rows is no multiple of
//   16, ends at x's last row and overlaps the one before (the tiles of every block keep one shape).
RowTile row_tile(int64_t i, int64_t rows) {
  if (rows < 2 * kRows) return {i * kRows, 0, std::min(kRows, rows - i * kRows)};
  const int64_t first = std::min(i * kRows, rows - kRows);
  return {first, i * kRows - first, kRows};
}

// The tile configuration for x's `rows` rows: under 32, the last tile's operand and result tiles are
// configured to its rows.
TileConfig tile_config_for_rows(int64_t rows) {
  TileConfig config = tile_config();
  const int64_t last_rows = rows % kRows;
  if (rows < 2 * kRows && last_rows > 0) {
    const bool first = rows < kRows;  // the one tile, or the second of the block
    for (const int t : {first ? TILE_A0 : TILE_A1, first ? TILE_C00 : TILE_C10, first ? TILE_C01 : TILE_C11})
      config.rows[t] = static_cast<uint8_t>(last_rows);
  }
  return config;
}

// One 32 x 32 block of the product (16 x 32 with one row tile): row tiles t0 (and t1) of x times the
// pair's tiles b0 and b1 (k_steps tiles each), the rows of each tile that are its own stored in y.
template <int kRowTiles>
void block_product(const uint16_t* x, const RowTile& t0, const RowTile& t1, const uint16_t* b0, const uint16_t* b1,
                   int64_t k_steps, int64_t k, const Output& out) {
  static_assert(kRowTiles == 1 || kRowTiles == 2);
  const uint16_t* a0 = x + t0.first_row * k;
  const uint16_t* a1 = x + t1.first_row * k;
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
  for (int tile = 0; tile < kRowTiles; ++tile) {
    const RowTile& t = tile == 0 ? t0 : t1;
    for (int64_t r = t.skip; r < t.rows; ++r) {
      const float* result = c[tile * kRows + r];
      const __m512 left = _mm512_load_ps(result), right = _mm512_load_ps(result + kCols);
      uint16_t* row = out.y + (t.first_row + r) * out.stride + out.column;
      if (out.gated) {  // left: 16 gate columns, right: their up columns
        store(row, silu_times(left, right), kCols);
      } else {
        store(row, left, out.valid_columns);
        if (out.valid_columns > kCols) store(row + kCols, right, out.valid_columns - kCols);
      }
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
  const int64_t row_tiles = (rows + kRows - 1) / kRows;
  const int64_t pair_columns = gated ? kCols : 2 * kCols, pairs = (columns + pair_columns - 1) / pair_columns;
  parallel_claims(0, pairs, [=, &tiles](int64_t begin, int64_t end) {
    uint16_t* scratch = thread_scratch<uint16_t>(kScratchRows * k);
    const TileConfig config = tile_config_for_rows(rows);
    _tile_loadconfig(&config);
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint16_t* b0 = tiles(pair, scratch);
      const uint16_t* b1 = b0 + k_steps * kTileElems;
      const Output o{out, columns, pair * pair_columns, std::min(pair_columns, columns - pair * pair_columns), gated};
      int64_t t = 0;
      for (; t + 2 <= row_tiles; t += 2)
        block_product<2>(x_data, row_tile(t, rows), row_tile(t + 1, rows), b0, b1, k_steps, k, o);
      if (t < row_tiles) block_product<1>(x_data, row_tile(t, rows), row_tile(t, rows), b0, b1, k_steps, k, o);
    }
    _tile_release();
  });
  return y;
}
#endif

}  // namespace kvserve::amx_product
