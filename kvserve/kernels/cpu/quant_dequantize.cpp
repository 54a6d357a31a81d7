// Quantized weight rows -> float32: the embedding gather of a quantized table (the rows selected first)
// and the exact reference the quantized products are built on (quant_blocks.h).
#include "common.h"
#include "ops.h"
#include "quant_blocks.h"

namespace kvserve {

at::Tensor dequantize_rows(at::Tensor blocks, int64_t type) {
  RECORD_FUNCTION("kvserve::dequantize_rows", {});  // named in torch profiler traces
  return quant::visit_type(type, [&](auto block) {
    using Block = decltype(block);
    const int64_t n = blocks.size(0), k = quant::columns_of<Block>(blocks), row_bytes = blocks.size(1);
    auto out = at::empty({n, k}, blocks.options().dtype(at::kFloat));
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, n, 16, [=](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        for (int64_t b = 0; b < k / Block::kElems; ++b)
          Block::dequantize(src + row * row_bytes + b * Block::kBytes, dst + row * k + b * Block::kElems);
    });
    return out;
  });
}

}  // namespace kvserve
