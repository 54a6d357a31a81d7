// The elementwise steps of a decoder layer (the torch definitions: kvserve/model/layer_ops.py).
#include "common.h"
#include "ops.h"

namespace kvserve {

// residual += delta (if given); out = rms_norm(residual) * weight, rounded to out's dtype.
// residual: float32 [T, H], updated in place. delta, out: scalar_t [T, H]. weight: float32 [H].
template <typename T>
void add_rms_norm_kernel(float* residual, const T* delta, const float* weight, T* out, int64_t rows, int64_t hidden,
                         float eps) {
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
  RECORD_FUNCTION("kvserve::add_rms_norm", {});  // named in torch profiler traces
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
    add_rms_norm_kernel(residual.data_ptr<float>(), d, weight.data_ptr<float>(), raw<scalar_t>(out), rows, hidden,
                        static_cast<float>(eps));
  });
  return out;
}

// Rotary embedding (rotate-half layout) on the q and k heads of a fused qkv projection, in place,
// then k and v written to their cache slots. qkv: scalar_t [T, (Hq + 2 Hkv) * D], contiguous.
// cos, sin: float32 [max_len, D]. caches: scalar_t [num_slots, Hkv, D] views of one layer.
template <typename T>
void rope_write_kv_kernel(T* qkv, const int64_t* positions, const float* cos, const float* sin, T* k_cache, T* v_cache,
                          const int64_t* slots, int64_t rows, int64_t hq, int64_t hkv, int64_t dim) {
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
  RECORD_FUNCTION("kvserve::rope_write_kv", {});  // named in torch profiler traces
  const int64_t dim = cos.size(1);
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(1) == (hq + 2 * hkv) * dim,
              "qkv must be [T, (Hq+2Hkv)*D]");
  TORCH_CHECK(
      cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
      "cos/sin tables must be contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type(),
              "caches must be contiguous, in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
                  slots.is_contiguous(),
              "positions and slots must be contiguous int64");
  KVSERVE_DISPATCH(qkv.scalar_type(), [&] {
    rope_write_kv_kernel(raw<scalar_t>(qkv), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                         sin.data_ptr<float>(), raw<scalar_t>(k_cache), raw<scalar_t>(v_cache),
                         slots.data_ptr<int64_t>(), qkv.size(0), hq, hkv, dim);
  });
}

// out = silu(gate) * up, gate_up: scalar_t [T, 2I] (gate then up), out: [T, I].
template <typename T>
void silu_mul_row(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(gate[i]);
    out[i] = from_float<T>(silu_times(x, to_float(up[i])));
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
  RECORD_FUNCTION("kvserve::silu_mul", {});  // named in torch profiler traces
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  KVSERVE_DISPATCH(gate_up.scalar_type(),
                   [&] { silu_mul_kernel(raw<scalar_t>(gate_up), raw<scalar_t>(out), gate_up.size(0), inter); });
  return out;
}

}  // namespace kvserve
