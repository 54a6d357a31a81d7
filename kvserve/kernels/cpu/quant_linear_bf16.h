// quant_linear's product for bf16 activations on a path with native bf16 products (quant_linear_bf16.cpp):
// each panel of weight rows is dequantized straight to bf16 by the caller's function (the values the dense
// bf16 engine holds for the same file) and multiplied with products that sum in float32.
#pragma once

#include <functional>

#include "common.h"

namespace kvserve::bf16_panel {

// Weight rows per panel: the caller's function fills at most this many rows at a time.
constexpr int64_t kPanelRows = 32;

// Writes weight rows n0 .. n0 + rows - 1 (rows <= kPanelRows) into panel as bf16 bits, row r at panel + r * k.
using DequantizeRows = std::function<void(int64_t n0, int64_t rows, uint16_t* panel)>;

// Whether this build multiplies bf16 natively on AVX512-BF16 dot products (with AMX, where the tiles are
// permitted, quant_linear takes amx_product.h instead). A compile-time constant, so callers on other
// paths never instantiate the bf16 panel's dequantization.
#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;
#else
constexpr bool kAvailable = false;
#endif

// y [m, n] = x [m, k] @ W^T, all bf16 (row-major, contiguous); W's n rows come from `dequantize`, panel
// by panel; k a multiple of 32. Defined only where kAvailable.
void linear(const uint16_t* x, int64_t m, int64_t k, int64_t n, const DequantizeRows& dequantize, uint16_t* y);

}  // namespace kvserve::bf16_panel
