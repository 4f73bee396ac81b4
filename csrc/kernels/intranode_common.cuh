// Pieces shared by the intranode dispatch and combine kernels.
#pragma once

#include "../common/copy.cuh"
#include "../common/device_status.cuh"
#include "../common/ptx.cuh"
#include "buffer_layout.cuh"

namespace ep_plugin::intranode {

__device__ __forceinline__ Header* header_of(void* const* peer_buffers, int rank) {
  return reinterpret_cast<Header*>(peer_buffers[rank]);
}

// Last block out advances the operation epoch that tags every ring counter.
// NOTE: every block read op_epoch at its start, before its own increment of blocks_done, so no block
// of this kernel can observe the new value.
__device__ __forceinline__ void finish_operation(Header* me, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(&me->blocks_done, 1u) + 1u;
    if (done == gridDim.x) {
      me->blocks_done = 0;
      me->op_epoch = epoch;
      __threadfence();
    }
  }
}

// First index in [begin, end) of the ascending `values` whose value is >= `key` (warp-cooperative).
__device__ __forceinline__ int warp_lower_bound(const int32_t* values, int begin, int end, int key) {
  const int lane = lane_id();
  while (end - begin > 32) {
    const int step = (end - begin + 31) / 32;
    const int probe = begin + lane * step;
    const uint32_t below = __ballot_sync(0xffffffffu, probe < end && values[probe] < key);
    const int count = __popc(below);
    if (count == 0) return begin;
    const int new_end = begin + count * step;
    begin = begin + (count - 1) * step + 1;
    end = new_end < end ? new_end : end;
  }
  const uint32_t below = __ballot_sync(0xffffffffu, begin + lane < end && values[begin + lane] < key);
  return begin + __popc(below);
}

}  // namespace ep_plugin::intranode
