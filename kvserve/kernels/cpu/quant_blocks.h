// GGUF weight blocks (GGML's formats) as kvserve's quantized kernels read them: the byte layout of each
// type, its exact dequantization, and a dispatch from the type's GGML number to its struct.
//
// A quantized [N, K] matrix is uint8 [N, row_bytes]: each row is K / kElems blocks of kBytes bytes
// (kvserve/model/quantized.py). Scales are IEEE half floats (f16), little-endian like everything here.
// `dequantize` computes each value with the float32 operations, in the order, of gguf.quants.dequantize
// (the reference the tests compare with): with -ffp-contract=off the results are bit-identical. Into bf16
// (Out = uint16_t, bf16 bits) each of those float32 values is rounded once more, to nearest even, as
// torch's conversion rounds the dense bf16 engine's weights: quant_linear_bf16.cpp's panels.
//
// Per type, element e of a block (llama.cpp's ggml-common.h is the specification):
//   Q8_0  [d f16][qs int8 x32]                      w = qs[e] * d
//   Q4_0  [d][qs 16 bytes]                          w = d * (q - 8), q = e < 16 ? low nibble of qs[e] : high of
//   qs[e-16] Q4_1  [d][m f16][qs 16]                         w = d * q + m, q as Q4_0 Q5_0  [d][qh 4 bytes][qs 16] w =
//   d * (q - 16), q = Q4_0's nibble | bit e of qh (LE u32) << 4 Q4_K  256 = 8 sub-blocks j of 32, [d][dmin][scales
//   12][qs 128]:
//         w = (d * sc_j) * q - dmin * m_j, q = nibble (j odd: high) of qs[32 (j / 2) + e % 32],
//         sc_j, m_j 6-bit: scale_min below
//   Q6_K  256, [ql 128][qh 64][scales int8 x16][d]:  w = (d * scales[e / 16]) * (q - 32), with
//         h = e / 128, t = e % 128 / 32, l = e % 32: q = (ql[64h + 32(t % 2) + l] >> 4(t / 2)) & 15
//                                                        | ((qh[32h + l] >> 2t) & 3) << 4
#pragma once

#include <torch/extension.h>

#include <c10/util/Half.h>

#include "common.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvserve::quant {

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Q4_K's 6-bit scale and min of sub-block j (0-7) from its 12 packed bytes.
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if defined(__AVX2__)
#define KVSERVE_QUANT_AVX2 1
// 32 weight nibbles as bytes in element order: the low nibbles of qs[0:16], then their high nibbles.
inline __m256i nibbles32(__m128i qs) {
  const __m128i mask = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
}
inline __m256i nibbles32(const uint8_t* qs) { return nibbles32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))); }
// The 32 bits of qh (little-endian) as bytes: 0x10 where the bit is set, else 0.
inline __m256i high_bits32(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i byte_of_bit = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), byte_of_bit);
  const __m256i other_bits = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // all but bit (lane % 8) of each byte
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, other_bits), _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
// out[e] = q[e] * scale (+ add), q 32 signed bytes; bytes 0-15 take scale_low, 16-31 scale_high. One
// rounding per operation, no fused multiply-add: the reference's float32 arithmetic; into bf16 (Out =
// uint16_t, only on AVX512-BF16) one more rounding to nearest even. Sixteen lanes at a time where the path
// has AVX-512: the same operations per element.
template <bool kAdd, typename Out>
inline void widen32(__m256i q, float scale_low, float scale_high, float add, Out* out) {
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
#ifdef __AVX512F__
  __m512 v[2];
  for (int i = 0; i < 2; ++i) {
    v[i] =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(halves[i])), _mm512_set1_ps(i ? scale_high : scale_low));
    if constexpr (kAdd) v[i] = _mm512_add_ps(v[i], _mm512_set1_ps(add));
  }
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_storeu_ps(out, v[0]);
    _mm512_storeu_ps(out + 16, v[1]);
  } else {
#ifdef __AVX512BF16__
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
#else
    static_assert(sizeof(Out) == 0, "bf16 output needs AVX512-BF16");
#endif
  }
#else
  static_assert(std::is_same_v<Out, float>, "bf16 output needs AVX512-BF16");
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
    __m256 v =
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), _mm256_set1_ps(i < 2 ? scale_low : scale_high));
    if constexpr (kAdd) v = _mm256_add_ps(v, _mm256_set1_ps(add));
    _mm256_storeu_ps(out + 8 * i, v);
  }
#endif
}
#endif

// Each type's `dequantize`: the vector form where AVX2 is there, the scalar definition otherwise.
struct Q8_0 {
  static constexpr int64_t kType = 8, kElems = 32, kBytes = 34;
  template <typename Out>
  static void dequantize(const uint8_t* b, Out* out) {
    const float d = half_to_float(b);
#ifdef KVSERVE_QUANT_AVX2
    widen32<false>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), d, d, 0.f, out);
    return;
#endif
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int e = 0; e < 32; ++e) out[e] = from_float<Out>(static_cast<float>(qs[e]) * d);
  }
};

