// The kernels the extension exports (bindings.cpp); each is defined in the .cpp file named after it.
#pragma once

#include <torch/extension.h>

#include <array>
#include <vector>

namespace kvserve {

at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                        at::ScalarType out_dtype, c10::optional<at::Tensor> delta_weight = c10::nullopt);
void head_rms_norm(at::Tensor qkv, int64_t hq, int64_t hkv, at::Tensor q_weight, at::Tensor k_weight, double eps);
void rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                   at::Tensor v_cache, at::Tensor slots, int64_t hq, int64_t hkv);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_mul(at::Tensor gate_up);
at::Tensor argmax_rows(at::Tensor logits);
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                      at::Tensor seq_lens, at::Tensor cu_seqlens_q, at::Tensor seq_ids, double scale, int64_t window);
// Whether decode_attention may use the AMX kernel where it applies (the default); returns the previous
// setting. For tests and benchmarks that compare it with the AVX-512 kernel.
bool set_amx_attention(bool enabled);
// Whether decode_attention may use the AVX512-BF16 kernel where the build has it (the default); returns
// the previous setting. For tests and benchmarks that compare it with the widened float32 kernel.
bool set_bf16_attention(bool enabled);
// Whether decode_attention may use the AVX2 kernel where the build is the avx2 path's (the default); returns
// the previous setting. For tests and benchmarks that compare it with the widened float32 kernel.
bool set_avx2_attention(bool enabled);
// Whether decode_attention may split few decode rows' keys among the threads on the vector kernels
// (decode_attention_key_split.h; the default); returns the previous setting. For tests and benchmarks.
bool set_attention_key_split(bool enabled);
// Whether decode_attention runs q [T, Hq, D] over k_cache [blocks, block_size, Hkv, D] on the AMX
// kernel (dtype, head dim and block size allowed, AMX available and enabled; a windowed layer never
// does: see amx_decode_supported). That kernel also takes prefill rows (kvserve/kernels/attention_cpu.py).
bool amx_attention_applies(at::Tensor q, at::Tensor k_cache, int64_t window);
// Whether decode_attention runs q [T, Hq, D] over k_cache [blocks, block_size, Hkv, D] on the AVX512-BF16
// kernel where the AMX kernel does not (bf16, head dim a multiple of 32, built with AVX512-BF16 and enabled).
// That kernel takes short prefill rows too (kvserve/kernels/attention_cpu.py).
bool bf16_attention_applies(at::Tensor q, at::Tensor k_cache);
// Whether decode_attention runs q [T, Hq, D] on the AVX2 kernel where neither of the above does (the avx2 path's
// build, head dim a multiple of 32, enabled). That kernel takes short prefill rows too (attention_cpu.py).
bool avx2_attention_applies(at::Tensor q);
// Whether the widened float32 kernel, which takes the rest, scores q [T, Hq, D] on vectors (built with AVX2
// and FMA, head dim a multiple of 8). Only then does it take short prefill rows (attention_cpu.py): its
// scalar loops run them slower than SDPA.
bool widened_attention_vectorized(at::Tensor q);
// The most rows of x gemv_bf16 takes: past two rows oneDNN's packed kernels are as fast (the weight is
// no longer the only cost; figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
constexpr int64_t kGemvMaxRows = 2;
at::Tensor gemv_bf16(at::Tensor x, at::Tensor weight);
// x [M, K] @ W^T on AMX tiles, W packed by kvserve/model/linear.py's pack_tiles; bf16 in and out.
at::Tensor linear_amx(at::Tensor x, at::Tensor packed, bool gated);
// The same product on float32 FMAs or VDPBF16PS (AVX-512 or AVX2; set_tile_products), the same packed weight:
// CPUs without AMX.
at::Tensor linear_tiles_fma(at::Tensor x, at::Tensor packed, bool gated);
// Quantized weights: `blocks` uint8 [N, row_bytes] of GGML block type `type` (quant_blocks.h).
// Rows `ids` (int [T], each < N) of the matrix dequantized to float32 [T, K], exactly as
// gguf.quants.dequantize computes them; `type` a GGML type or a row-group type (quant_row_groups.h).
at::Tensor dequantize_rows(at::Tensor blocks, at::Tensor ids, int64_t type);
// x [M >= 1, K] (float32 or bf16) @ W^T on the blocks as they lie (GGML's layout or row groups,
// quant_row_groups.h), x quantized per 32 elements to int8 (not exact: see quant_gemv.cpp); y in x's dtype.
// `gated` (W = [gate; up]): silu(gate) * up, [M, N / 2], gated inside the kernel on row groups.
at::Tensor quant_gemv(at::Tensor x, at::Tensor blocks, int64_t type, bool gated = false);
// The most rows quant_product gives quant_gemv for blocks of GGML type (or row-group type) `type`.
int64_t int8_max_rows(int64_t type);
// x [M, K] (float32 or bf16) @ W^T for any M: W dequantized panel by panel into a float32 tile, then
// multiplied; y in x's dtype. bf16 x on a path with native bf16 products meets the panel dequantized
// straight into bf16 (each value rounded to nearest even). `gated` as quant_gemv's.
at::Tensor quant_linear(at::Tensor x, at::Tensor blocks, int64_t type, bool gated = false);
// The tile products without AMX (tiles_fma.h's Choice; all off until set: the process's probe,
// kvserve/model/linear.py, sets them with its choice): whether quant_linear multiplies bf16 x in the tiles'
// register blocks (`panels`, AVX-512), whether its chunks past 512 rows take linear_tiles_fma on W
// dequantized whole (`long_chunks`, AVX512-BF16), and whether the register blocks multiply on VDPBF16PS
// rather than widened float32 FMAs (`bf16_pairs`, where the build has AVX512-BF16: else it stays off).
void set_tile_products(bool panels, bool long_chunks, bool bf16_pairs);
// The settings as set: (panels, long_chunks, bf16_pairs).
std::tuple<bool, bool, bool> tile_products();
// x @ W^T as the model runs it (QuantizedLinear, decode_layers): quant_gemv up to kGemvMaxRows rows, or
// in a decode step (every row follows generated tokens: decode, verify, draft) up to int8_max_rows(type);
// else quant_linear. `gated` as quant_gemv's.
// Prefill steps stay exact: int8 activations there move the engine's greedy tokens off the dequantized
// engine's (benchmarks/RESULTS.md, "Row groups"), and the KV they write serves every later token; a
// decode step's rows each make one token, as batch 1's always have ("int8 decode batches").
at::Tensor quant_product(at::Tensor x, at::Tensor blocks, int64_t type, bool decode_step, bool gated = false);
// A model's tensors and shapes as decode_layers takes them, checked and indexed once when the model loads: a
// step then passes only its own rows, not the ~240 tensors converted from Python lists at every call (slow
// there because a step's weights have just streamed the interpreter's objects out of the caches:
// benchmarks/RESULTS.md, "The decode step's model converted once").
// `weights`: every projection's parts, layer by layer in the order a step runs them (qkv_proj,
// o_proj, gate_up_proj, down_proj); `parts`: per layer and projection its number of parts (more than one
// only for a fused quantized projection whose parts differ in block type: a product per part, columns
// concatenated); `norms`: per layer attn_norm, mlp_norm (float32).
// `tiles`: none, or per projection its weight packed for linear_amx (gate_up interleaved where the
// model gates with silu);
// `block_types`: none (every projection a bf16 matrix), or per part its GGML block type (or its row-group
// type), the part's tensor then its blocks (quant_product multiplies them).
// `extras`: none, or per layer its qkv bias (model dtype), q and k head norms, norms after attention and
// after the MLP (float32), in DecodeLayerExtra's order, each an empty tensor where the model has none (a
// layer with a q norm has a k norm too).
// `rope`: per layer its cos and sin tables (float32 [max_len, D]). `gelu_tanh`: the MLP gates with gelu
// (tanh approximation), not silu. `windows`: per layer its sliding window in keys, 0 for none.
// Invariant: the tensors are the model's own (shared storage, no copies).
constexpr int64_t kProjectionsPerLayer = 4;
// The extras of a layer, in decode_layers' order; bindings.cpp gives Python their names in the same order
// (DECODE_LAYER_EXTRAS: LlamaModel.layer_extras' keys), so the order is stated here alone.
enum DecodeLayerExtra : int64_t { kQkvBias, kQNorm, kKNorm, kPostAttnNorm, kPostMlpNorm, kExtrasPerLayer };
constexpr std::array<const char*, kExtrasPerLayer> kDecodeLayerExtraNames = {"qkv_bias", "q_norm", "k_norm",
                                                                             "post_attn_norm", "post_mlp_norm"};
