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

// The vector loop's lanes: sixteen on AVX-512, eight on AVX2, where the scalar loop (whose early exit on NaN
// GCC does not vectorize) ran 4-7x slower on SmolLM2's and Gemma 3's vocabularies (benchmarks/RESULTS.md,
// "Greedy argmax on AVX2"). Per lane the loop keeps the largest value so far and where it first occurred.
#if defined(__AVX512F__)
#define KVSERVE_HAS_ARGMAX_LANES 1
struct ArgmaxLanes {
  static constexpr int kLanes = 16;
  using Float = __m512;
  using Int = __m512i;
  using Mask = __mmask16;
  static Float load(const float* x) { return _mm512_loadu_ps(x); }
  static Float load(const uint16_t* x) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
  }
  static uint32_t nan_lanes(Float v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }  // bit i: lane i is NaN
  static Mask greater(Float a, Float b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Float where(Mask m, Float a, Float b) { return _mm512_mask_mov_ps(b, m, a); }  // a where m, else b
  static Int where(Mask m, Int a, Int b) { return _mm512_mask_mov_epi32(b, m, a); }
  static Int first_indices() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static Int add(Int a, int32_t n) { return _mm512_add_epi32(a, _mm512_set1_epi32(n)); }
  // The smallest index of the lanes whose value is `value`.
  static int64_t first_index_of(Float values, float value, Int index) {
    return _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(values, _mm512_set1_ps(value), _CMP_EQ_OQ), index);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_HAS_ARGMAX_LANES 1
struct ArgmaxLanes {
  static constexpr int kLanes = 8;
  using Float = __m256;
  using Int = __m256i;
  using Mask = __m256;  // all ones in the lanes that hold
  static Float load(const float* x) { return _mm256_loadu_ps(x); }
  static Float load(const uint16_t* x) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
  }
  static uint32_t nan_lanes(Float v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
  static Mask greater(Float a, Float b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static Float where(Mask m, Float a, Float b) { return _mm256_blendv_ps(b, a, m); }
  static Int where(Mask m, Int a, Int b) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(a), m));
  }
  static Int first_indices() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static Int add(Int a, int32_t n) { return _mm256_add_epi32(a, _mm256_set1_epi32(n)); }
  static int64_t first_index_of(Float values, float value, Int index) {
    const __m256 holds = _mm256_cmp_ps(values, _mm256_set1_ps(value), _CMP_EQ_OQ);
    alignas(32) int32_t lanes[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), where(holds, index, _mm256_set1_epi32(INT32_MAX)));
    return *std::min_element(lanes, lanes + kLanes);
  }
};
#endif

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#ifdef KVSERVE_HAS_ARGMAX_LANES
  using L = ArgmaxLanes;
  typename L::Float lane_max = splat<typename L::Float>(-INFINITY);
  typename L::Int lane_index = L::first_indices(), index = L::first_indices();
  int64_t i = 0;
  for (; i + L::kLanes <= n; i += L::kLanes) {
    const typename L::Float v = L::load(x + i);
    if (const uint32_t nan = L::nan_lanes(v)) return i + __builtin_ctz(nan);  // the vectors before had none
    const typename L::Mask greater = L::greater(v, lane_max);                 // strictly greater replaces
    lane_max = L::where(greater, v, lane_max);
    lane_index = L::where(greater, index, lane_index);
    index = L::add(index, L::kLanes);
  }
  // The maximum over lanes; of the lanes that hold it, the earliest index.
  const float best = reduce_max(lane_max);
  return first_nan_or_max(x, i, n, best, L::first_index_of(lane_max, best, lane_index));
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
