// Shared by kvserve's CPU kernels: dtype dispatch, raw bf16 handling, float conversions, denormal
// flushing and a vectorizable exp.
//
// The kernels (one .cpp file each, declared in ops.h) each replace a chain of small torch ops whose per-call
// overhead, not arithmetic, dominated a decode step (see kvserve/kernels/cpu/__init__.py for the
// torch reference each one must match, and tests/test_cpu_ops.py for the comparison).
//
// Parallel loops capture by value: a by-reference capture is reloaded through the closure on every
// iteration (the stores might alias it), which stops GCC from vectorizing the loop.
//
// Conventions: activations are float32 or bfloat16 (the model dtype, `scalar_t`); all arithmetic is
// float32 and each result is rounded once. Compiled with -ffp-contract=off so that a*b+c is not fused
// into an FMA: in float32 the kernels then round like the torch ops they replace.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// The model dtypes: float32 and bfloat16 (anything else is refused with an error naming the dtype).
#define KVSERVE_DISPATCH(dtype, ...)           \
  AT_DISPATCH_SWITCH(dtype, "kvserve_cpu_ops", \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace kvserve {

// bfloat16 data is handled as its raw uint16_t bits: GCC does not vectorize loads of the c10::BFloat16
// class, and the conversions below are a shift and a rounding add. raw_t<scalar_t> is the element
// type the kernels see; raw<scalar_t>(tensor) the pointer.
template <typename T>
struct RawType {
  using type = T;
};
template <>
struct RawType<c10::BFloat16> {
  using type = uint16_t;
};
template <typename T>
using raw_t = typename RawType<T>::type;
template <typename scalar_t>
raw_t<scalar_t>* raw(const at::Tensor& t) {
  return reinterpret_cast<raw_t<scalar_t>*>(t.data_ptr<scalar_t>());
}

// This thread's scratch buffer of Ts (one per type), at least `size` of them, kept for its next call: a
// quantized product's panel tile is 72-192 KiB, which malloc would map, fault in and unmap on every call.
// It starts on a cache line (64 bytes), so 64-byte vector stores into rows of whole lines never split.
template <typename T>
T* thread_scratch(int64_t size) {
  constexpr int64_t kLine = 64;
  thread_local std::vector<T> scratch;
  const int64_t padded = size + kLine / static_cast<int64_t>(sizeof(T));
  if (static_cast<int64_t>(scratch.size()) < padded) scratch.resize(padded);
  const auto address = reinterpret_cast<std::uintptr_t>(scratch.data());
  return reinterpret_cast<T*>((address + kLine - 1) / kLine * kLine);
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16_bits) { return std::bit_cast<float>(static_cast<uint32_t>(bf16_bits) << 16); }

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
// Round to nearest even, as c10::BFloat16(float) does; NaN stays a quiet NaN.
template <>
inline uint16_t from_float<uint16_t>(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// Flush-to-zero and denormals-are-zero for the current thread while a kernel runs, restored after:
// denormal handling costs microcode assists on the masked vector paths, several times the kernel's
// time (figures: benchmarks/RESULTS.md, "Figures behind the code's rules"). Values below 1e-38 do not
// matter to any result here.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
};

// Lane-wise float operations on one float (scalar), eight (AVX2) or sixteen (AVX-512) at a time, so
// that a vector routine is written once for every width: fast_exp and softmax_tile (decode_attention.h).
// +, - and * are GCC's own vector operators (one instruction each; -ffp-contract=off keeps them unfused).
// The scalar forms use ternaries, not std::min/fmin, which block GCC from vectorizing loops over them.
template <typename V>
inline V splat(float v);
template <>
inline float splat<float>(float v) {
  return v;
}
inline float lanes_load(const float* p, float) { return *p; }
inline void lanes_store(float* p, float v) { *p = v; }
inline float lanes_fma(float a, float b, float c) { return std::fma(a, b, c); }  // a * b + c, rounded once
inline float lanes_min(float a, float b) { return a < b ? a : b; }
inline float lanes_max(float a, float b) { return a > b ? a : b; }
inline float lanes_floor(float x) { return std::floor(x); }
inline float lanes_pow2(float n) { return std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23); }  // n integral
inline float lanes_first(int64_t n, float v, float otherwise) { return n > 0 ? v : otherwise; }  // lane 0 if n > 0
inline float reduce_max(float v) { return v; }
inline float reduce_add(float v) { return v; }

#if defined(__AVX2__) && defined(__FMA__)
template <>
inline __m256 splat<__m256>(float v) {
  return _mm256_set1_ps(v);
}
inline __m256 lanes_load(const float* p, __m256) { return _mm256_loadu_ps(p); }
inline void lanes_store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Into bf16 bits: each lane rounded as from_float<uint16_t> rounds one (nearest even, NaN kept quiet).
inline void lanes_store(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline __m256 lanes_fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 lanes_min(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
inline __m256 lanes_max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
inline __m256 lanes_floor(__m256 x) { return _mm256_floor_ps(x); }
inline __m256 lanes_pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// v in the lanes below n (n clamped to 0..8), `otherwise` in the rest.
inline __m256 lanes_first(int64_t n, __m256 v, __m256 otherwise) {
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_blendv_ps(otherwise, v, _mm256_castsi256_ps(below));
}
inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef __AVX512F__
template <>
inline __m512 splat<__m512>(float v) {
  return _mm512_set1_ps(v);
}
inline __m512 lanes_load(const float* p, __m512) { return _mm512_loadu_ps(p); }
inline void lanes_store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Into bf16 bits, each half as the 256-bit form rounds it.
inline void lanes_store(uint16_t* p, __m512 v) {
  lanes_store(p, _mm512_castps512_ps256(v));
  lanes_store(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline __m512 lanes_fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 lanes_min(__m512 a, __m512 b) { return _mm512_min_ps(a, b); }
inline __m512 lanes_max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline __m512 lanes_floor(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline __m512 lanes_pow2(__m512 n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// The lanes below n set (n clamped to 0..16).
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u; }
inline __m512 lanes_first(int64_t n, __m512 v, __m512 otherwise) {
  return _mm512_mask_mov_ps(otherwise, first_lanes(n), v);
}
inline float reduce_max(__m512 v) { return _mm512_reduce_max_ps(v); }
inline float reduce_add(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// The widest lanes this build has: what the vector routines use.
#if defined(__AVX512F__)
using WideLanes = __m512;
#elif defined(__AVX2__) && defined(__FMA__)
using WideLanes = __m256;
#else
using WideLanes = float;
#endif

// exp(x) by Cephes' range reduction and degree-6 polynomial (relative error ~2e-7), branch-free, on
// every lane; the same operations in the same order at every width, so the same results. Inputs are
// clamped to [-87.3, 88.3]: below, the result is ~1e-38 (callers treat it as 0; scores of masked keys
// never reach here), above, float32 overflows anyway. GCC leaves the scalar form scalar in some loops
// (the softmax of a tile was), where the vector forms are ~10x fewer instructions.
template <typename V>
inline V fast_exp(V x) {
  const auto c = [](float v) { return splat<V>(v); };
  x = lanes_min(lanes_max(x, c(-87.3f)), c(88.3f));
  const V n = lanes_floor(x * c(1.44269504088896341f) + c(0.5f));
  const V r = x - n * c(0.693359375f) + n * c(2.12194440e-4f);
  V p = c(1.9875691500e-4f);
  p = p * r + c(1.3981999507e-3f);
  p = p * r + c(8.3334519073e-3f);
  p = p * r + c(4.1665795894e-2f);
  p = p * r + c(1.6666665459e-1f);
  p = p * r + c(5.0000001201e-1f);
  const V y = p * r * r + r + c(1.0f);
  return y * lanes_pow2(n);
}

// silu(gate) * up = gate / (1 + exp(-gate)) * up, lane by lane: the MLP's gating, as silu_mul (layer_ops.cpp)
// and the gated epilogues of the product kernels compute it, the same operations at every width.
template <typename V>
inline V silu_times(V gate, V up) {
  return gate / (splat<V>(1.f) + fast_exp(splat<V>(0.f) - gate)) * up;
}

// gelu(gate) * up with gelu's tanh approximation, 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)) for
// u = sqrt(2 / pi) (g + 0.044715 g^3): Gemma's gating (gelu_tanh_mul, layer_ops.cpp), on fast_exp as
// silu_times is.
template <typename V>
inline V gelu_tanh_times(V gate, V up) {
  const V minus_two_u = splat<V>(-2.f * 0.7978845608f) * (gate + splat<V>(0.044715f) * gate * gate * gate);
  return gate / (splat<V>(1.f) + fast_exp(minus_two_u)) * up;
}

}  // namespace kvserve
