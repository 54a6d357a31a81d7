// y = x @ W^T for a few rows of x, both bfloat16, W [N, K] row-major as the checkpoint stores it.
//
// At a handful of rows a linear layer is a stream over its weight (each element is used once per
// row), so its speed limit is memory bandwidth. oneDNN's packed bf16 kernels read the weights at
// ~15-20 GB/s at one row on this machine; this kernel at 22-25 GB/s. This loop reads each weight row once for all rows of x and
// multiplies with AVX512-BF16's pairwise dot product: bf16 x bf16 products are exact in float32
// and are summed in float32; each result is rounded to bf16 once, as oneDNN's is.
#include "common.h"
#include "ops.h"

namespace kvserve {

#ifdef __AVX512BF16__
// Weight rows handled together: R independent accumulator chains per row of x hide the dot
// product's latency, and one load of x serves R weight rows.
constexpr int64_t kWeightRows = 4;
// Software prefetch into L2 of the weight rows kPrefetchSteps groups ahead. The hardware prefetcher
// alone keeps too few lines in flight: streaming all 30 layers' weights at one row took 14.0 ms
// without it and 10.5-12 ms with it (distances 2-8 groups and L1/L2 hints measured the same
// within this machine's noise).
constexpr int64_t kPrefetchSteps = 4;
constexpr int64_t kPairsPerVector = 32;  // bf16 values in one 512-bit register

// Rows n .. n+R-1 of y for all M rows of x.
template <int M, int R>
inline void gemv_rows(const uint16_t* __restrict x, const uint16_t* __restrict w, uint16_t* __restrict y,
                      int64_t n, int64_t n_end, int64_t n_total, int64_t k) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* rows = w + n * k;
  const bool prefetch = n + (kPrefetchSteps + 1) * R <= n_end;  // never past this thread's rows
  for (int64_t i = 0; i < k; i += kPairsPerVector) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(rows + (r + kPrefetchSteps * R) * k + i), _MM_HINT_T1);
      wv[r] = (__m512bh)_mm512_loadu_si512(rows + r * k + i);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + i);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_total + n + r] = from_float<uint16_t>(_mm512_reduce_add_ps(acc[m][r]));
}

template <int M>
void gemv_kernel(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t n_total, int64_t k) {
  // A grain of 64 rows still splits the smallest projection (576 rows) across both cores.
  at::parallel_for(0, n_total, 64, [=](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + kWeightRows <= end; n += kWeightRows) gemv_rows<M, kWeightRows>(x, w, y, n, end, n_total, k);
    for (; n < end; ++n) gemv_rows<M, 1>(x, w, y, n, end, n_total, k);
  });
}
#endif

at::Tensor gemv_bf16(at::Tensor x, at::Tensor weight) {
  RECORD_FUNCTION("kvserve::gemv_bf16", {});  // named in torch profiler traces
#ifdef __AVX512BF16__
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x and weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.is_contiguous() && x.size(1) == weight.size(1),
              "x must be [M, K] and weight a contiguous [N, K]");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % kPairsPerVector == 0, "K must be a multiple of ", kPairsPerVector);
  TORCH_CHECK(m >= 1 && m <= kGemvMaxRows, "gemv_bf16 takes 1 to ", kGemvMaxRows, " rows, got ", m);
  x = x.contiguous();
  auto y = at::empty({m, n}, x.options());
  const auto *xs = raw<c10::BFloat16>(x), *ws = raw<c10::BFloat16>(weight);
  auto* ys = raw<c10::BFloat16>(y);
  switch (m) {
    case 1: gemv_kernel<1>(xs, ws, ys, n, k); break;
    case 2: gemv_kernel<2>(xs, ws, ys, n, k); break;
    default: gemv_kernel<2>(xs, ws, ys, n, k); break;
  }
  return y;
#else
  TORCH_CHECK(false, "gemv_bf16 needs a CPU with AVX512-BF16");
#endif
}

}  // namespace kvserve
