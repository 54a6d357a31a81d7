// All decoder layers of a decode step with one or two new tokens, in one call.
//
// At batch 1 the layer loop in Python (kvserve/model/llama.py, LlamaModel.forward) cost ~3 ms of a
// ~17 ms step in interpreter and dispatch overhead around ~210 kernel calls. This is the same loop,
// calling the same kernels in the same order (so its result is bit-identical), from C++. It runs
// only where every linear is the bf16 GEMV and every sequence takes the decode attention kernel.
#include "common.h"
#include "ops.h"

namespace kvserve {

at::Tensor decode_layers(at::Tensor h, std::vector<at::Tensor> layers, at::Tensor final_norm, double eps,
                         at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache, at::Tensor slots,
                         at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cu_seqlens_q, at::Tensor seq_ids,
                         double scale, int64_t hq, int64_t hkv) {
  RECORD_FUNCTION("kvserve::decode_layers", {});  // named in torch profiler traces
  TORCH_CHECK(!layers.empty() && layers.size() % kTensorsPerLayer == 0, "layers must hold ", kTensorsPerLayer,
              " tensors per layer");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be [layers, 2, blocks, block, Hkv, D]");
  const int64_t num_layers = static_cast<int64_t>(layers.size()) / kTensorsPerLayer;
  const int64_t t = h.size(0), dim = cos.size(1), q_size = hq * dim;
  const auto dtype = layers[0].scalar_type();
  // Per layer: qkv_proj, o_proj, gate_up_proj, down_proj weights, then attn_norm, mlp_norm (float32).
  auto weight = [&](int64_t layer, int64_t which) -> const at::Tensor& { return layers[layer * kTensorsPerLayer + which]; };
  at::Tensor x = add_rms_norm(h, c10::nullopt, weight(0, 4), eps, dtype);
  for (int64_t i = 0; i < num_layers; ++i) {
    at::Tensor qkv = gemv_bf16(x, weight(i, 0));
    const at::Tensor layer_cache = kv_cache.select(0, i);
    const at::Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
    rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, hq, hkv);
    at::Tensor o = at::empty({t, hq, dim}, qkv.options());
    decode_attention(o, qkv.narrow(1, 0, q_size).view({t, hq, dim}), k_cache, v_cache, block_tables, seq_lens,
                     cu_seqlens_q, seq_ids, scale);
    x = add_rms_norm(h, gemv_bf16(o.view({t, q_size}), weight(i, 1)), weight(i, 5), eps, dtype);
    const at::Tensor& next_norm = i + 1 < num_layers ? weight(i + 1, 4) : final_norm;
    x = add_rms_norm(h, gemv_bf16(silu_mul(gemv_bf16(x, weight(i, 2))), weight(i, 3)), next_norm, eps, dtype);
  }
  return x;
}

}  // namespace kvserve
