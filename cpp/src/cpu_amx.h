// Intel AMX (tile registers, TDPBF16PS) plumbing shared by the CPU kernels that use it
// (cpu_linear.cpp, cpu_attention_amx.h): availability, the OS permission, one tile configuration.
//
// PAGEDLLM_HAVE_AMX is 1 when the compiler targets AMX-TILE, AMX-BF16 and AVX512-BF16 (the build
// uses -march=native, so the build machine's CPU decides); at run time amx_available() also asks
// the kernel for the tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM, Linux >= 5.16), once
// per process. Every thread that runs tile instructions loads the configuration first
// (load_amx_tile_config) and releases the tiles when done (_tile_release).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <mutex>
#else
#define PAGEDLLM_HAVE_AMX 0
#endif

namespace pagedllm::cpu {

#if PAGEDLLM_HAVE_AMX
/// True when this CPU has AMX-BF16 and the OS granted this process the tile data state.
inline bool amx_available() {
  static std::once_flag once;
  static bool granted = false;
  std::call_once(once, [] {
    constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: request a dynamic xstate feature
    constexpr long kXfeatureXtiledata = 18;
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return;
    granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return granted;
}

/// The one configuration (palette 1): tiles tmm0-7 all 16 rows x 64 bytes, i.e. 16 x 16 float32
/// accumulators or 16 x 32 bfloat16 operands (an A tile's 32 columns, or a B tile's 16 column
/// pairs in VNNI order: B[k / 2][n][k % 2]).
inline void load_amx_tile_config() {
  struct alignas(64) TileConfig {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#else
inline bool amx_available() { return false; }
#endif

}  // namespace pagedllm::cpu