struct DecodeModel {
  DecodeModel(std::vector<at::Tensor> weights, std::vector<int64_t> parts, std::vector<at::Tensor> norms,
              std::vector<at::Tensor> tiles, std::vector<int64_t> block_types, std::vector<at::Tensor> extras,
              at::Tensor final_norm, double eps, std::vector<at::Tensor> rope, double scale, int64_t hq, int64_t hkv,
              std::vector<int64_t> windows, bool gelu_tanh);

  std::vector<at::Tensor> weights, norms, tiles, extras, rope;
  std::vector<int64_t> parts, block_types, windows;
  std::vector<int64_t> first_part;  // per projection, its first index into weights
  at::Tensor final_norm;
  double eps, scale;
  int64_t num_layers, hq, hkv;
  bool gelu_tanh;
};
// The first `num_layers` layers of `model` over the rows h (float32 residuals, updated in place), every row a
// decode row (or a short prefill: `decode_step` is quant_product's, whether every row follows generated
// tokens), then the final norm; the activations are in the KV cache's dtype.
at::Tensor decode_layers(at::Tensor h, const DecodeModel& model, int64_t num_layers, at::Tensor positions,
                         at::Tensor kv_cache, at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor cu_seqlens_q, at::Tensor seq_ids, bool decode_step);

}  // namespace kvserve
