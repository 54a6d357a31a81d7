// y = x @ W^T for a few rows of x, W [N, K] in GGUF blocks (quant_blocks.h), dequantized on the fly.
//
// At batch 1 the product streams W once, so its speed limit is W's size in memory: the blocks are read
// as they lie, never widened into a copy. More rows of x meet each few weight rows in chunks of
// kRowChunk (as many as the vector registers hold), the weight rows staying in L1 from chunk to chunk,
// so W is still read from memory once per call and each further row costs only its integer products.
//
// Each row of x is quantized per 32 elements to int8 with a float scale (as llama.cpp's Q8_0 activations), and each
// weight block meets its x block in integer dot products (_mm256_maddubs_epi16: unsigned weight bytes x signed x bytes,
// so signed weights (Q8_0) lend x their sign); one float multiply-add per block applies the two scales. Not exact: x's
// rounding to int8 costs up to half a step of 1/127 of each x block's largest magnitude
// (tests/test_quantized_kernels.py states the tolerance). Chosen over widening the weights to float32 for FMAs against
// float32 x, which is exact up to summation order but did more work per weight byte and ran slower on every shape
// measured on AVX2 (benchmarks/RESULTS.md, "Quantized weights").
//
// 256-bit vectors on every path; where the build has VNNI (AVX512-VNNI, AVX-VNNI) the integer dots take
// one dpbusd in place of maddubs + madd (benchmarks/RESULTS.md, "VNNI in the quantized GEMV").
#include "common.h"
#include "group_lanes.h"
#include "ops.h"
#include "work_claims.h"

namespace kvserve {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_HAS_QUANT_GEMV 1
namespace {

// Software prefetch of the weight rows this many row groups ahead (as gemv.cpp).
constexpr int64_t kPrefetchGroups = 4;
// Weight rows computed together: one pass over x's blocks serves all of them.
constexpr int64_t kWeightRows = 4;
constexpr int64_t kXBlock = 32;  // x is quantized (int8 design) and summed (float design) per 32 elements

// Rows of x per chunk: each row's accumulators beside a block's unpacked weight vectors fill the 16
// ymm registers of AVX2 at two rows, AVX-512's 32 at four.
#if defined(__AVX512VL__)
constexpr int kRowChunk = 4;
#else
constexpr int kRowChunk = 2;
#endif

// Rows of x quantized per 32 elements, as quantize_int8 stores them, from one row on: element e of block
// i (row m's blocks at m * K / 32 on) is q[32 i + e]; scale[i], sum32[i], and sum16[2 i], sum16[2 i + 1].
struct ActivationRows {
  int64_t k;
  const int8_t* q;
  const float* scale;
  const int32_t* sum16;
  const float* sum32;
};

// `rows` rows of x (K each) quantized per 32 elements: q = round(x / scale), scale = max |x| / 127; the
// sums of q per 16 elements (Q6_K's scale groups) and of the quantized x (scale * sum q) per 32.
struct Activations {
  int64_t k = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum16;
  std::vector<float> sum32;

