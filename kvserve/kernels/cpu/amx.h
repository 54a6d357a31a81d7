// What the AMX kernels (decode_attention_amx.cpp, linear_amx.cpp) share: the check that this CPU and
// OS let the process use the tile registers, and the one tile configuration both use.
#pragma once

#include "common.h"

namespace kvserve {

// The CPU has AMX-TILE and AMX-BF16, this build targets them, and the kernel lets this process use
// the tile registers (Linux grants the large tile state per process on request; oneDNN asks too, so
// this is usually a no-op). Asked once per process.
bool amx_permitted();

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Palette 1 with tiles 0-7 all 16 rows x 64 bytes: 16 x 32 bf16 operands, 16 x 16 float32 results.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}
#endif

}  // namespace kvserve
