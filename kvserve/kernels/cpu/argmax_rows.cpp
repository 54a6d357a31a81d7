// Row-wise argmax of float32 or bf16 logits: the greedy sampler's whole work each step.
//
// torch.max(dim=-1) reads bf16 logits far below memory speed, and only after a widening copy to float32;
// this reads the bf16 rows as they are, at memory speed
// (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
// Same answer as torch.max(dim=-1).indices: the first maximal index, and a NaN counts as the maximum
// (the first NaN wins).
#include "common.h"
#include "ops.h"

namespace kvserve {
namespace {

template <typename T>
int64_t first_nan_or_max(const T* x, int64_t from, int64_t n, float best, int64_t best_index) {
  for (int64_t j = from; j < n; ++j) {
    const float v = to_float(x[j]);
    if (v != v) return j;
    if (v > best) {
      best = v;
      best_index = j;
    }
  }
  return best_index;
}

#ifdef __AVX512F__
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
#endif

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#ifdef __AVX512F__
  // Per lane: the largest value so far and where it first occurred (strictly greater replaces).
  __m512 lane_max = _mm512_set1_ps(-INFINITY);
  __m512i lane_index = _mm512_setzero_si512(),
          index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) return i + __builtin_ctz(nan);  // the rows before had none
    const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
    lane_max = _mm512_mask_mov_ps(lane_max, greater, v);
    lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
    index = _mm512_add_epi32(index, step);
  }
  // The maximum over lanes; of the lanes that hold it, the earliest index.
  const float best = _mm512_reduce_max_ps(lane_max);
  const __mmask16 holders = _mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(best), _CMP_EQ_OQ);
  const int64_t best_index = _mm512_mask_reduce_min_epi32(holders, lane_index);
  return first_nan_or_max(x, i, n, best, best_index);
#else
  const float first = to_float(x[0]);
  return first != first ? 0 : first_nan_or_max(x, 1, n, first, 0);
#endif
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  RECORD_FUNCTION("kvserve::argmax_rows", {});  // named in torch profiler traces
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab > 0] with a contiguous last dim");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "vocab too large for 32-bit lane indices");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  KVSERVE_DISPATCH(logits.scalar_type(), [&] {
    const auto* x = raw<scalar_t>(logits);
    at::parallel_for(0, rows, 1, [=](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(x + r * stride, vocab);
    });
  });
  return out;
}

}  // namespace kvserve