struct Q4_0 {
  static constexpr int64_t kType = 2, kElems = 32, kBytes = 18;
  template <typename Out>
  static void dequantize(const uint8_t* b, Out* out) {
    const float d = half_to_float(b);
#ifdef KVSERVE_QUANT_AVX2
    widen32<false>(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), d, d, 0.f, out);
    return;
#endif
    for (int e = 0; e < 16; ++e) {
      out[e] = from_float<Out>(d * static_cast<float>((b[2 + e] & 0xF) - 8));
      out[e + 16] = from_float<Out>(d * static_cast<float>((b[2 + e] >> 4) - 8));
    }
  }
};

struct Q4_1 {
  static constexpr int64_t kType = 3, kElems = 32, kBytes = 20;
  template <typename Out>
  static void dequantize(const uint8_t* b, Out* out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
#ifdef KVSERVE_QUANT_AVX2
    widen32<true>(nibbles32(b + 4), d, d, m, out);
    return;
#endif
    for (int e = 0; e < 16; ++e) {
      out[e] = from_float<Out>(d * static_cast<float>(b[4 + e] & 0xF) + m);
      out[e + 16] = from_float<Out>(d * static_cast<float>(b[4 + e] >> 4) + m);
    }
  }
};

struct Q5_0 {
  static constexpr int64_t kType = 6, kElems = 32, kBytes = 22;
  template <typename Out>
  static void dequantize(const uint8_t* b, Out* out) {
    const float d = half_to_float(b);
#ifdef KVSERVE_QUANT_AVX2
    widen32<false>(_mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), high_bits32(b + 2)), _mm256_set1_epi8(16)), d, d,
                   0.f, out);
    return;
#endif
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int e = 0; e < 16; ++e) {
      const int low = (b[6 + e] & 0xF) | (((qh >> e) & 1) << 4);
      const int high = (b[6 + e] >> 4) | (((qh >> (e + 16)) & 1) << 4);
      out[e] = from_float<Out>(d * static_cast<float>(low - 16));
      out[e + 16] = from_float<Out>(d * static_cast<float>(high - 16));
    }
  }
};

struct Q4_K {
  static constexpr int64_t kType = 12, kElems = 256, kBytes = 144;
  template <typename Out>
  static void dequantize(const uint8_t* b, Out* out) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min(scales, j, sc, m);
      const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(m);
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
#ifdef KVSERVE_QUANT_AVX2
      const __m256i v = _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), shift);
      widen32<true>(_mm256_and_si256(v, _mm256_set1_epi8(0xF)), scale, scale, -offset,
                    out + 32 * j);  // x - o == x + -o
      continue;
#endif
      for (int l = 0; l < 32; ++l)
        out[32 * j + l] = from_float<Out>(scale * static_cast<float>((q[l] >> shift) & 0xF) - offset);
    }
  }
};

struct Q6_K {
  static constexpr int64_t kType = 14, kElems = 256, kBytes = 210;
  template <typename Out>
  static void dequantize(const uint8_t* b, Out* out) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
#ifdef KVSERVE_QUANT_AVX2
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t) {
        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (t % 2)));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
        const __m256i q = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(low, 4 * (t / 2)), _mm256_set1_epi8(0xF)),
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * t), _mm256_set1_epi8(3)), 4));
        const int g = 8 * h + 2 * t;  // the two 16-element scale groups of these 32 elements
        widen32<false>(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), d * static_cast<float>(scales[g]),
                       d * static_cast<float>(scales[g + 1]), 0.f, out + 128 * h + 32 * t);
      }
    return;
#endif
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, t = e % 128 / 32, l = e % 32;
      const int q = ((ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0xF) | (((qh[32 * h + l] >> (2 * t)) & 3) << 4);
      out[e] = from_float<Out>(d * static_cast<float>(scales[e / 16]) * static_cast<float>(q - 32));
    }
  }
};

// Calls fn(Block{}) with the struct of GGML type number `type`; an unknown type is refused by name.
template <typename Fn>
decltype(auto) visit_type(int64_t type, Fn&& fn) {
  switch (type) {
    case Q8_0::kType:
      return fn(Q8_0{});
    case Q4_0::kType:
      return fn(Q4_0{});
    case Q4_1::kType:
      return fn(Q4_1{});
    case Q5_0::kType:
      return fn(Q5_0{});
    case Q4_K::kType:
      return fn(Q4_K{});
    case Q6_K::kType:
      return fn(Q6_K{});
  }
  TORCH_CHECK(false, "no quantized kernel for GGML type ", type, " (kernels: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K)");
  __builtin_unreachable();
}

// Checks blocks ([N, row_bytes] uint8, contiguous) against the block type; returns K.
template <typename Block>
int64_t columns_of(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(blocks.size(1) % Block::kBytes == 0, "row_bytes ", blocks.size(1), " is not a whole number of ",
              Block::kBytes, "-byte blocks");
  return blocks.size(1) / Block::kBytes * Block::kElems;
}

}  // namespace kvserve::quant
