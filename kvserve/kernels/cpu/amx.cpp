#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>
#endif

namespace kvserve {

bool amx_permitted() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool permitted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

}  // namespace kvserve
