// quant_linear for bf16 activations on paths with native bf16 products (quant_linear_bf16.h).
//
// Each thread takes panels of kPanelRows weight rows: the caller's function dequantizes a panel straight
// into bf16 (each float32 value rounded to nearest even, as torch's conversion; no float32 tile is
// written), then every row of x meets it:
// - AMX (TDPBF16PS): the panel's rows are A tiles as they lie (16 weight rows x 32 bf16, row stride k);
//   x is the B operand, packed once per call into the layout TDPBF16PS reads (per 16 rows of x and 32
//   columns: 16 column pairs x 16 rows x 2 bf16). A result tile is then 16 weight rows x 16 rows of x,
//   transposed as it is stored into y. The weights are the A side because the panel is new on every
//   call: packing it would cost per weight element, the transpose costs per output, and a call has
//   fewer rows of x than columns (decode batches, prefill chunks against k = 576-2,048).
//   Register blocking: 2 weight tiles x 2 x tiles -> 4 result tiles, each loaded tile feeding two products.
// - AVX512-BF16 without AMX (or where the OS refuses the tile state): VDPBF16PS in quant_linear.cpp's
//   dot-product form, 32 products per instruction: kXRows x kWRows float32 accumulators of 16 lanes,
//   summed across lanes at the end (16 accumulators + 4 x + 1 weight vector of AVX-512's 32 registers).
#include "quant_linear_bf16.h"

#include "amx.h"