  ActivationRows from_row(int64_t m) const {
    const int64_t b = m * k / kXBlock;
    return {k, q.data() + b * kXBlock, scale.data() + b, sum16.data() + 2 * b, sum32.data() + b};
  }
};

inline __m256 load8_float(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_float(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Blocks of x quantized per thread where they are many: serial, a 100-row decode batch's quantization left
// the other thread waiting for ~2 % of the step (benchmarks/RESULTS.md, "Quantized activations on both
// threads"). Each block is written by one thread only, so the result is the same whatever the split.
constexpr int64_t kQuantizeGrain = 256;  // blocks of 32: below this (a GEMV's few rows) one thread

template <typename T>
Activations quantize_int8(const T* x, int64_t rows, int64_t k) {
  Activations a;
  a.k = k;
  a.q.resize(rows * k);
  a.scale.resize(rows * k / kXBlock);
  a.sum16.resize(rows * k / 16);
  a.sum32.resize(rows * k / kXBlock);
  at::parallel_for(0, rows * k / kXBlock, kQuantizeGrain, [&](int64_t first, int64_t last) {
    const __m256 sign_bit = _mm256_set1_ps(-0.f);
    for (int64_t b = first; b < last; ++b) {
      const T* src = x + b * kXBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load8_float(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      }
      const float d = reduce_max(amax) / 127.f;
      a.scale[b] = d;
      const __m256 inv = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest, ties even
      a.sum16[2 * b] = hsum_epi32(_mm256_add_epi32(q[0], q[1]));
      a.sum16[2 * b + 1] = hsum_epi32(_mm256_add_epi32(q[2], q[3]));
      a.sum32[b] = d * static_cast<float>(a.sum16[2 * b] + a.sum16[2 * b + 1]);
      // packs interleave the 128-bit halves; the permutation puts the 32 bytes back in element order.
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + b * kXBlock), ordered);
    }
  });
  return a;
}

// Eight int32 sums of pairs of pairs of u8 x s8 products: sum over 32 bytes, spread over 8 lanes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef KVSERVE_HAS_VNNI
  return dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// One weight block times the x blocks from xb (index of the block's first 32 elements within a row) in
// each of the M rows: acc[m] collects the integer products with both scales applied, per lane; corr[m]
// the terms of the block's offsets (Q4_0's 8, Q4_1's min, ...), which multiply the sum of x.
template <typename Block, int M>
inline void block_dot(const uint8_t* b, const ActivationRows& x, int64_t xb, __m256* acc, float* corr) {
  const int64_t xblocks = x.k / kXBlock;
  if constexpr (std::is_same_v<Block, quant::Q8_0>) {
    const float d = quant::half_to_float(b);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m256i w_abs = _mm256_sign_epi8(w, w);
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * xblocks + xb;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kXBlock));
      const __m256i p = dot_u8s8(w_abs, _mm256_sign_epi8(xq, w));
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.scale[i]), _mm256_cvtepi32_ps(p), acc[m]);
    }
  } else if constexpr (std::is_same_v<Block, quant::Q4_0> || std::is_same_v<Block, quant::Q4_1> ||
                       std::is_same_v<Block, quant::Q5_0>) {
    // q unsigned (0-15, Q5_0 0-31): sum w x = d (sum q xq - offset sum xq) scale_x, Q4_1 + m sum x.
    constexpr bool kMin = std::is_same_v<Block, quant::Q4_1>, kFive = std::is_same_v<Block, quant::Q5_0>;
    const float d = quant::half_to_float(b);
    const float offset = kMin ? quant::half_to_float(b + 2) : (kFive ? -16.f : -8.f) * d;  // times sum x
    const __m256i q = kFive ? _mm256_or_si256(quant::nibbles32(b + 6), quant::high_bits32(b + 2))
                            : quant::nibbles32(b + (kMin ? 4 : 2));
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * xblocks + xb;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kXBlock));
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.scale[i]), _mm256_cvtepi32_ps(dot_u8s8(q, xq)), acc[m]);
      corr[m] += offset * x.sum32[i];
    }
  } else if constexpr (std::is_same_v<Block, quant::Q4_K>) {
    const float d = quant::half_to_float(b), dmin = quant::half_to_float(b + 2);
    const __m256i mask = _mm256_set1_epi8(0xF);
    for (int j2 = 0; j2 < 4; ++j2) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j2));
      const __m256i q[2] = {_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)};
      for (int h = 0; h < 2; ++h) {
        int sc, mn;
        quant::scale_min(b + 4, 2 * j2 + h, sc, mn);
        for (int m = 0; m < M; ++m) {
          const int64_t i = m * xblocks + xb + 2 * j2 + h;
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kXBlock));
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * static_cast<float>(sc) * x.scale[i]),
                                   _mm256_cvtepi32_ps(dot_u8s8(q[h], xq)), acc[m]);
          corr[m] -= dmin * static_cast<float>(mn) * x.sum32[i];
        }
      }
    }
  } else {
    static_assert(std::is_same_v<Block, quant::Q6_K>);
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = quant::half_to_float(b + 208);
    const __m256i mask = _mm256_set1_epi8(0xF), mask2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i low[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32))};
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      for (int t = 0; t < 4; ++t) {
        const __m256i q =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low[t % 2], 4 * (t / 2)), mask),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * t), mask2), 4));
        const int g = 8 * h + 2 * t;  // the chunk's two 16-element scale groups: g, g + 1
        const __m256i group_scales = _mm256_set_m128i(_mm_set1_epi16(scales[g + 1]), _mm_set1_epi16(scales[g]));
        for (int m = 0; m < M; ++m) {
          const int64_t i = m * xblocks + xb + 4 * h + t;
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kXBlock));
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), group_scales);
          const float dx = d * x.scale[i];
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dx), _mm256_cvtepi32_ps(p), acc[m]);
          corr[m] -= 32.f * dx * static_cast<float>(scales[g] * x.sum16[2 * i] + scales[g + 1] * x.sum16[2 * i + 1]);
        }
      }
    }
  }
}

