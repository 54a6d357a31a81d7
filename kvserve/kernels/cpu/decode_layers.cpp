// All decoder layers of a decode step, in one call.
//
// At batch 1 the layer loop in Python (kvserve/model/llama.py, LlamaModel.forward) spends a good part of
// a step in interpreter and dispatch overhead around ~210 kernel calls (figures:
// benchmarks/RESULTS.md, "Figures behind the code's rules"). This is the same loop,
// calling the same kernels in the same order (so its result is bit-identical), from C++. It runs
// only where every linear is a bf16 KernelLinear (kvserve/model/linear.py) or every linear a
// QuantizedLinear (quantized_linear.py), and every sequence takes the decode attention kernel; the layer's
// extras (q/k/v bias, head norms, norms after attention and MLP, gelu gating, a RoPE table per layer)
// where the model has them, as the Python loop applies them: bf16 up
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

DecodeModel::DecodeModel(std::vector<at::Tensor> weights_, std::vector<int64_t> parts_, std::vector<at::Tensor> norms_,
                         std::vector<at::Tensor> tiles_, std::vector<int64_t> block_types_,
                         std::vector<at::Tensor> extras_, at::Tensor final_norm_, double eps_,
                         std::vector<at::Tensor> rope_, double scale_, int64_t hq_, int64_t hkv_,
                         std::vector<int64_t> windows_, bool gelu_tanh_)
    : weights(std::move(weights_)),
      norms(std::move(norms_)),
      tiles(std::move(tiles_)),
      extras(std::move(extras_)),
      rope(std::move(rope_)),
      parts(std::move(parts_)),
      block_types(std::move(block_types_)),
      windows(std::move(windows_)),
      first_part(parts.size()),
      final_norm(std::move(final_norm_)),
      eps(eps_),
      scale(scale_),
      num_layers(static_cast<int64_t>(parts.size()) / kProjectionsPerLayer),
      hq(hq_),
      hkv(hkv_),
      gelu_tanh(gelu_tanh_) {
  TORCH_CHECK(!parts.empty() && parts.size() % kProjectionsPerLayer == 0, "parts must hold ", kProjectionsPerLayer,
              " counts per layer");
  int64_t num_parts = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    TORCH_CHECK(parts[p] >= 1, "every projection has a part");
    first_part[p] = num_parts;
    num_parts += parts[p];
  }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_parts, "weights must hold every projection's parts");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * num_layers, "norms must hold two per layer");
  TORCH_CHECK(tiles.empty() || (static_cast<int64_t>(tiles.size()) == num_layers * kProjectionsPerLayer &&
                                num_parts == num_layers * kProjectionsPerLayer),
              "tiles must be empty or hold one per projection, each of one part");
  TORCH_CHECK(block_types.empty() || static_cast<int64_t>(block_types.size()) == num_parts,
              "block_types must be empty or hold one per part");
  TORCH_CHECK(extras.empty() || static_cast<int64_t>(extras.size()) == num_layers * kExtrasPerLayer,
              "extras must be empty or hold ", kExtrasPerLayer, " per layer");
  TORCH_CHECK(static_cast<int64_t>(rope.size()) == 2 * num_layers, "rope must hold cos and sin tables per layer");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == num_layers, "windows must hold one per layer (0: none)");
  for (int64_t layer = 0; layer < num_layers && !extras.empty(); ++layer) {
    const at::Tensor* own = &extras[layer * kExtrasPerLayer];
    TORCH_CHECK(own[kQNorm].numel() == 0 || own[kKNorm].numel() > 0, "layer ", layer,
                " has a q head norm but no k head norm");
  }
}

