// y = x @ W^T for a few rows of x, both bfloat16, W [N, K] row-major as the checkpoint stores it.
//
// At a handful of rows a linear layer is a stream over its weight (each element is used once per
// row), so its speed limit is memory bandwidth, and this kernel reads the weights faster than oneDNN's
// packed bf16 kernels at one row (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
// This loop reads each weight row once for all rows of x. bf16 x bf16 products are exact in float32
// and are summed in float32; each result is rounded to bf16 once, as oneDNN's is. Two instruction sets compute the
// products:
// - AVX512-BF16: the pairwise dot product straight from the bf16 bits (32 per register);
// - AVX2 + FMA (CPUs without AVX-512, e.g. AMD Zen 3): each weight register of 16 bf16 is widened to
//   two float32 registers (a bf16 is the upper half of a float32: interleaving it with zeros is exact)
//   and multiplied with x, widened once per call in the same interleaved order, by fused multiply-adds.
#include "common.h"
#include "ops.h"

namespace kvserve {

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#define KVSERVE_HAS_GEMV 1
// Weight rows handled together: R independent accumulator chains per row of x hide the multiply-add
// latency, and one load of x serves R weight rows.
constexpr int64_t kWeightRows = 4;
// Software prefetch into L2 of the weight rows kPrefetchSteps groups ahead. The hardware prefetcher
// alone keeps too few lines in flight; distances of 2-8 groups and L1/L2 hints measured the same
// (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
constexpr int64_t kPrefetchSteps = 4;
// bf16 values of a weight row consumed per inner step: one 64-byte cache line, prefetched once.
constexpr int64_t kStep = 32;

#ifdef __AVX512BF16__
using Acc = __m512;
using XElem = uint16_t;  // x as it lies: the dot product takes bf16 pairs
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
// acc += x[0:32] . w[0:32] (pairwise products summed into 16 lanes).
inline Acc step_product(Acc acc, const XElem* x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)w);
}
inline __m512i load_step(const uint16_t* w) { return _mm512_loadu_si512(w); }
#else
using Acc = __m256;
using XElem = float;  // x widened by widen_x, in the lane order of widen_low / widen_high
// The float32 values of the bf16 in the low (high) 64 bits of each 128-bit half of w: elements
// 0-3 and 8-11 (4-7 and 12-15) of the 16.
inline __m256 widen_low(__m256i w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w)); }
inline __m256 widen_high(__m256i w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w)); }
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc acc) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
struct StepWeights {
  __m256i first, second;  // bf16 0-15 and 16-31 of the step
};
inline StepWeights load_step(const uint16_t* w) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16))};
}
// acc += x[0:32] . w[0:32], x already widened (32 floats in widen_low/widen_high order).
inline Acc step_product(Acc acc, const XElem* x, StepWeights w) {
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x), widen_low(w.first), acc);
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), widen_high(w.first), acc);
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), widen_low(w.second), acc);
  return _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), widen_high(w.second), acc);
}
// x [M, K] bf16 as float32 in the order step_product pairs it with the weights.
at::Tensor widen_x(const at::Tensor& x) {
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const uint16_t* src = raw<c10::BFloat16>(x);
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm256_storeu_ps(dst + i, widen_low(v));
    _mm256_storeu_ps(dst + i + 8, widen_high(v));
  }
  return out;
}
#endif

// Rows n .. n+R-1 of y for all M rows of x.
template <int M, int R>
inline void gemv_rows(const XElem* __restrict x, const uint16_t* __restrict w, uint16_t* __restrict y, int64_t n,
                      int64_t n_end, int64_t n_total, int64_t k) {
  Acc acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = acc_zero();
  const uint16_t* rows = w + n * k;
  const bool prefetch = n + (kPrefetchSteps + 1) * R <= n_end;  // never past this thread's rows
  for (int64_t i = 0; i < k; i += kStep) {
    decltype(load_step(rows)) wv[R];
    for (int r = 0; r < R; ++r) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(rows + (r + kPrefetchSteps * R) * k + i), _MM_HINT_T1);
      wv[r] = load_step(rows + r * k + i);
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = step_product(acc[m][r], x + m * k + i, wv[r]);
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * n_total + n + r] = from_float<uint16_t>(acc_sum(acc[m][r]));
}

template <int M>
void gemv_kernel(const XElem* x, const uint16_t* w, uint16_t* y, int64_t n_total, int64_t k) {
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
#ifdef KVSERVE_HAS_GEMV
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.is_contiguous() && x.size(1) == weight.size(1),
              "x must be [M, K] and weight a contiguous [N, K]");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % kStep == 0, "K must be a multiple of ", kStep);
  TORCH_CHECK(m >= 1 && m <= kGemvMaxRows, "gemv_bf16 takes 1 to ", kGemvMaxRows, " rows, got ", m);
  x = x.contiguous();
  auto y = at::empty({m, n}, x.options());
#ifdef __AVX512BF16__
  const XElem* xs = raw<c10::BFloat16>(x);
#else
  const at::Tensor x_widened = widen_x(x);  // alive until the kernel has returned
  const XElem* xs = x_widened.data_ptr<float>();
#endif
  const uint16_t* ws = raw<c10::BFloat16>(weight);
  auto* ys = raw<c10::BFloat16>(y);
  switch (m) {
    case 1:
      gemv_kernel<1>(xs, ws, ys, n, k);
      break;
    default:
      gemv_kernel<2>(xs, ws, ys, n, k);
      break;
  }
  return y;
#else
  TORCH_CHECK(false, "gemv_bf16 needs a CPU with AVX512-BF16 or AVX2 and FMA");
#endif
}

}  // namespace kvserve