// Rows n .. n+R-1 of y (x's dtype, [M, n_total]) for the M rows of x.
template <typename Block, int M, int R, typename Out>
inline void gemv_rows(const uint8_t* w, int64_t row_bytes, const ActivationRows& x, Out* y, int64_t n, int64_t n_end,
                      int64_t n_total) {
  __m256 acc[R][M];
  float corr[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps(), corr[r][m] = 0.f;
  const uint8_t* rows = w + n * row_bytes;
  const bool prefetch = n + (kPrefetchGroups + 1) * R <= n_end;  // never past this thread's rows
  const int64_t blocks = x.k / Block::kElems;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t offset = blk * Block::kBytes;
    for (int r = 0; r < R; ++r) {
      if (prefetch && offset % 64 < Block::kBytes)  // once per cache line of the row ahead
        _mm_prefetch(reinterpret_cast<const char*>(rows + (r + kPrefetchGroups * R) * row_bytes + offset), _MM_HINT_T1);
      block_dot<Block, M>(rows + r * row_bytes + offset, x, blk * (Block::kElems / kXBlock), acc[r], corr[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * n_total + n + r] = from_float<Out>(reduce_add(acc[r][m]) + corr[r][m]);
}

// fn(m, std::integral_constant<int, M>{}) for the chunks of x's `rows` rows: m the chunk's first row, M
// its row count as a compile-time constant (Chunk, then fewer for the last).
template <int Chunk = kRowChunk, typename Fn>
inline void for_row_chunks(int64_t rows, Fn&& fn) {
  int64_t m = 0;
  for (; m + Chunk <= rows; m += Chunk) fn(m, std::integral_constant<int, Chunk>{});
  [&]<int... Ms>(std::integer_sequence<int, Ms...>) {
    ((rows - m == Ms + 1 ? fn(m, std::integral_constant<int, Ms + 1>{}) : void()), ...);
  }(std::make_integer_sequence<int, Chunk - 1>{});
}

// fn over [0, items) on the threads: one contiguous share each (at::parallel_for, at least `grain` items)
// at one or two rows of x, where the product streams W and claims ran it slower; claimed as the threads
// go for more rows (work_claims.h; benchmarks/RESULTS.md, "Work claimed as threads go").
template <typename Fn>
void split_work(int64_t rows, int64_t items, int64_t grain, const Fn& fn) {
  if (rows <= kGemvMaxRows) {
    at::parallel_for(0, items, grain, fn);
  } else {
    parallel_claims(0, items, fn);
  }
}

template <typename Block, typename Out>
void gemv_kernel(const uint8_t* w, int64_t row_bytes, const Activations& x, int64_t rows, Out* y, int64_t n_total) {
  split_work(rows, n_total, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += kWeightRows) {
      for_row_chunks(rows, [&](int64_t m, auto chunk) {
        constexpr int M = decltype(chunk)::value;
        if (n + kWeightRows <= end)
          gemv_rows<Block, M, kWeightRows>(w, row_bytes, x.from_row(m), y + m * n_total, n, end, n_total);
        else
          for (int64_t r = n; r < end; ++r)
            gemv_rows<Block, M, 1>(w, row_bytes, x.from_row(m), y + m * n_total, r, end, n_total);
      });
    }
  });
}

// The same product over row groups: each 32-bit lane is one row, so the scales of a vector's rows load
// as one vector and every product, sum and scaling serves all of them at once; a vector's results are
// adjacent outputs, stored as one vector. Per x block:
// - 4-bit types: the eight u8 x s8 pair products per lane are summed in int16 before widening; eight of
//   them reach at most 8 * 2 * 15 * 127 = 30,480 < 32,767 (x's int8 never holds -128: |q| <= 127 by its
//   scale). The offsets (Q4_0's -8 d, Q4_1's m, Q5_0's -16 d) multiply the sum of x, in a chain of their own.
// - Q5_0: the 4-bit types' nibbles with each one's fifth bit from qh set at bit 4 (fifth_bits), unsigned
//   0-31; a pair sum (at most 2 * 31 * 127 = 7,874) fits int16, eight of them do not, so without VNNI
//   each vector's sums widen to int32 as Q8_0's do.
// - Q8_0 with VNNI: the weights flipped to unsigned (w + 128, one xor), dpbusd against x, and 128 times
//   the block's integer sum of x taken off in int32, so the dot is exact before its one conversion.
//   Without VNNI, maddubs takes |w| against x with w's sign (as the GGML layout's Q8_0), each pair sum at
//   most 2 * 128 * 127 = 32,512, widened to int32 per vector since two would overflow int16.
//
#ifdef KVSERVE_HAS_VNNI
// acc + u's dots with the four bytes of x at `x` in every lane: broadcast inside the dot instruction where a
// chunk has several rows of x (kInDot), from a register for a single row, which ran the faster at batch 1
// on Gemma 3's layers (benchmarks/RESULTS.md, "x broadcast inside the dots").
template <typename L, bool kInDot>
inline typename L::Int dot_x(typename L::Int acc, typename L::Int u, const int8_t* x) {
  if constexpr (kInDot)
    return L::dot_at(acc, u, x);
  else
    return L::dot(acc, u, L::four_bytes(x));
}
#endif

// One block of V vectors of row groups, unpacked: each vector's scale d, its offset (Q4_0's -8 d, Q4_1's m,
// Q5_0's -16 d; 0 for Q8_0) and its 32 values as eight vectors of u8 (q[v][t]: elements 4t .. 4t+3 of each
// row, quant_row_groups.h), ready for the integer dots against x.
template <typename L, int V>
struct UnpackedBlock {
  typename L::Float d[V], offset[V];
  typename L::Int q[V][8];
};

// Block p (of the V vectors `stride` bytes apart from p on) unpacked into u.
template <typename Group, typename L, int V>
inline void unpack_block(const uint8_t* p, int64_t stride, UnpackedBlock<L, V>& u) {
  using Int = typename L::Int;
  using Float = typename L::Float;
  constexpr bool kMin = std::is_same_v<Group, quant::RowGroup<quant::Q4_1>>;    // offset m
  constexpr bool kFive = std::is_same_v<Group, quant::RowGroup<quant::Q5_0>>;   // fifth bits; offset -16 d
  constexpr bool kEight = std::is_same_v<Group, quant::RowGroup<quant::Q8_0>>;  // no offset; else Q4_0: -8 d
  const Int mask = L::bytes(0xF);
  for (int v = 0; v < V; ++v) {
    const uint8_t* pv = p + v * L::kGroups * stride;
    u.d[v] = L::halves(pv, stride);
    u.offset[v] = kEight ? splat<Float>(0.f)
                  : kMin ? L::halves(pv + 16, stride)
                         : u.d[v] * splat<Float>(kFive ? -16.f : -8.f);
    const Int qh = kFive ? L::load(pv + 16, stride) : L::zero();
    for (int j = 0; j < Group::kQsVectors; ++j) {
      const Int w = L::load(pv + Group::kQsOffset + 32 * j, stride);
      if constexpr (kEight) {
        u.q[v][j] = kVnni ? w ^ L::bytes(static_cast<int8_t>(0x80)) : w;  // VNNI: w + 128
      } else {
        u.q[v][j] = w & mask;
        u.q[v][j + 4] = L::srli16(w, 4) & mask;
        if constexpr (kFive) {
          u.q[v][j] = u.q[v][j] | fifth_bits<L>(qh, j);
          u.q[v][j + 4] = u.q[v][j + 4] | fifth_bits<L>(qh, j + 4);
        }
      }
    }
  }
}

// The M rows of x's block b times the unpacked block u: acc[m][v] gathers the integer products with both
// scales applied, acc_offset[m][v] the offsets' terms (a chain of their own). With several vectors each of
// x's broadcasts, in a register, serves all their dots; with one the dots read x as dot_x does.
template <typename Group, int M, typename L, int V>
inline void multiply_block(const UnpackedBlock<L, V>& u, const ActivationRows& x, int64_t b,
                           typename L::Float (&acc)[M][V], typename L::Float (&acc_offset)[M][V]) {
  using Int = typename L::Int;
  using Float = typename L::Float;
  constexpr bool kFive = std::is_same_v<Group, quant::RowGroup<quant::Q5_0>>;
  constexpr bool kEight = std::is_same_v<Group, quant::RowGroup<quant::Q8_0>>;
  const int64_t xblocks = x.k / kXBlock;
  for (int m = 0; m < M; ++m) {
    const int64_t i = m * xblocks + b;
    const int8_t* xq = x.q + i * kXBlock;
    // Two chains per vector, even and odd t, so the dot products' latencies overlap; with VNNI, Q8_0's
    // unsigned weights (w + 128) count 128 times x's sum too, so its first chain starts at minus that.
    const int32_t start = kEight && kVnni ? -128 * (x.sum16[2 * i] + x.sum16[2 * i + 1]) : 0;
    Int sums[V][2];
    for (int v = 0; v < V; ++v) sums[v][0] = L::dwords(start), sums[v][1] = L::zero();
    for (int t = 0; t < 8; ++t) {
      const Int xs = L::four_bytes(xq + 4 * t);  // unused (and not loaded) where the dots read x (dot_x)
      for (int v = 0; v < V; ++v) {
        Int& sum = sums[v][t % 2];
        const Int q = u.q[v][t];
#ifdef KVSERVE_HAS_VNNI
        sum = V > 1 ? L::dot(sum, q, xs) : dot_x<L, (M > 1)>(sum, q, xq + 4 * t);
#else
        if constexpr (kEight)
          sum = _mm256_add_epi32(sum, dot_u8s8(_mm256_abs_epi8(q), _mm256_sign_epi8(xs, q)));
        else if constexpr (kFive)
          sum = _mm256_add_epi32(sum, dot_u8s8(q, xs));
        else
          sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q, xs));
#endif
      }
    }
    const Float x_scale = splat<Float>(x.scale[i]);
    for (int v = 0; v < V; ++v) {
#ifdef KVSERVE_HAS_VNNI
      const Float dot = L::to_float(L::add32(sums[v][0], sums[v][1]));
#else
      constexpr bool kInt32Sums = kEight || kFive;  // else int16 pairs, widened once here
      const Float dot = _mm256_cvtepi32_ps(
          kInt32Sums ? _mm256_add_epi32(sums[v][0], sums[v][1])
                     : _mm256_madd_epi16(_mm256_add_epi16(sums[v][0], sums[v][1]), _mm256_set1_epi16(1)));
#endif
      acc[m][v] = lanes_fma(dot, u.d[v] * x_scale, acc[m][v]);
      if constexpr (!kEight) acc_offset[m][v] = lanes_fma(u.offset[v], splat<Float>(x.sum32[i]), acc_offset[m][v]);
    }
  }
}

