// quant_linear for bf16 activations on paths with native bf16 products (quant_linear_bf16.h).
//
// Each thread takes panels of kPanelRows weight rows: the caller's function dequantizes a panel straight
// into bf16 (each float32 value rounded to nearest even, as torch's conversion; no float32 tile is
// written), then every row of x meets it on VDPBF16PS (AVX512-BF16 without AMX, or where the OS refuses
// the tile state; with AMX quant_linear packs its panels into tiles instead) in quant_linear.cpp's
// dot-product form, 32 products per instruction: kXRows x kWRows float32 accumulators of 16 lanes,
// summed across lanes at the end (16 accumulators + 4 x + 1 weight vector of AVX-512's 32 registers).
#include "quant_linear_bf16.h"
#include "work_claims.h"

namespace kvserve::bf16_panel {

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kDepth = 32;  // bf16 columns per VDPBF16PS

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

}  // namespace

void linear(const uint16_t* x, int64_t m, int64_t k, int64_t n, const DequantizeRows& dequantize, uint16_t* y) {
  TORCH_CHECK(k % kDepth == 0, "bf16 panel product: k must be a multiple of ", kDepth, ", got ", k);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  parallel_claims(0, panels, [=, &dequantize](int64_t begin, int64_t end) {
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
