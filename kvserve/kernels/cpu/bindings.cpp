// The Python module: one entry per kernel in ops.h, and amx_available (amx.h).
#include <optional>
#include <type_traits>

#include "amx.h"
#include "ops.h"
#include "tiles_fma.h"

namespace {

// A kernel that runs without the GIL when its first argument has more than kGemvMaxRows rows. A kernel
// reads and writes only the tensors it is given (pybind11 converts them before the GIL is released and
// the result after it is taken back), so meanwhile the server's HTTP thread runs Python: it parses and
// admits requests and encodes the last step's tokens while a decode batch or a prefill chunk computes,
// instead of after it. Calls over fewer rows (a batch-1 step, its LM head) keep the GIL: each release lets
// the HTTP thread take the GIL while the engine thread then waits to resume. That holds for decode_layers
// too, a whole step of a few milliseconds: released at every row count, it made batch 1 no faster and
// decode under Poisson arrivals slower, served. Figures: benchmarks/RESULTS.md, "The GIL released for long
// calls" and "Zen 4 again".
template <auto Kernel>
struct WithoutGilWhenLong;

template <typename Result, typename First, typename... Rest, Result (*Kernel)(First, Rest...)>
struct WithoutGilWhenLong<Kernel> {
  static_assert(std::is_same_v<std::decay_t<First>, at::Tensor>, "the first argument gives the rows");
  static Result call(First first, Rest... rest) {
    std::optional<py::gil_scoped_release> released;
    if (first.dim() > 0 && first.size(0) > kvserve::kGemvMaxRows) released.emplace();
    return Kernel(std::move(first), std::move(rest)...);
  }
};

template <auto Kernel>
constexpr auto without_gil_when_long = &WithoutGilWhenLong<Kernel>::call;

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace kvserve;
  m.def("add_rms_norm", without_gil_when_long<&add_rms_norm>,
        "residual += delta (rms_norm(delta) * delta_weight where given); rms_norm(residual) * weight in out_dtype",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("out_dtype"),
        py::arg("delta_weight") = py::none());
  m.def("head_rms_norm", without_gil_when_long<&head_rms_norm>,
        "each q and k head of a fused qkv rms-normalized in place");
  m.def("rope_write_kv", without_gil_when_long<&rope_write_kv>,
        "RoPE on q,k of a fused qkv in place; k,v written to cache slots");
  m.def("silu_mul", without_gil_when_long<&silu_mul>, "silu(gate) * up");
  m.def("gelu_tanh_mul", without_gil_when_long<&gelu_tanh_mul>, "gelu(gate, tanh approximation) * up");
  m.def("argmax_rows", without_gil_when_long<&argmax_rows>,
        "first maximal index of each row (NaN counts as the maximum)");
  m.def("decode_attention", without_gil_when_long<&decode_attention>,
        "online-softmax attention over the paged cache, few-token rows");
  m.def("set_amx_attention", &set_amx_attention,
        "allow decode_attention's AMX kernel (default); returns the old value");
  m.def("set_bf16_attention", &set_bf16_attention,
        "allow decode_attention's AVX512-BF16 kernel (default); returns the old value");
  m.def("set_avx2_attention", &set_avx2_attention,
        "allow decode_attention's AVX2 kernel (default); returns the old value");
  m.def("set_attention_key_split", &set_attention_key_split,
        "allow decode_attention to split few decode rows' keys among the threads (default); returns the old value");
  m.def("amx_available", &amx_permitted, "whether the AMX kernels (attention, linear_amx) can run here");
  m.def("amx_attention_applies", &amx_attention_applies, "whether decode_attention runs these q/cache on AMX");
  m.def("bf16_attention_applies", &bf16_attention_applies,
        "whether decode_attention runs these q/cache on AVX512-BF16 where AMX does not apply");
  m.def("avx2_attention_applies", &avx2_attention_applies,
        "whether decode_attention runs these q on the AVX2 kernel where AMX and AVX512-BF16 do not");
  m.def("widened_attention_vectorized", &widened_attention_vectorized,
        "whether decode_attention's widened float32 kernel scores these q on vectors");
  m.def("gemv_bf16", without_gil_when_long<&gemv_bf16>,
        "x @ weight.T for a few bf16 rows, at the memory bandwidth of the weight");
  m.attr("GEMV_MAX_ROWS") = kGemvMaxRows;
  py::tuple extras(kDecodeLayerExtraNames.size());
  for (size_t i = 0; i < kDecodeLayerExtraNames.size(); ++i) extras[i] = kDecodeLayerExtraNames[i];
  m.attr("DECODE_LAYER_EXTRAS") = extras;
  m.def("linear_amx", without_gil_when_long<&linear_amx>,
        "x @ W.T on AMX tiles, W in the packed tile layout (bf16); gated: silu(gate) * up", py::arg("x"),
        py::arg("packed"), py::arg("gated") = false);
  m.def("linear_tiles_fma", without_gil_when_long<&linear_tiles_fma>,
        "linear_amx's product on float32 FMAs or VDPBF16PS (AVX-512 or AVX2), same packed W", py::arg("x"),
        py::arg("packed"), py::arg("gated") = false);
  m.def("dequantize_rows", &dequantize_rows, "rows ids of a matrix in GGUF blocks or row groups -> float32 [T, K]");
  m.def("quant_gemv", without_gil_when_long<&quant_gemv>,
        "x @ W.T, W in GGUF blocks or row groups read once; x quantized per 32 to int8", py::arg("x"),
        py::arg("blocks"), py::arg("type"), py::arg("gated") = false);
  m.def("int8_max_rows", &int8_max_rows, "the most rows quant_product gives quant_gemv for this block type");
  m.def("quant_linear", without_gil_when_long<&quant_linear>,
        "x @ W.T for any rows, W in GGUF blocks dequantized panel by panel", py::arg("x"), py::arg("blocks"),
        py::arg("type"), py::arg("gated") = false);
  m.def("set_tile_products", &set_tile_products,
        "without AMX: quant_linear's panels and long chunks on the tiles, the tiles on VDPBF16PS", py::arg("panels"),
        py::arg("long_chunks"), py::arg("bf16_pairs"));
  m.def("tile_products", &tile_products, "set_tile_products' settings: (panels, long_chunks, bf16_pairs)");
  m.attr("TILES_HAVE_BF16_PAIRS") = tiles_fma::kBf16Pairs;
  m.def("quant_product", without_gil_when_long<&quant_product>,
        "x @ W.T as the model runs it: quant_gemv where it takes the rows", py::arg("x"), py::arg("blocks"),
        py::arg("type"), py::arg("decode_step"), py::arg("gated") = false);
  py::class_<DecodeModel, std::shared_ptr<DecodeModel>>(m, "DecodeModel",
                                                        "a model's tensors as decode_layers takes them (ops.h)")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<at::Tensor>, at::Tensor, double, std::vector<at::Tensor>, double,
                    int64_t, int64_t, std::vector<int64_t>, bool>(),
           py::arg("weights"), py::arg("parts"), py::arg("norms"), py::arg("tiles"), py::arg("block_types"),
           py::arg("extras"), py::arg("final_norm"), py::arg("eps"), py::arg("rope"), py::arg("scale"), py::arg("hq"),
           py::arg("hkv"), py::arg("windows"), py::arg("gelu_tanh"))
      .def_readonly("parts", &DecodeModel::parts)
      .def_readonly("tiles", &DecodeModel::tiles)
      .def_readonly("block_types", &DecodeModel::block_types);
  m.def("decode_layers", without_gil_when_long<&decode_layers>,
        "the first num_layers decoder layers of a decode step (bf16 or GGUF-block weights), final norm applied",
        py::arg("h"), py::arg("model"), py::arg("num_layers"), py::arg("positions"), py::arg("kv_cache"),
        py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("seq_ids"),
        py::arg("decode_step"));
}
