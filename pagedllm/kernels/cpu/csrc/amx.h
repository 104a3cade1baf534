// What the AMX kernels (quant_amx.h: int8 tiles for GGUF blocks; gemm_amx.h: bfloat16
// tiles) share: the permission to use the tiles, and a thread's tile configuration.
//
// Linux gives a process the tiles' 8 KB of register state only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM, once per process, Linux 5.16 and later); `granted()` asks, and
// where the kernel refuses the callers take their AVX-512 kernels. The configuration
// (rows and bytes per row of each of the 8 tiles) is per thread: each thread of a call
// loads it before its first tile instruction and releases the tiles when done (`Tiles`),
// so a context switch between calls saves no tile state.
#pragma once

#if defined(__AMX_TILE__)
#define PAGEDLLM_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace pagedllm_amx {

inline bool granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Whether the kernels that the environment variable `env` chooses take the tiles: where it
// is unset or says "amx", and the OS grants them.
inline bool chosen(const char* env) {
  const char* mode = std::getenv(env);
  return (mode == nullptr || std::strcmp(mode, "amx") == 0) && granted();
}

// The ldtilecfg operand: palette 1, tile t of rows[t] rows x colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The calling thread's tiles, configured for its lifetime.
class Tiles {
 public:
  explicit Tiles(const TileConfig& config) { _tile_loadconfig(&config); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() { _tile_release(); }
};

}  // namespace pagedllm_amx

#endif
