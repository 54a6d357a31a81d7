// The elementwise steps of a decoder layer (the torch definitions: kvserve/model/layer_ops.py).
#include "common.h"
#include "ops.h"

namespace kvserve {

// Each of `rows` rows of `hidden` floats scaled by 1 / rms(row) and by weight: out = f(i, x[i] * inv_rms * weight[i]).
template <typename Load, typename Store>
inline void rms_norm_row(Load x, Store out, const float* weight, int64_t hidden, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < hidden; ++i) sum_sq += x(i) * x(i);
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) out(i, x(i) * inv_rms * weight[i]);
}

// residual += delta (if given; first rms-normalized and times delta_weight where that is given: the
// norms after attention and MLP of Gemma 3), then out = rms_norm(residual) * weight, rounded to out's
// dtype. residual: float32 [T, H], updated in place. delta, out: scalar_t [T, H]. weights: float32 [H].
template <typename T>
void add_rms_norm_kernel(float* residual, const T* delta, const float* delta_weight, const float* weight, T* out,
                         int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t) {
      float* x = residual + t * hidden;
      const T* d = delta + t * hidden;
      if (delta_weight != nullptr) {
        rms_norm_row([=](int64_t i) { return to_float(d[i]); }, [=](int64_t i, float v) { x[i] += v; }, delta_weight,
                     hidden, eps);
      } else if (delta != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) x[i] += to_float(d[i]);
      }
      T* o = out + t * hidden;
      rms_norm_row([=](int64_t i) { return x[i]; }, [=](int64_t i, float v) { o[i] = from_float<T>(v); }, weight,
                   hidden, eps);
    }
  });
}

at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                        at::ScalarType out_dtype, c10::optional<at::Tensor> delta_weight) {
  RECORD_FUNCTION("kvserve::add_rms_norm", {});  // named in torch profiler traces
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 2,
              "residual must be a contiguous float32 [T, H] tensor");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  auto float_vector = [&](const at::Tensor& w, const char* name) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hidden, name,
                " must be contiguous float32 [H]");
    return w.data_ptr<float>();
  };
  const float* w = float_vector(weight, "weight");
  TORCH_CHECK(delta.has_value() || !delta_weight.has_value(), "delta_weight needs a delta");
  const float* dw = delta_weight.has_value() ? float_vector(*delta_weight, "delta_weight") : nullptr;
  auto out = at::empty(residual.sizes(), residual.options().dtype(out_dtype));
  KVSERVE_DISPATCH(out_dtype, [&] {
    const raw_t<scalar_t>* d = nullptr;
    if (delta.has_value()) {
      TORCH_CHECK(delta->scalar_type() == out_dtype && delta->is_contiguous() && delta->sizes() == residual.sizes(),
                  "delta must be contiguous, shaped like residual, in the output dtype");
      d = raw<scalar_t>(*delta);
    }
    add_rms_norm_kernel(residual.data_ptr<float>(), d, dw, w, raw<scalar_t>(out), rows, hidden,
                        static_cast<float>(eps));
  });
  return out;
}

// Each q and k head of a fused qkv projection rms-normalized over its D values in float32, q heads times
// q_weight, k heads times k_weight, in place (Qwen3's and Gemma 3's head norms). qkv: scalar_t
// [T, (Hq + 2 Hkv) * D], contiguous; weights float32 [D].
void head_rms_norm(at::Tensor qkv, int64_t hq, int64_t hkv, at::Tensor q_weight, at::Tensor k_weight, double eps) {
  RECORD_FUNCTION("kvserve::head_rms_norm", {});  // named in torch profiler traces
  const int64_t dim = q_weight.numel(), rows = qkv.size(0);
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(1) == (hq + 2 * hkv) * dim,
              "qkv must be [T, (Hq+2Hkv)*D] for D the norm weights' length");
  TORCH_CHECK(q_weight.scalar_type() == at::kFloat && k_weight.scalar_type() == at::kFloat &&
                  q_weight.is_contiguous() && k_weight.is_contiguous() && k_weight.numel() == dim,
              "q_weight and k_weight must be contiguous float32 [D]");
  const float *qw = q_weight.data_ptr<float>(), *kw = k_weight.data_ptr<float>();
  KVSERVE_DISPATCH(qkv.scalar_type(), [&] {
    using T = raw_t<scalar_t>;
    T* data = raw<scalar_t>(qkv);
    at::parallel_for(0, rows, 4, [=](int64_t begin, int64_t end) {
      const FlushDenormals ftz;
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < hq + hkv; ++h) {  // q heads then k heads: they sit back to back
          T* x = data + (t * (hq + 2 * hkv) + h) * dim;
          rms_norm_row([=](int64_t i) { return to_float(x[i]); }, [=](int64_t i, float v) { x[i] = from_float<T>(v); },
                       h < hq ? qw : kw, dim, static_cast<float>(eps));
        }
      }
    });
  });
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

// out = act(gate) * up for act_times (silu_times, gelu_tanh_times), gate_up: scalar_t [T, 2I] (gate then
// up), out: [T, I].
template <typename T, typename ActTimes>
void gated_kernel(const T* gate_up, T* out, int64_t rows, int64_t inter, ActTimes act_times) {
  at::parallel_for(0, rows, 4, [=](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    for (int64_t t = begin; t < end; ++t) {
      const T* __restrict gate = gate_up + t * 2 * inter;
      const T* __restrict up = gate + inter;
      T* __restrict o = out + t * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = from_float<T>(act_times(to_float(gate[i]), to_float(up[i])));
    }
  });
}

template <typename ActTimes>
at::Tensor gated(const at::Tensor& gate_up, ActTimes act_times) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  KVSERVE_DISPATCH(gate_up.scalar_type(), [&] {
    gated_kernel(raw<scalar_t>(gate_up), raw<scalar_t>(out), gate_up.size(0), inter, act_times);
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  RECORD_FUNCTION("kvserve::silu_mul", {});  // named in torch profiler traces
  return gated(gate_up, [](float gate, float up) { return silu_times(gate, up); });
}

at::Tensor gelu_tanh_mul(at::Tensor gate_up) {
  RECORD_FUNCTION("kvserve::gelu_tanh_mul", {});  // named in torch profiler traces
  return gated(gate_up, [](float gate, float up) { return gelu_tanh_times(gate, up); });
}

}  // namespace kvserve
