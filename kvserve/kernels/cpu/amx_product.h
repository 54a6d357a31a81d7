// The bf16 product on AMX tiles that linear_amx (weights packed once at load) and quant_linear (weights
// packed panel by panel from GGUF blocks, quant_pack_tiles.h) both run.
//
// Rows of x are A tiles as they lie (16 rows x 32 bf16, row stride K); the weights are B tiles in the
// VNNI layout TDPBF16PS reads: per 16 weight rows (output columns) and 32 k, element (k, n) at
// [(k / 2) * 32 + n * 2 + k % 2] (kvserve/model/linear.py's pack_tiles). The columns go in pairs of
// tiles (32 columns): each thread takes whole pairs and multiplies every row block of x with a pair while
// its tiles sit in L1/L2, in register blocks of 2 row tiles x 2 column tiles -> 4 float32 result tiles,
// so each loaded tile feeds two products. The results are stored row by row, so y is written as it lies.
//
// Gated (the MLP's gate and up projections in one product): each pair's first tile holds 16 gate
// columns and its second their 16 up columns, and the epilogue stores silu(gate) * up from the float32
// results: y is [M, N / 2], one rounding to bf16, no separate silu_mul pass over a [M, N] product.
#pragma once

#include <functional>

#include "amx.h"

namespace kvserve::amx_product {

constexpr int64_t kRows = 16, kCols = 16, kDepth = 32;  // one tile product: [16 x 32] . [32 x 16]
constexpr int64_t kTileElems = kDepth * kCols;          // bf16 elements in one packed B tile
constexpr int64_t kScratchRows = 48;

// Column pair `pair`'s B tiles: the first tile's K / 32 packed tiles (k ascending), then the second's.
// Called on the thread that multiplies them, with that thread's scratch for tiles packed on the spot:
// room for kScratchRows x K bf16 (the pair's 2 x K / 32 tiles are 32 x K).
using PairTiles = std::function<const uint16_t*(int64_t pair, uint16_t* scratch)>;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// y = x @ W^T, x bf16 [M, K] contiguous (K a multiple of 32), W's n columns in ceil(n / 32) pairs (the
// last pair's columns past n are computed and not stored). Gated: n / 2 a multiple of 16, y [M, n / 2].
at::Tensor linear(const at::Tensor& x, int64_t n, bool gated, const PairTiles& tiles);
#endif

}  // namespace kvserve::amx_product
