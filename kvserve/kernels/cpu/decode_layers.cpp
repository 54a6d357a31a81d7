// All decoder layers of a decode step, in one call.
//
// At batch 1 the layer loop in Python (kvserve/model/llama.py, LlamaModel.forward) spends a good part of
// a step in interpreter and dispatch overhead around ~210 kernel calls (figures:
// benchmarks/RESULTS.md, "Figures behind the code's rules"). This is the same loop,
// calling the same kernels in the same order (so its result is bit-identical), from C++. It runs
// only where every linear is a bf16 KernelLinear (kvserve/model/linear.py) or every linear a
// QuantizedLinear (quantized_linear.py), and every sequence takes the decode attention kernel: bf16 up
// to kGemvMaxRows rows on the GEMV, more (batched decode, up to linear.py's AMX_MAX_ROWS, which the
// caller checks) on the packed tiles (linear_amx, or linear_tiles_fma without AMX); blocks on
// quant_product, as QuantizedLinear does in a decode step (kvserve/model/quantized_linear.py).
#include "amx.h"
#include "ops.h"

namespace kvserve {
namespace {

// x @ W^T as KernelLinear / QuantizedLinear compute it: W in blocks of `block_type` (>= 0) on
// quant_product; a bf16 W on the GEMV up to kGemvMaxRows rows,
// then the packed `tiles` on linear_amx, or on linear_tiles_fma where the CPU has no AMX. `gated` (W = [gate;
// up]): silu(gate) * up.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* tiles, int64_t block_type,
                   bool gated, bool decode_step) {
  if (block_type >= 0) return quant_product(x, weight, block_type, decode_step, gated);
  if (x.size(0) <= kGemvMaxRows) {
    const at::Tensor y = gemv_bf16(x, weight);
    return gated ? silu_mul(y) : y;
  }
  TORCH_CHECK(tiles != nullptr, "decode_layers takes more than ", kGemvMaxRows, " bf16 rows only with packed tiles");
  return amx_permitted() ? linear_amx(x.contiguous(), *tiles, gated) : linear_tiles_fma(x, *tiles, gated);
}

}  // namespace

at::Tensor decode_layers(at::Tensor h, std::vector<at::Tensor> layers, std::vector<at::Tensor> tiles,
                         std::vector<int64_t> block_types, at::Tensor final_norm, double eps, at::Tensor positions,
                         at::Tensor cos, at::Tensor sin, at::Tensor kv_cache, at::Tensor slots, at::Tensor block_tables,
                         at::Tensor seq_lens, at::Tensor cu_seqlens_q, at::Tensor seq_ids, double scale, int64_t hq,
                         int64_t hkv, std::vector<int64_t> windows, bool decode_step) {
  RECORD_FUNCTION("kvserve::decode_layers", {});  // named in torch profiler traces
  TORCH_CHECK(!layers.empty() && layers.size() % kTensorsPerLayer == 0, "layers must hold ", kTensorsPerLayer,
              " tensors per layer");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be [layers, 2, blocks, block, Hkv, D]");
  const int64_t num_layers = static_cast<int64_t>(layers.size()) / kTensorsPerLayer;
  TORCH_CHECK(tiles.empty() || static_cast<int64_t>(tiles.size()) >= num_layers * kTilesPerLayer,
              "tiles must be empty or hold ", kTilesPerLayer, " per layer");
  TORCH_CHECK(block_types.empty() || static_cast<int64_t>(block_types.size()) >= num_layers * kTilesPerLayer,
              "block_types must be empty or hold one per projection");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) >= num_layers, "windows must hold one per layer (0: none)");
  const int64_t t = h.size(0), dim = cos.size(1), q_size = hq * dim;
  const auto dtype = kv_cache.scalar_type();
  // Per layer: qkv_proj, o_proj, gate_up_proj, down_proj weights, then attn_norm, mlp_norm (float32).
  auto weight = [&](int64_t layer, int64_t which) -> const at::Tensor& {
    return layers[layer * kTensorsPerLayer + which];
  };
  // Product `which` (0-3, the order of `layers`) of a layer, on its tiles where they were given.
  auto product = [&](const at::Tensor& x, int64_t layer, int64_t which) {
    const at::Tensor* packed = tiles.empty() ? nullptr : &tiles[layer * kTilesPerLayer + which];
    const int64_t block_type = block_types.empty() ? -1 : block_types[layer * kTilesPerLayer + which];
    return project(x, weight(layer, which), packed, block_type, which == 2, decode_step);
  };
  at::Tensor x = add_rms_norm(h, c10::nullopt, weight(0, 4), eps, dtype);
  for (int64_t i = 0; i < num_layers; ++i) {
    at::Tensor qkv = product(x, i, 0);
    const at::Tensor layer_cache = kv_cache.select(0, i);
    const at::Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
    rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, hq, hkv);
    at::Tensor o = at::empty({t, hq, dim}, qkv.options());
    decode_attention(o, qkv.narrow(1, 0, q_size).view({t, hq, dim}), k_cache, v_cache, block_tables, seq_lens,
                     cu_seqlens_q, seq_ids, scale, windows[i]);
    x = add_rms_norm(h, product(o.view({t, q_size}), i, 1), weight(i, 5), eps, dtype);
    const at::Tensor& next_norm = i + 1 < num_layers ? weight(i + 1, 4) : final_norm;
    x = add_rms_norm(h, product(product(x, i, 2), i, 3), next_norm, eps, dtype);
  }
  return x;
}

}  // namespace kvserve