namespace kvserve::bf16_panel {

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kDepth = 32;  // bf16 columns per AMX tile row, and per VDPBF16PS

constexpr int kXRows = 4, kWRows = 4;

template <int XR, int WR>
inline void dot_kernel(const uint16_t* x, const uint16_t* w, int64_t k, uint16_t* y, int64_t y_stride) {
  __m512 acc[XR][WR];
  for (int i = 0; i < XR; ++i)
    for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t e = 0; e < k; e += kDepth) {
    __m512bh xv[XR];
    for (int i = 0; i < XR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * k + e);
    for (int j = 0; j < WR; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * k + e);
      for (int i = 0; i < XR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
  for (int i = 0; i < XR; ++i)
    for (int j = 0; j < WR; ++j) y[i * y_stride + j] = from_float<uint16_t>(_mm512_reduce_add_ps(acc[i][j]));
}

template <int XR>
void rows_times_panel(const uint16_t* x, const uint16_t* panel, int64_t w_rows, int64_t k, uint16_t* y,
                      int64_t y_stride) {
  int64_t j = 0;
  for (; j + kWRows <= w_rows; j += kWRows) dot_kernel<XR, kWRows>(x, panel + j * k, k, y + j, y_stride);
  for (; j < w_rows; ++j) dot_kernel<XR, 1>(x, panel + j * k, k, y + j, y_stride);
}

void panel_times_x_dot(const uint16_t* panel, int64_t w_rows, const uint16_t* x, int64_t m, int64_t k, uint16_t* y,
                       int64_t n) {
  int64_t i = 0;
  for (; i + kXRows <= m; i += kXRows) rows_times_panel<kXRows>(x + i * k, panel, w_rows, k, y + i * n, n);
  for (; i < m; ++i) rows_times_panel<1>(x + i * k, panel, w_rows, k, y + i * n, n);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kTileRows = 16;
constexpr int64_t kPackedTile = kTileRows * kDepth;  // bf16 elements of one packed B tile

#define TILE_W0 0   // weight rows 0-15 of the panel
#define TILE_W1 1   // weight rows 16-31
#define TILE_X0 2   // rows 0-15 of x's 32-row block
#define TILE_X1 3   // rows 16-31
#define TILE_C00 4  // weight rows 0-15 x x rows 0-15
#define TILE_C01 5
#define TILE_C10 6
#define TILE_C11 7

// x [m, k] as B tiles: tile (block b, step s) at packed + (b * k_steps + s) * kPackedTile holds rows
// 16b .. 16b+15 of x and columns 32s .. 32s+31, element (row r, column c) at (c / 2) * 32 + r * 2 + c % 2
// (rows past m zero). One 32-bit word per (column pair, row), so packing is a 16 x 16 word transpose.
std::vector<uint32_t> pack_x(const uint16_t* x, int64_t m, int64_t k) {
  const int64_t k_steps = k / kDepth, blocks = (m + kTileRows - 1) / kTileRows;
  std::vector<uint32_t> packed(blocks * k_steps * kPackedTile / 2, 0);
  uint32_t* out = packed.data();
  at::parallel_for(0, blocks, 1, [=](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < std::min(kTileRows, m - b * kTileRows); ++r) {
        const uint16_t* row = x + (b * kTileRows + r) * k;
        for (int64_t s = 0; s < k_steps; ++s) {
          uint32_t* tile = out + (b * k_steps + s) * kPackedTile / 2;
          for (int64_t pair = 0; pair < kDepth / 2; ++pair)
            std::memcpy(tile + pair * kTileRows + r, row + s * kDepth + 2 * pair, sizeof(uint32_t));
        }
      }
  });
  return packed;
}

// The panel (32 weight rows, w_rows of them stored) times x's row blocks x_block and, with kXTiles == 2,
// x_block + 1, into y's columns n0 .. n0 + w_rows - 1.
template <int kXTiles>
void panel_times_block(const uint16_t* panel, int64_t w_rows, const uint32_t* packed_x, int64_t x_block, int64_t m,
                       int64_t k, uint16_t* y, int64_t n, int64_t n0) {
  const int64_t k_steps = k / kDepth;
  const uint32_t* x0 = packed_x + x_block * k_steps * kPackedTile / 2;
  const uint32_t* x1 = x0 + k_steps * kPackedTile / 2;
  _tile_zero(TILE_C00);
  _tile_zero(TILE_C10);
  if constexpr (kXTiles == 2) {
    _tile_zero(TILE_C01);
    _tile_zero(TILE_C11);
  }
  for (int64_t s = 0; s < k_steps; ++s) {
    _tile_loadd(TILE_W0, panel + s * kDepth, k * 2);
    _tile_loadd(TILE_W1, panel + kTileRows * k + s * kDepth, k * 2);
    _tile_loadd(TILE_X0, x0 + s * kPackedTile / 2, kTileRows * 4);
    _tile_dpbf16ps(TILE_C00, TILE_W0, TILE_X0);
    _tile_dpbf16ps(TILE_C10, TILE_W1, TILE_X0);
    if constexpr (kXTiles == 2) {
      _tile_loadd(TILE_X1, x1 + s * kPackedTile / 2, kTileRows * 4);
      _tile_dpbf16ps(TILE_C01, TILE_W0, TILE_X1);
      _tile_dpbf16ps(TILE_C11, TILE_W1, TILE_X1);
    }
  }
  alignas(64) float c[2 * kTileRows][2 * kTileRows];  // [weight row][row of x within the block]
  _tile_stored(TILE_C00, &c[0][0], sizeof(c[0]));
  _tile_stored(TILE_C10, &c[kTileRows][0], sizeof(c[0]));
  if constexpr (kXTiles == 2) {
    _tile_stored(TILE_C01, &c[0][kTileRows], sizeof(c[0]));
    _tile_stored(TILE_C11, &c[kTileRows][kTileRows], sizeof(c[0]));
  }
  // Column r of c is row r of the block's y: gathered 16 weight rows at a time, rounded, stored.
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(2 * kTileRows));
  const __mmask32 stored = w_rows >= 32 ? ~__mmask32{0} : (__mmask32{1} << w_rows) - 1;
  const int64_t rows = std::min(kXTiles * kTileRows, m - x_block * kTileRows);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 low = _mm512_i32gather_ps(column, &c[0][r], 4);
    const __m512 high = _mm512_i32gather_ps(column, &c[kTileRows][r], 4);
    _mm512_mask_storeu_epi16(y + (x_block * kTileRows + r) * n + n0, stored, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

void panel_times_x_amx(const uint16_t* panel, int64_t w_rows, const uint32_t* packed_x, int64_t m, int64_t k,
                       uint16_t* y, int64_t n, int64_t n0) {
  const int64_t blocks = (m + kTileRows - 1) / kTileRows;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) panel_times_block<2>(panel, w_rows, packed_x, b, m, k, y, n, n0);
  if (b < blocks) panel_times_block<1>(panel, w_rows, packed_x, b, m, k, y, n, n0);
}
#endif

}  // namespace

void linear(const uint16_t* x, int64_t m, int64_t k, int64_t n, const DequantizeRows& dequantize, uint16_t* y) {
  TORCH_CHECK(k % kDepth == 0, "bf16 panel product: k must be a multiple of ", kDepth, ", got ", k);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_permitted()) {
    const std::vector<uint32_t> packed = pack_x(x, m, k);
    const uint32_t* packed_x = packed.data();
    at::parallel_for(0, panels, 1, [=, &dequantize](int64_t begin, int64_t end) {
      uint16_t* panel = thread_scratch<uint16_t>(kPanelRows * k);  // rows past a last panel's w_rows: never stored
      const TileConfig config = tile_config();
      _tile_loadconfig(&config);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanelRows, w_rows = std::min(kPanelRows, n - n0);
        dequantize(n0, w_rows, panel);
        panel_times_x_amx(panel, w_rows, packed_x, m, k, y, n, n0);
      }
      _tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, panels, 1, [=, &dequantize](int64_t begin, int64_t end) {
    uint16_t* panel = thread_scratch<uint16_t>(kPanelRows * k);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, w_rows = std::min(kPanelRows, n - n0);
      dequantize(n0, w_rows, panel);
      panel_times_x_dot(panel, w_rows, x, m, k, y + n0, n);
    }
  });
}
#endif

}  // namespace kvserve::bf16_panel
