// quant_linear's product for bf16 activations on a path with native bf16 products (quant_linear_bf16.cpp):
// each panel of weight rows is dequantized to float32 by the caller's function, rounded to bf16 (the
// values the dense bf16 engine holds for the same file) and multiplied with products that sum in float32.
#pragma once

#include <functional>

#include "common.h"

namespace kvserve::bf16_panel {

// Weight rows per panel: the caller's function fills at most this many rows at a time.
constexpr int64_t kPanelRows = 32;

// Writes weight rows n0 .. n0 + rows - 1 (rows <= kPanelRows) into tile, row r at tile + r * k.
using DequantizeRows = std::function<void(int64_t n0, int64_t rows, float* tile)>;

// Whether this build and process multiply bf16 natively: AMX tiles, or AVX512-BF16 dot products.
bool available();

// y [m, n] = x [m, k] @ W^T, all bf16 (row-major, contiguous); W's n rows come from `dequantize`, panel
// by panel; k a multiple of 32. Requires available().
void linear(const uint16_t* x, int64_t m, int64_t k, int64_t n, const DequantizeRows& dequantize, uint16_t* y);

}  // namespace kvserve::bf16_panel
