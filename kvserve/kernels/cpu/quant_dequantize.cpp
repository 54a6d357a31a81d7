// Quantized weight rows -> float32: the embedding gather of a quantized table, in either layout (GGML's
// or row groups: a tied table is also the LM head, which the GEMV reads in row groups), and the exact
// reference the quantized products are built on (quant_blocks.h).
#include "common.h"
#include "ops.h"
#include "quant_row_groups.h"

namespace kvserve {

at::Tensor dequantize_rows(at::Tensor blocks, at::Tensor ids, int64_t type) {
  RECORD_FUNCTION("kvserve::dequantize_rows", {});  // named in torch profiler traces
  return quant::visit_kernel_type(type, [&](auto block) {
    using Block = decltype(block);
    const int64_t k = quant::columns_of<Block>(blocks), row_bytes = blocks.size(1);
    const int64_t n = blocks.size(0) * quant::rows_per_stored_row<Block>();
    TORCH_CHECK(ids.dim() == 1, "ids must be one-dimensional");
    const at::Tensor rows = ids.to(at::kLong).contiguous();
    const int64_t count = rows.size(0);
    const int64_t* row = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < n, "row id ", row[i], " is outside the matrix's ", n, " rows");
    auto out = at::empty({count, k}, blocks.options().dtype(at::kFloat));
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, count, 16, [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quant::dequantize_row<Block>(src, row_bytes, row[i], k, dst + i * k);
    });
    return out;
  });
}

}  // namespace kvserve
