// Vectors of row groups' lanes (quant_row_groups.h): the operations quant_gemv.cpp's row-group kernels and
// quant_pack_tiles.h's packing of row groups into AMX tiles are written over, one 32-bit lane per weight row.
#pragma once

#include "quant_row_groups.h"

#if defined(__AVX2__) && defined(__F16C__)
#define KVSERVE_HAS_GROUP_LANES8 1
namespace kvserve {

// VNNI (AVX512-VNNI with VL, or AVX-VNNI) sums four u8 x s8 products straight into an int32 lane in one
// instruction; without it maddubs sums pairs into int16 and madd pairs of those into int32. The results
// are equal wherever no int16 pair sum saturates, which every caller ensures.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KVSERVE_HAS_VNNI 1
constexpr bool kVnni = true;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
constexpr bool kVnni = false;
#endif

// Row-group vectors (quant_row_groups.h), by width: GroupLanes8 holds one group's eight rows in a
// 256-bit vector, a 32-bit lane per row; GroupLanes16, on AVX-512 with VNNI, two neighbouring groups in a
// 512-bit vector, one per 256-bit half, so each broadcast of x, each dot instruction and each scaling
// serves sixteen rows. A vector's groups lie `stride` bytes apart (the matrix's bytes per group). The
// kernels below are written once over these operations. Without VNNI only the 256-bit form exists.
struct GroupLanes8 {
  using Int = __m256i;
  using Float = __m256;
  static constexpr int64_t kGroups = 1;
  static Int load(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Float halves(const uint8_t* p, int64_t) {  // a field of f16 per row
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Int byte_lanes(const uint8_t* p, int64_t) {  // a field of one byte per row, widened to its lane
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static Int signed_byte_lanes(const uint8_t* p, int64_t) {  // the same, each byte an int8
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static Int bytes(int8_t v) { return _mm256_set1_epi8(v); }
  static Int dwords(int32_t v) { return _mm256_set1_epi32(v); }
  static Int zero() { return _mm256_setzero_si256(); }
  static Int each_128(__m128i v) { return _mm256_broadcastsi128_si256(v); }  // v in every 128-bit lane
  static Int srli16(Int v, int n) { return _mm256_srli_epi16(v, n); }
  static Int slli16(Int v, int n) { return _mm256_slli_epi16(v, n); }
  static Int srli32(Int v, int n) { return _mm256_srli_epi32(v, n); }
  static Int slli32(Int v, int n) { return _mm256_slli_epi32(v, n); }
  static Int add32(Int a, Int b) { return _mm256_add_epi32(a, b); }
  static Int add8(Int a, Int b) { return _mm256_add_epi8(a, b); }
  static Int shuffle8(Int v, Int index) { return _mm256_shuffle_epi8(v, index); }  // within each 128-bit lane
  static Int where_any_bit(Int v, Int bits, Int value) {  // per byte: value where v & bits is not 0, else 0
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_or_si256(v, _mm256_xor_si256(bits, bytes(-1))), bytes(-1)), value);
  }
  static Int four_bytes(const int8_t* p) {  // p's four bytes in every lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return dwords(v);
  }
  static Float to_float(Int v) { return _mm256_cvtepi32_ps(v); }
#ifdef KVSERVE_HAS_VNNI
  // acc + the dots of u's unsigned bytes with s's signed ones, lane by lane.
  static Int dot(Int acc, Int u, Int s) { return dpbusd(acc, u, s); }
  // The same with the four signed bytes at x in every lane of s. With EVEX (AVX512-VNNI and VL) x is the
  // instruction's broadcast memory operand: GCC does not fold a broadcast into vpdpbusd, and as an instruction
  // of its own it takes a vector pipe beside the dot. Where one broadcast serves several dots, dot() with it
  // in a register is the faster (benchmarks/RESULTS.md, "x broadcast inside the dots").
  static Int dot_at(Int acc, Int u, const int8_t* x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
#else
    return dpbusd(acc, u, four_bytes(x));
#endif
  }
#endif
};

#if defined(KVSERVE_HAS_VNNI) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSERVE_HAS_GROUP_LANES16 1
struct GroupLanes16 {
  using Int = __m512i;
  using Float = __m512;
  static constexpr int64_t kGroups = 2;
  static Int load(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(GroupLanes8::load(p, 0)), GroupLanes8::load(p + stride, 0), 1);
  }
  static Float halves(const uint8_t* p, int64_t stride) {
    const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1));
  }
  static Int byte_lanes(const uint8_t* p, int64_t stride) {
    const __m128i low = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i high = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high));
  }
  static Int signed_byte_lanes(const uint8_t* p, int64_t stride) {
    const __m128i low = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i high = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(low, high));
  }
  static Int bytes(int8_t v) { return _mm512_set1_epi8(v); }
  static Int dwords(int32_t v) { return _mm512_set1_epi32(v); }
  static Int four_bytes(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return dwords(v);
  }
  static Int zero() { return _mm512_setzero_si512(); }
  static Int each_128(__m128i v) { return _mm512_broadcast_i32x4(v); }
  static Int srli16(Int v, int n) { return _mm512_srli_epi16(v, n); }
  static Int slli16(Int v, int n) { return _mm512_slli_epi16(v, n); }
  static Int srli32(Int v, int n) { return _mm512_srli_epi32(v, n); }
  static Int slli32(Int v, int n) { return _mm512_slli_epi32(v, n); }
  static Int add32(Int a, Int b) { return _mm512_add_epi32(a, b); }
  static Int add8(Int a, Int b) { return _mm512_add_epi8(a, b); }
  static Int shuffle8(Int v, Int index) { return _mm512_shuffle_epi8(v, index); }
  static Int where_any_bit(Int v, Int bits, Int value) {
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, bits), value);
  }
  static Float to_float(Int v) { return _mm512_cvtepi32_ps(v); }
  static Int dot(Int acc, Int u, Int s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static Int dot_at(Int acc, Int u, const int8_t* x) {  // as GroupLanes8's
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
  }
};
#endif