// Software prefetch, into L1, of every cache line of the weights kPrefetchAheadBytes ahead of block p in each of
// `groups` row groups `stride` bytes apart (past the matrix's end it asks for the next weights in memory; a
// prefetch never faults). A thread's row groups lie one after another, so this runs ahead of its own reads. With
// the hardware prefetchers alone, a product at one or two rows left the memory idle while it computed: its weights
// arrived at well below the stream rate, on every block type (benchmarks/RESULTS.md, "Weights asked for 1 KiB
// ahead"). With many rows the block is in cache by then and the prefetches hit.
constexpr int64_t kPrefetchAheadBytes = 1024;
template <typename Group>
inline void prefetch_ahead(const uint8_t* p, int64_t stride, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t line = 0; line < Group::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + g * stride + kPrefetchAheadBytes + line), _MM_HINT_T0);
}

// The M rows of x times V vectors of row groups from group block row `group` on (L::kGroups * V groups,
// `stride` bytes apart; all their blocks), each block unpacked once. out[m * V + v]: vector v's results for
// row m, the products' terms and the offsets' summed.
template <typename Group, int M, typename L, int V>
inline void row_group_rows(const uint8_t* group, int64_t stride, const ActivationRows& x, typename L::Float* out) {
  using Float = typename L::Float;
  Float acc[M][V], acc_offset[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = splat<Float>(0.f), acc_offset[m][v] = splat<Float>(0.f);
  for (int64_t b = 0; b < x.k / kXBlock; ++b) {
    prefetch_ahead<Group>(group + b * Group::kBytes, stride, L::kGroups * V);
    UnpackedBlock<L, V> u;
    unpack_block<Group, L, V>(group + b * Group::kBytes, stride, u);
    multiply_block<Group, M, L, V>(u, x, b, acc, acc_offset);
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) out[m * V + v] = acc[m][v] + acc_offset[m][v];
}

// Q4_K in row groups: per 256-element super-block the rows' d and dmin, and their 6-bit sub-block scales
// and mins unpacked for all rows at once (each scale byte of the rows widened to a lane per row, then
// GGML's bit arithmetic on the lanes: group_lanes.h, q4_k_scale_min); per 32-element sub-block the 4-bit types' dots
// (int16 pair sums fit as Q4_0's do) times d * scale, and dmin * min times the sum of x taken off in a
// chain of its own. One vector of rows (V = 1): the twelve scale vectors fill the registers.
template <typename Group, int M, typename L, int V>
inline void q4_k_row_group_rows(const uint8_t* group, int64_t stride, const ActivationRows& x, typename L::Float* out) {
  static_assert(V == 1);
  using Int = typename L::Int;
  using Float = typename L::Float;
  const int64_t xblocks = x.k / kXBlock;
  Float acc[M], acc_offset[M];
  for (int m = 0; m < M; ++m) acc[m] = splat<Float>(0.f), acc_offset[m] = splat<Float>(0.f);
  const uint8_t* p = group;
  for (int64_t super = 0; super < xblocks / 8; ++super, p += Group::kBytes) {
    prefetch_ahead<Group>(p, stride, L::kGroups);
    const Float d = L::halves(p, stride), dmin = L::halves(p + 16, stride);
    Int s[12];  // byte j of each row's 12 scale bytes, lane r
    for (int j = 0; j < 12; ++j) s[j] = L::byte_lanes(p + 32 + 8 * j, stride);
    for (int sub = 0; sub < 8; ++sub) {
      Int sc, mn;
      q4_k_scale_min<L>(s, sub, sc, mn);
      const Float scale = d * L::to_float(sc), offset = dmin * L::to_float(mn);
      Int q[8];  // elements 4t .. 4t+3 of the sub-block, lane r
      for (int t = 0; t < 8; ++t) q[t] = q4_k_values<L>(p + Group::kQsOffset, stride, sub, t);
      for (int m = 0; m < M; ++m) {
        const int64_t i = m * xblocks + 8 * super + sub;
        const int8_t* xq = x.q + i * kXBlock;
        Int sums[2] = {L::zero(), L::zero()};  // even and odd t, as above
        for (int t = 0; t < 8; ++t) {
#ifdef KVSERVE_HAS_VNNI
          sums[t % 2] = dot_x<L, (M > 1)>(sums[t % 2], q[t], xq + 4 * t);
#else
          sums[t % 2] = _mm256_add_epi16(sums[t % 2], _mm256_maddubs_epi16(q[t], L::four_bytes(xq + 4 * t)));
#endif
        }
#ifdef KVSERVE_HAS_VNNI
        const Float dot = L::to_float(L::add32(sums[0], sums[1]));
#else
        const Float dot =
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(sums[0], sums[1]), _mm256_set1_epi16(1)));
#endif
        acc[m] = lanes_fma(dot, scale * splat<Float>(x.scale[i]), acc[m]);
        acc_offset[m] = lanes_fma(offset, splat<Float>(-x.sum32[i]), acc_offset[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m] + acc_offset[m];
}

// Q6_K in row groups: per 256-element super-block the rows' d; per 32-element chunk its eight q vectors
// and its two 16-element scale groups' scales, a lane per row (group_lanes.h: q6_k_values, q6_k_chunk_scales). Each
// scale group's integer dot starts at -32 times its x sum, so it ends as the exact sum of (q - 32) x; a pair sum of q x
// (at most 2 * 63 * 127 = 16,002) and two of them fit int16 without VNNI too. One vector of rows (V = 1), as Q4_K.
template <typename Group, int M, typename L, int V>
inline void q6_k_row_group_rows(const uint8_t* group, int64_t stride, const ActivationRows& x, typename L::Float* out) {
  static_assert(V == 1);
  using Int = typename L::Int;
  using Float = typename L::Float;
  const int64_t xblocks = x.k / kXBlock;
  Float acc[M];
  for (int m = 0; m < M; ++m) acc[m] = splat<Float>(0.f);
  const uint8_t* p = group;
  for (int64_t super = 0; super < xblocks / 8; ++super, p += Group::kBytes) {
    prefetch_ahead<Group>(p, stride, L::kGroups);
    const Float d = L::halves(p + kQ6KD, stride);
    for (int chunk = 0; chunk < 8; ++chunk) {
      Float scale[2];
      q6_k_chunk_scales<L>(p, stride, chunk, d, scale);
      Int q[8];  // elements 4i .. 4i+3 of the chunk, lane r
      for (int i = 0; i < 8; ++i) q[i] = q6_k_values<L>(p + Group::kQsOffset, stride, chunk, i);
      for (int m = 0; m < M; ++m) {
        const int64_t xi = m * xblocks + 8 * super + chunk;
        const int8_t* xq = x.q + xi * kXBlock;
        Int sums[2] = {L::dwords(-32 * x.sum16[2 * xi]), L::dwords(-32 * x.sum16[2 * xi + 1])};  // scale groups
        for (int i = 0; i < 8; ++i) {
#ifdef KVSERVE_HAS_VNNI
          sums[i / 4] = dot_x<L, (M > 1)>(sums[i / 4], q[i], xq + 4 * i);
#else
          sums[i / 4] = _mm256_add_epi32(sums[i / 4], dot_u8s8(q[i], L::four_bytes(xq + 4 * i)));
#endif
        }
        const Float x_scale = splat<Float>(x.scale[xi]);
        acc[m] = lanes_fma(L::to_float(sums[0]), scale[0] * x_scale, acc[m]);
        acc[m] = lanes_fma(L::to_float(sums[1]), scale[1] * x_scale, acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m];
}

// Q4_0, Q4_1 and Q8_0: a block is its values, its scale and (the 4-bit types) its offset.
template <typename Group>
constexpr bool kRegisterRows =
    std::is_same_v<Group, quant::RowGroup<quant::Q4_0>> || std::is_same_v<Group, quant::RowGroup<quant::Q4_1>> ||
    std::is_same_v<Group, quant::RowGroup<quant::Q8_0>>;

#ifndef KVSERVE_HAS_VNNI
// These types in row groups without VNNI, for chunks of kRegisterMinRows rows of x or more: each 32-byte load
// of a block's values (a 4-bit type's split into its two vectors of values) meets every row of x before the
// next load, so few vectors of the block are live and the rows' sums (one chain each: an add's latency is a
// cycle) and accumulators stay in AVX2's 16 registers. row_group_rows unpacks the whole block first, and GCC
// kept two rows' accumulators on the stack there; at one or two rows it is still the faster
// (benchmarks/RESULTS.md, "Row-group blocks met load by load"). A row takes row_group_rows' float operations (its
// integer sums are exact whichever chain holds them), so its results do not depend on the chunk it is in.
constexpr int kRegisterMinRows = 3;
template <typename Group, int M>
inline void register_row_group_rows(const uint8_t* group, const ActivationRows& x, __m256* out) {
  constexpr bool kMin = std::is_same_v<Group, quant::RowGroup<quant::Q4_1>>;    // offset m
  constexpr bool kEight = std::is_same_v<Group, quant::RowGroup<quant::Q8_0>>;  // no offset; else Q4_0's -8 d
  using L = GroupLanes8;
  const int64_t xblocks = x.k / kXBlock;
  const __m256i mask = L::bytes(0xF);
  __m256 acc[M], acc_offset[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), acc_offset[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < xblocks; ++b) {
    const uint8_t* p = group + b * Group::kBytes;
    __m256i sums[M];  // int32 for Q8_0; else int16 pairs
    for (int m = 0; m < M; ++m) sums[m] = L::zero();
    for (int j = 0; j < Group::kQsVectors; ++j) {
      const __m256i w = L::load(p + Group::kQsOffset + 32 * j, 0);
      if constexpr (kEight) {  // elements 4j..: |w| against x with w's sign (dot_u8s8)
        const __m256i w_abs = _mm256_abs_epi8(w);
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = x.q + (m * xblocks + b) * kXBlock;
          sums[m] = _mm256_add_epi32(sums[m], dot_u8s8(w_abs, _mm256_sign_epi8(L::four_bytes(xq + 4 * j), w)));
        }
      } else {
        const __m256i low = w & mask, high = L::srli16(w, 4) & mask;  // elements 4j.., 4(j + 4)..
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = x.q + (m * xblocks + b) * kXBlock;
          sums[m] = _mm256_add_epi16(sums[m], _mm256_maddubs_epi16(low, L::four_bytes(xq + 4 * j)));
          sums[m] = _mm256_add_epi16(sums[m], _mm256_maddubs_epi16(high, L::four_bytes(xq + 4 * (j + 4))));
        }
      }
    }
    const __m256 d = L::halves(p, 0), offset = kMin ? L::halves(p + 16, 0) : d * splat<__m256>(-8.f);
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * xblocks + b;
      const __m256 dot = _mm256_cvtepi32_ps(kEight ? sums[m] : _mm256_madd_epi16(sums[m], _mm256_set1_epi16(1)));
      acc[m] = lanes_fma(dot, d * splat<__m256>(x.scale[i]), acc[m]);
      if constexpr (!kEight) acc_offset[m] = lanes_fma(offset, splat<__m256>(x.sum32[i]), acc_offset[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m] + acc_offset[m];
}
#endif

// The M rows of x times V vectors of row groups, by the type's form.
template <typename Group, int M, typename L, int V>
inline void group_rows(const uint8_t* group, int64_t stride, const ActivationRows& x, typename L::Float* out) {
  if constexpr (std::is_same_v<Group, quant::RowGroup<quant::Q4_K>>)
    q4_k_row_group_rows<Group, M, L, V>(group, stride, x, out);
  else if constexpr (std::is_same_v<Group, quant::RowGroup<quant::Q6_K>>)
    q6_k_row_group_rows<Group, M, L, V>(group, stride, x, out);
#ifndef KVSERVE_HAS_VNNI
  else if constexpr (kRegisterRows<Group> && M >= kRegisterMinRows)
    register_row_group_rows<Group, M>(group, x, out);
#endif
  else
    row_group_rows<Group, M, L, V>(group, stride, x, out);
}

// Whether these rows take register_row_group_rows' chunks (row groups of its types, no VNNI).
template <typename Group>
constexpr bool kRegisterChunks = kRegisterRows<Group> && !kVnni;

// Rows of x per chunk in row_group_tile: four in register_row_group_rows' chunks (four rows' sums and
// accumulators beside the block's vectors fill the registers), else kRowChunk.
template <typename Group>
constexpr int kGroupChunkRows = kRegisterChunks<Group> ? 4 : kRowChunk;

// Rows of x per sweep: the M of group_rows for the types whose blocks cost the most to unpack (all but Q4_0's
// and Q4_1's nibbles: Q5_0's fifth bits, Q8_0's two vectors, the K-quants' scales), so that each block is
// unpacked once per sweep of 16 rows rather than once per chunk of kRowChunk. Too many for the registers, a
// sweep's sums live in L1 (2 KiB a vector); with fewer rows, and for Q4_0 and Q4_1 at any count, the chunks
// in registers ran faster (benchmarks/RESULTS.md, "Sixteen-row sweeps"), as did Q8_0 in
// register_row_group_rows' chunks without VNNI ("Row-group blocks met load by load"). A row takes the same operations
// either way, so its results do not depend on the rows beside it.
constexpr int kSweepRows = 16;
template <typename Group>
constexpr bool kSweeps = !kRegisterChunks<Group> && !std::is_same_v<Group, quant::RowGroup<quant::Q4_0>> &&
                         !std::is_same_v<Group, quant::RowGroup<quant::Q4_1>>;

// Every row of x times the L::kGroups * V groups from group g on, in sweeps (kSweeps) and chunks of
// kGroupChunkRows rows, stored into y (`columns` columns). Gated (gate_groups > 0): silu(gate) * up, group g's
// results beside group gate_groups + g's, as silu_mul (layer_ops.cpp) computes them from float32.
template <typename Group, typename L, int V, typename Out>
inline void row_group_tile(const uint8_t* w, int64_t group_bytes, const Activations& x, int64_t rows, Out* y,
                           int64_t columns, int64_t g, int64_t gate_groups) {
  const uint8_t* gate = w + g * group_bytes;
  const uint8_t* up = w + (gate_groups + g) * group_bytes;
  const auto rows_from = [&]<int M>(int64_t m0) {
    typename L::Float out[M * V];
    group_rows<Group, M, L, V>(gate, group_bytes, x.from_row(m0), out);
    if (gate_groups > 0) {
      typename L::Float up_out[M * V];
      group_rows<Group, M, L, V>(up, group_bytes, x.from_row(m0), up_out);
      for (int i = 0; i < M * V; ++i) out[i] = silu_times(out[i], up_out[i]);
    }
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v)
        lanes_store(y + (m0 + m) * columns + (g + v * L::kGroups) * Group::kRows, out[m * V + v]);
  };
  int64_t m0 = 0;
  if constexpr (kSweeps<Group>)
    for (; m0 + kSweepRows <= rows; m0 += kSweepRows) rows_from.template operator()<kSweepRows>(m0);
  for_row_chunks<kGroupChunkRows<Group>>(
      rows - m0, [&](int64_t m, auto chunk) { rows_from.template operator()<decltype(chunk)::value>(m0 + m); });
}

// Vectors per tile on the widest lanes: two for Q8_0, whose unpacking is a xor, so that each broadcast
// of x serves 32 rows (benchmarks/RESULTS.md, "Sixteen rows per vector"); one for the types whose
// unpacked nibbles, offsets and scales fill the registers already.
template <typename Group>
constexpr int kWideVectors = std::is_same_v<Group, quant::RowGroup<quant::Q8_0>> ? 2 : 1;

// Every row of x over every group: the widest tiles first, then narrower ones for a thread's last
// groups; each thread takes whole tiles. The 512-bit vectors load their two groups' halves from two
// places and join them, which costs more than it saves while each tile meets x in one chunk of rows
// (its weights read once): below two chunks of rows, 256-bit tiles alone (benchmarks/RESULTS.md, "Sixteen
// rows per vector"). Gated (W = [gate; up], gate_groups = the groups of each half):
// y = silu(gate) * up; else gate_groups = 0 and y = x @ W^T. y has `columns` columns.
template <typename Group, typename Out>
void row_group_kernel(const uint8_t* w, int64_t group_bytes, const Activations& x, int64_t rows, Out* y, int64_t groups,
                      int64_t gate_groups) {
  const int64_t outputs = gate_groups > 0 ? gate_groups : groups, columns = outputs * Group::kRows;
#ifdef KVSERVE_HAS_GROUP_LANES16
  constexpr int64_t kTile = GroupLanes16::kGroups * kWideVectors<Group>;
  const bool wide = rows >= 2 * kRowChunk;
#else
  constexpr int64_t kTile = 1;
#endif
  split_work(rows, (outputs + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    const auto tile = [&]<typename L, int V>(int64_t g) {
      row_group_tile<Group, L, V>(w, group_bytes, x, rows, y, columns, g, gate_groups);
      return g + L::kGroups * V;
    };
    for (int64_t g = begin * kTile, last = std::min(end * kTile, outputs); g < last;) {
#ifdef KVSERVE_HAS_GROUP_LANES16
      if (wide && g + kTile <= last) {
        g = tile.template operator()<GroupLanes16, kWideVectors<Group>>(g);
        continue;
      }
      if (wide && g + GroupLanes16::kGroups <= last) {
        g = tile.template operator()<GroupLanes16, 1>(g);
        continue;
      }
#endif
      g = tile.template operator()<GroupLanes8, 1>(g);
    }
  });
}

}  // namespace
#endif

at::Tensor quant_gemv(at::Tensor x, at::Tensor blocks, int64_t type, bool gated) {
  RECORD_FUNCTION("kvserve::quant_gemv", {});  // named in torch profiler traces
#ifdef KVSERVE_HAS_QUANT_GEMV
  return quant::visit_kernel_type(type, [&](auto block) {
    using Block = decltype(block);
    constexpr int64_t kRows = quant::rows_per_stored_row<Block>();
    const int64_t k = quant::columns_of<Block>(blocks), rows = x.size(0), n = blocks.size(0) * kRows;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, ", k, "]");
    TORCH_CHECK(rows >= 1, "quant_gemv takes one row or more, got ", rows);
    TORCH_CHECK(!gated || n % 2 == 0, "a gated W = [gate; up] has an even number of rows, got ", n);
    // Row groups gate in the kernel where each half is whole groups; elsewhere silu_mul follows.
    const bool fused = kRows > 1 && gated && (n / 2) % kRows == 0;
    x = x.contiguous();
    auto y = at::empty({rows, fused ? n / 2 : n}, x.options());
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    KVSERVE_DISPATCH(x.scalar_type(), [&] {
      const Activations acts = quantize_int8(raw<scalar_t>(x), rows, k);
      if constexpr (kRows > 1)
        row_group_kernel<Block>(w, blocks.size(1), acts, rows, raw<scalar_t>(y), blocks.size(0),
                                fused ? blocks.size(0) / 2 : 0);
      else
        gemv_kernel<Block>(w, blocks.size(1), acts, rows, raw<scalar_t>(y), n);
    });
    return gated && !fused ? silu_mul(y) : y;
  });
#else
  TORCH_CHECK(false, "quant_gemv needs a CPU with AVX2, FMA and F16C");
#endif
}

}  // namespace kvserve
