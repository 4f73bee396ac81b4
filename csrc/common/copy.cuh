// Warp copies of 16-byte units with several loads in flight per lane.
// NOTE: the load and store helpers are `asm volatile` with memory clobbers, so the compiler keeps
// them in program order: a loop of load-then-store pays one full memory latency per iteration.
// Loading kCopyUnroll units into registers before the first store hides all but one.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace ep_plugin {

constexpr int kCopyUnroll = 8;  // 16-byte loads in flight per lane before the first store

enum class Load {
  kReadOnly,  // user input that nothing writes during the kernel: non-coherent path
  kL2Only,    // data a peer delivered during this kernel: through L2, never a stale L1 line
  kPlain,     // data this block wrote earlier in the kernel (ordered by a block barrier)
};

template <Load kLoad>
__device__ __forceinline__ int4 load_unit(const int4* ptr) {
  if constexpr (kLoad == Load::kReadOnly) return ld_nc_v4(ptr);
  else if constexpr (kLoad == Load::kL2Only) return ld_cg_v4(ptr);
  else return *ptr;
}

// One float by the same path (FP8 scales beside their rows).
template <Load kLoad>
__device__ __forceinline__ float load_f32(const float* ptr) {
  if constexpr (kLoad == Load::kReadOnly) return __ldg(ptr);
  else if constexpr (kLoad == Load::kL2Only) return ld_cg_f32(ptr);
  else return *ptr;
}

// One warp copies `num_units` 16-byte units from `src` to every non-null dst[d] (local memory or a
// peer's mapping): each unit is loaded once and stored to every destination.
template <Load kLoad, typename Ptr, int kDsts>
__device__ __forceinline__ void warp_copy_units_to_all(Ptr const (&dst)[kDsts], const int4* src, int64_t num_units) {
  const int lane = lane_id();
  for (int64_t base = 0; base < num_units; base += 32 * kCopyUnroll) {
    int4 values[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < num_units) values[u] = load_unit<kLoad>(src + i);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i >= num_units) continue;
#pragma unroll
      for (int d = 0; d < kDsts; ++d)
        if (kDsts == 1 || dst[d] != nullptr) st_na_v4(reinterpret_cast<int4*>(dst[d]) + i, values[u]);
    }
  }
}

// The same to one destination.
template <Load kLoad>
__device__ __forceinline__ void warp_copy_units(int4* dst, const int4* src, int64_t num_units) {
  int4* const destinations[1] = {dst};
  warp_copy_units_to_all<kLoad>(destinations, src, num_units);
}

// The same for `bytes` (a multiple of 16) between 16-byte-aligned addresses.
template <Load kLoad>
__device__ __forceinline__ void warp_copy_bytes(void* dst, const void* src, int64_t bytes) {
  warp_copy_units<kLoad>(static_cast<int4*>(dst), static_cast<const int4*>(src), bytes / 16);
}

}  // namespace ep_plugin