// Q5_0's fifth bits of a row group's q vector v (elements 4v .. 4v+3 of each row, lane r: bits 4v .. 4v+3
// of row r's qh, in its byte v / 2) at bit 4 of each byte, from qh (dword r: row r's 32 bits): each byte
// takes its row's qh byte, then keeps 0x10 where its own bit is set.
template <typename L>
inline typename L::Int fifth_bits(typename L::Int qh, int v) {
  const auto dword_bytes = L::each_128(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C));  // byte 0 of each dword
  const auto spread = L::shuffle8(qh, L::add8(dword_bytes, L::bytes(static_cast<int8_t>(v / 2))));
  return L::where_any_bit(spread, L::dwords(0x08040201 << (4 * (v % 2))), L::bytes(0x10));  // byte t: bit 4(v % 2) + t
}

// Q4_K's 6-bit scale and min of sub-block `sub` (0-7) for every row, from its twelve scale bytes widened
// to a lane per row (s[j]: byte j of each row's scales): GGML's get_scale_min_k4 (quant_blocks.h:
// scale_min) on the lanes. The GEMV and the panels' dequantization share it.
template <typename L>
inline void q4_k_scale_min(const typename L::Int* s, int sub, typename L::Int& sc, typename L::Int& mn) {
  const auto six_bits = L::dwords(63), four_bits = L::dwords(0xF);
  sc = sub < 4 ? s[sub] & six_bits : (s[sub + 4] & four_bits) | L::slli32(L::srli32(s[sub - 4], 6), 4);
  mn = sub < 4 ? s[sub + 4] & six_bits : L::srli32(s[sub + 4], 4) | L::slli32(L::srli32(s[sub], 6), 4);
}

// Q4_K's values 4t .. 4t+3 of sub-block `sub` (0-7) of each row, unsigned 0-15 (quant_row_groups.h): the
// low nibbles of qs vector 8 (sub / 2) + t for an even sub-block, the high ones for an odd one.
template <typename L>
inline typename L::Int q4_k_values(const uint8_t* qs, int64_t stride, int sub, int t) {
  const typename L::Int w = L::load(qs + 32 * (8 * (sub / 2) + t), stride);
  return (sub % 2 ? L::srli16(w, 4) : w) & L::bytes(0xF);
}

// Q6_K's group block (quant_row_groups.h): scale byte j of the eight rows at 8j, their f16 d at kQ6KD, then
// the qs vectors. Its 32-element chunk c (h = c / 4, t = c % 4) takes, per 16-element half, its rows' d times
// their signed scale byte, and its values 4i .. 4i+3 of each row, unsigned 0-63, from a nibble of ql vector
// 16h + 8 (t % 2) + i and a bit pair of qh vector 32 + 8h + i; the GEMV and the tile packing share both.
constexpr int64_t kQ6KD = 16 * quant::RowGroup<quant::Q6_K>::kRows;

template <typename L>
inline void q6_k_chunk_scales(const uint8_t* p, int64_t stride, int chunk, typename L::Float d,
                              typename L::Float* scales) {
  for (int half = 0; half < 2; ++half)
    scales[half] =
        d * L::to_float(L::signed_byte_lanes(p + quant::RowGroup<quant::Q6_K>::kRows * (2 * chunk + half), stride));
}

template <typename L>
inline typename L::Int q6_k_values(const uint8_t* qs, int64_t stride, int chunk, int i) {
  const int h = chunk / 4, t = chunk % 4;
  const typename L::Int low = L::load(qs + 32 * (16 * h + 8 * (t % 2) + i), stride);
  const typename L::Int high = L::load(qs + 32 * (32 + 8 * h + i), stride);
  const typename L::Int pair =
      2 * t <= 4 ? L::slli16(high, 4 - 2 * t) : L::srli16(high, 2 * t - 4);  // bits 2t, 2t+1 at 4, 5
  return (L::srli16(low, 4 * (t / 2)) & L::bytes(0xF)) | (pair & L::bytes(0x30));
}

}  // namespace kvserve
#endif
