// y = x @ W^T for bf16 activations of a few dozen to a few hundred rows on Intel AMX tiles: the
// batched decode step's projections and LM head.
//
// Why not oneDNN here: at 100 rows its packed kernel took far longer than the weight stream alone, and
// the tiles need far less; the weight stream and the products did not overlap
// (figures: benchmarks/RESULTS.md, "Figures behind the code's rules").
// Here each thread walks its own contiguous run of the packed weight once, front to back (the hardware
// prefetcher's best case), and reuses each 32-column panel for every row block
// while it sits in L1/L2. (Software prefetch of the next panel during the current one changed nothing
// measurable.)
//
// Layout: the weight is packed once at load (kvserve/model/linear.py) into B tiles,
// packed[n_block][k_step] = 16 key-pairs x 16 columns x 2: the layout amx_product.h multiplies, which
// holds the product itself.
//
// Gated (the MLP's up projection, `gated` true): the weight is [gate; up] with its rows interleaved in
// 16s before packing (gate 0-15, up 0-15, gate 16-31, ...: kvserve/model/linear.py), so each 32-column
// block holds 16 gate columns and their 16 up columns, as amx_product.h's gated epilogue reads them.
#include "amx_product.h"
#include "ops.h"

namespace kvserve {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
at::Tensor linear_amx(at::Tensor x, at::Tensor packed, bool gated) {
  RECORD_FUNCTION("kvserve::linear_amx", {});  // named in torch profiler traces
  using amx_product::kCols, amx_product::kDepth, amx_product::kTileElems;
  TORCH_CHECK(amx_permitted(), "linear_amx needs AMX-BF16 (amx_available() is false here)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "x and packed must be bf16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) % 2 == 0 && packed.size(2) == kTileElems,
              "packed must be [N/16 (even), K/32, 512] (pack_tiles' layout)");
  const int64_t k = x.size(1), k_steps = packed.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(k == k_steps * kDepth, "x has ", k, " columns, the packed weight ", k_steps * kDepth);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  return amx_product::linear(x, n, gated,
                             [w, k_steps](int64_t pair, uint16_t*) { return w + 2 * pair * k_steps * kTileElems; });
}
#else
at::Tensor linear_amx(at::Tensor, at::Tensor, bool) { TORCH_CHECK(false, "this build has no AMX kernels"); }
#endif

}  // namespace kvserve
