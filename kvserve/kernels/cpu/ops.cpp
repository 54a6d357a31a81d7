// Fused CPU kernels for the forward pass: each replaces a chain of small torch ops whose per-call
// overhead, not arithmetic, dominated a decode step (see kvserve/kernels/cpu/__init__.py for the
// torch reference each one must match, and tests/test_cpu_ops.py for the comparison).
//
// Parallel loops capture by value: a by-reference capture is reloaded through the closure on every
// iteration (the stores might alias it), which stops GCC from vectorizing the loop.
//
// Conventions: activations are float32 or bfloat16 (the model dtype, `scalar_t`); all arithmetic is
// float32 and each result is rounded once. Compiled with -ffp-contract=off so that a*b+c is not fused
// into an FMA: in float32 the kernels then round like the torch ops they replace.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The model dtypes: float32 and bfloat16 (anything else is refused with an error naming the dtype).
#define KVSERVE_DISPATCH(dtype, ...) \
  AT_DISPATCH_SWITCH(dtype, "kvserve_cpu_ops", AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                                   AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace {

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

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16_bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bf16_bits) << 16);
}

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

// Flush-to-zero and denormals-are-zero for the current thread while a kernel runs, restored after.
// Measured: silu_mul over 64 x 1536 floats took 360 us with denormal handling on and 44 us with it
// off, on this CPU (microcode assists on the masked vector paths). Values below 1e-38 do not matter
// to any result here.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
};

// exp(x) by Cephes' range reduction and degree-6 polynomial (relative error ~2e-7), branch-free so
// that loops over it vectorize. Inputs are clamped to [-87.3, 88.3]: below, the result is ~1e-38
// (callers treat it as 0; scores of masked keys never reach here), above, float32 overflows anyway.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // not std::min/fmin: those block vectorizing
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// ---------------------------------------------------------------------------------------------
// residual += delta (if given); out = rms_norm(residual) * weight, rounded to out's dtype.
// residual: float32 [T, H], updated in place. delta, out: scalar_t [T, H]. weight: float32 [H].
template <typename T>
void add_rms_norm_kernel(float* residual, const T* delta, const float* weight, T* out, int64_t rows,
                         int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t) {
      float* x = residual + t * hidden;
      if (delta != nullptr) {
        const T* d = delta + t * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) x[i] += to_float(d[i]);
      }
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) sum_sq += x[i] * x[i];
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
      T* o = out + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = from_float<T>(x[i] * inv_rms * weight[i]);
    }
  });
}

at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                        at::ScalarType out_dtype) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 2,
              "residual must be a contiguous float32 [T, H] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous float32");
  auto out = at::empty(residual.sizes(), residual.options().dtype(out_dtype));
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  KVSERVE_DISPATCH(out_dtype, [&] {
    const raw_t<scalar_t>* d = nullptr;
    if (delta.has_value()) {
      TORCH_CHECK(delta->scalar_type() == out_dtype && delta->is_contiguous() && delta->sizes() == residual.sizes(),
                  "delta must be contiguous, shaped like residual, in the output dtype");
      d = raw<scalar_t>(*delta);
    }
    add_rms_norm_kernel(residual.data_ptr<float>(), d, weight.data_ptr<float>(), raw<scalar_t>(out),
                                  rows, hidden, static_cast<float>(eps));
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding (rotate-half layout) on the q and k heads of a fused qkv projection, in place,
// then k and v written to their cache slots. qkv: scalar_t [T, (Hq + 2 Hkv) * D], contiguous.
// cos, sin: float32 [max_len, D]. caches: scalar_t [num_slots, Hkv, D] views of one layer.
template <typename T>
void rope_write_kv_kernel(T* qkv, const int64_t* positions, const float* cos, const float* sin,
                          T* k_cache, T* v_cache, const int64_t* slots, int64_t rows, int64_t hq,
                          int64_t hkv, int64_t dim) {
  const int64_t half = dim / 2, row_len = (hq + 2 * hkv) * dim;
  at::parallel_for(0, rows, 8, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_len;
      const float* __restrict c = cos + positions[t] * dim;
      const float* __restrict s = sin + positions[t] * dim;
      for (int64_t h = 0; h < hq + hkv; ++h) {  // q heads then k heads: they sit back to back
        T* __restrict x1 = row + h * dim;
        T* __restrict x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]);
          x1[i] = from_float<T>(a * c[i] - b * s[i]);
          x2[i] = from_float<T>(b * c[i + half] + a * s[i + half]);
        }
      }
      const int64_t kv_len = hkv * dim;
      std::memcpy(k_cache + slots[t] * kv_len, row + hq * dim, kv_len * sizeof(T));
      std::memcpy(v_cache + slots[t] * kv_len, row + (hq + hkv) * dim, kv_len * sizeof(T));
    }
  });
}

void rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                   at::Tensor v_cache, at::Tensor slots, int64_t hq, int64_t hkv) {
  const int64_t dim = cos.size(1);
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(1) == (hq + 2 * hkv) * dim, "qkv must be [T, (Hq+2Hkv)*D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "cos/sin tables must be contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type(), "caches must be contiguous, in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
                  slots.is_contiguous(), "positions and slots must be contiguous int64");
  KVSERVE_DISPATCH(qkv.scalar_type(), [&] {
    rope_write_kv_kernel(raw<scalar_t>(qkv), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                         sin.data_ptr<float>(), raw<scalar_t>(k_cache), raw<scalar_t>(v_cache),
                                   slots.data_ptr<int64_t>(), qkv.size(0), hq, hkv, dim);
  });
}

// ---------------------------------------------------------------------------------------------
// out = silu(gate) * up, gate_up: scalar_t [T, 2I] (gate then up), out: [T, I].
template <typename T>
void silu_mul_row(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(gate[i]);
    out[i] = from_float<T>(x / (1.f + fast_exp(-x)) * to_float(up[i]));
  }
}

template <typename T>
void silu_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t) {
      silu_mul_row(gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, out + t * inter, inter);
    }
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  KVSERVE_DISPATCH(gate_up.scalar_type(), [&] {
    silu_mul_kernel(raw<scalar_t>(gate_up), raw<scalar_t>(out), gate_up.size(0), inter);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Tiled attention (FlashAttention's online softmax) for sequences with few new tokens, reading K/V
// straight from the paged cache: one work item per sequence holds the softmax state (m, l, acc) of
// all its query rows -- every new token times every query head -- and folds in one tile of kTile
// keys at a time, so each K/V row is read and widened once and no score matrix or gathered copy
// exists. Causal: the query at position p sees keys 0..p.
//
// q: [T, Hq, D], last dim contiguous (any row stride). caches: [num_blocks, block_size, Hkv, D]
// contiguous. block_tables [B, W], seq_lens [B], cu_seqlens_q [B+1]: int64 (kernels/metadata.py).
// seq_ids: which sequences to process. out: [>= T, Hq, D] contiguous; only their rows are written.
constexpr int64_t kTile = 16;

struct DecodeProblem {
  int64_t hq, hkv, dim, block_size, q_row_stride, q_head_stride, table_width;
  const int64_t *tables, *seq_lens, *cu_seqlens_q, *seq_ids;
  int64_t num_seqs;
  float scale;
};

// a . b over n floats. GCC vectorizes a plain reduction loop but finishes it with sixteen dependent
// scalar adds from the stack; with AVX-512 the sum ends in a shuffle tree instead (3x faster here).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Folds one tile of `visible` keys (K and V widened to float32, [kTile, dim]) into one query row's
// softmax state (m, l, acc): the max grows to m_new and the old sums are rescaled by exp(m - m_new).
inline void fold_tile(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                      int64_t visible, int64_t dim, float& m, float& l, float* __restrict acc) {
  float scores[kTile];
  float tile_max = -1e30f;
  for (int64_t j = 0; j < visible; ++j) {
    scores[j] = dot(q, k + j * dim, dim);
    tile_max = scores[j] > tile_max ? scores[j] : tile_max;
  }
  const float m_new = m > tile_max ? m : tile_max;
  const float alpha = fast_exp(m - m_new);
  float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
  for (int64_t j = 0; j < visible; ++j) {
    scores[j] = fast_exp(scores[j] - m_new);
    tile_sum += scores[j];
  }
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) acc[i] *= alpha;
  for (int64_t j = 0; j < visible; ++j) {
    const float pj = scores[j];
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) acc[i] += pj * v[j * dim + i];
  }
  l = l * alpha + tile_sum;
  m = m_new;
}

template <typename T>
void decode_attention_kernel(const DecodeProblem& p, const T* q, const T* k_cache, const T* v_cache, T* out) {
  const int64_t dim = p.dim, hq = p.hq, hkv = p.hkv, group = hq / hkv, key_len = hkv * dim;
  at::parallel_for(0, p.num_seqs, 1, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    std::vector<float> qf, acc, m, l, kf(hkv * kTile * dim, 0.f), vf(hkv * kTile * dim, 0.f);
    std::vector<int64_t> last_key;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = p.seq_ids[item];
      const int64_t row0 = p.cu_seqlens_q[seq], qlen = p.cu_seqlens_q[seq + 1] - row0, slen = p.seq_lens[seq];
      const int64_t nrows = qlen * hq;  // row r: token r / hq, query head r % hq (KV head (r % hq) / group)
      qf.resize(nrows * dim);
      acc.assign(nrows * dim, 0.f);
      m.assign(nrows, -1e30f);  // a finite floor: exp(m_old - m_new) never sees (-inf) - (-inf)
      l.assign(nrows, 0.f);
      last_key.resize(nrows);
      for (int64_t r = 0; r < nrows; ++r) {
        const T* src = q + (row0 + r / hq) * p.q_row_stride + (r % hq) * p.q_head_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) qf[r * dim + i] = to_float(src[i]) * p.scale;
        last_key[r] = slen - qlen + r / hq;  // causal: the row sees keys 0 .. its own position
      }
      const int64_t* table = p.tables + seq * p.table_width;
      // Tiles of up to kTile keys inside one cache block, so no key index is divided per key. A tile
      // of all KV heads is one contiguous run of the cache, read once for every query head.
      for (int64_t block_start = 0; block_start < slen; block_start += p.block_size) {
        const int64_t block_base = table[block_start / p.block_size] * p.block_size;
        const int64_t block_keys = std::min(p.block_size, slen - block_start);
        for (int64_t tile = 0; tile < block_keys; tile += kTile) {
          const int64_t kv_start = block_start + tile, nkeys = std::min(kTile, block_keys - tile);
          const T* __restrict ks = k_cache + (block_base + tile) * key_len;
          const T* __restrict vs = v_cache + (block_base + tile) * key_len;
          // Widen to float32 and regroup [key, head, d] -> [head, key, d].
          for (int64_t j = 0; j < nkeys; ++j) {
            for (int64_t h = 0; h < hkv; ++h) {
              float* __restrict kd = &kf[(h * kTile + j) * dim];
              float* __restrict vd = &vf[(h * kTile + j) * dim];
              const int64_t at = j * key_len + h * dim;
#pragma omp simd
              for (int64_t i = 0; i < dim; ++i) {
                kd[i] = to_float(ks[at + i]);
                vd[i] = to_float(vs[at + i]);
              }
            }
          }
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t visible = std::min(nkeys, last_key[r] - kv_start + 1);
            if (visible <= 0) continue;
            const int64_t h = (r % hq) / group;
            fold_tile(&qf[r * dim], &kf[h * kTile * dim], &vf[h * kTile * dim], visible, dim, m[r], l[r], &acc[r * dim]);
          }
        }
      }
      for (int64_t r = 0; r < nrows; ++r) {
        T* dst = out + (row0 * hq + r) * dim;  // rows of one sequence are consecutive in out
        const float inv = 1.f / l[r];  // l >= 1: every row sees key 0 and its own max term exp(0)
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) dst[i] = from_float<T>(acc[r * dim + i] * inv);
      }
    }
  });
}

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, at::Tensor cu_seqlens_q, at::Tensor seq_ids, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, caches and out must share one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head counts or dims disagree");
  TORCH_CHECK(out.is_contiguous() && out.size(1) == q.size(1) && out.size(2) == q.size(2) && out.size(0) >= q.size(0),
              "out must be contiguous [>= T, Hq, D]");
  for (const auto& t : {block_tables, seq_lens, cu_seqlens_q, seq_ids}) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "index tensors must be contiguous int64");
  }
  const DecodeProblem problem{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), q.stride(0), q.stride(1),
                              block_tables.size(1), block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                              cu_seqlens_q.data_ptr<int64_t>(), seq_ids.data_ptr<int64_t>(), seq_ids.size(0),
                              static_cast<float>(scale)};
  KVSERVE_DISPATCH(q.scalar_type(), [&] {
    decode_attention_kernel(problem, raw<scalar_t>(q), raw<scalar_t>(k_cache), raw<scalar_t>(v_cache),
                            raw<scalar_t>(out));
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; rms_norm(residual) * weight in out_dtype");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q,k of a fused qkv in place; k,v written to cache slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("decode_attention", &decode_attention, "online-softmax attention over the paged cache, few-token rows");
}