at::Tensor decode_layers(at::Tensor h, const DecodeModel& model, int64_t num_layers, at::Tensor positions,
                         at::Tensor kv_cache, at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor cu_seqlens_q, at::Tensor seq_ids, bool decode_step) {
  RECORD_FUNCTION("kvserve::decode_layers", {});  // named in torch profiler traces
  TORCH_CHECK(num_layers >= 1 && num_layers <= model.num_layers, "num_layers must be 1 to ", model.num_layers);
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be [layers, 2, blocks, block, Hkv, D]");
  const auto &weights = model.weights, &norms = model.norms, &tiles = model.tiles, &extras = model.extras;
  const auto &parts = model.parts, &block_types = model.block_types, &first_part = model.first_part;
  const int64_t t = h.size(0), hq = model.hq, hkv = model.hkv, dim = model.rope[0].size(1), q_size = hq * dim;
  const double eps = model.eps;
  const bool gelu_tanh = model.gelu_tanh;
  const auto dtype = kv_cache.scalar_type();
  // Extra `which` (ops.h's order) of a layer where the model has it.
  auto extra = [&](int64_t layer, int64_t which) -> c10::optional<at::Tensor> {
    if (extras.empty() || extras[layer * kExtrasPerLayer + which].numel() == 0) return c10::nullopt;
    return extras[layer * kExtrasPerLayer + which];
  };
  // Product `which` (0-3: qkv, o, gate_up, down) of a layer: each part's product, on the projection's tiles
  // where they were given, columns concatenated. gate_up is gated inside a lone part's product where the
  // model gates with silu (the product kernels gate with silu only), else after the products.
  auto product = [&](const at::Tensor& x, int64_t layer, int64_t which) {
    const int64_t projection = layer * kProjectionsPerLayer + which, first = first_part[projection];
    const bool gate_up = which == 2, gated_in_product = gate_up && !gelu_tanh && parts[projection] == 1;
    auto part_product = [&](int64_t part, bool gated) {
      const at::Tensor* packed = tiles.empty() ? nullptr : &tiles[projection];
      const int64_t block_type = block_types.empty() ? -1 : block_types[part];
      return project(x, weights[part], packed, block_type, gated, decode_step);
    };
    at::Tensor y;
    if (parts[projection] == 1) {
      y = part_product(first, gated_in_product);
    } else {
      std::vector<at::Tensor> columns;
      for (int64_t part = first; part < first + parts[projection]; ++part) columns.push_back(part_product(part, false));
      y = at::cat(columns, 1);
    }
    if (!gate_up || gated_in_product) return y;
    return gelu_tanh ? gelu_tanh_mul(y) : silu_mul(y);
  };
  at::Tensor x = add_rms_norm(h, c10::nullopt, norms[0], eps, dtype);
  for (int64_t i = 0; i < num_layers; ++i) {
    at::Tensor qkv = product(x, i, 0);
    if (const auto bias = extra(i, kQkvBias)) qkv.add_(*bias);
    if (const auto q_norm = extra(i, kQNorm)) head_rms_norm(qkv, hq, hkv, *q_norm, *extra(i, kKNorm), eps);
    const at::Tensor layer_cache = kv_cache.select(0, i);
    const at::Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
    rope_write_kv(qkv, positions, model.rope[2 * i], model.rope[2 * i + 1], k_cache, v_cache, slots, hq, hkv);
    at::Tensor o = at::empty({t, hq, dim}, qkv.options());
    decode_attention(o, qkv.narrow(1, 0, q_size).view({t, hq, dim}), k_cache, v_cache, block_tables, seq_lens,
                     cu_seqlens_q, seq_ids, model.scale, model.windows[i]);
    x = add_rms_norm(h, product(o.view({t, q_size}), i, 1), norms[2 * i + 1], eps, dtype, extra(i, kPostAttnNorm));
    const at::Tensor& next_norm = i + 1 < num_layers ? norms[2 * (i + 1)] : model.final_norm;
    x = add_rms_norm(h, product(product(x, i, 2), i, 3), next_norm, eps, dtype, extra(i, kPostMlpNorm));
  }
  return x;
}

}  // namespace kvserve
