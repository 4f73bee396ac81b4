// Pieces shared by the intranode dispatch and combine kernels.
#pragma once

#include "../common/bf16.cuh"
#include "../common/copy.cuh"
#include "../common/device_status.cuh"
#include "../common/ptx.cuh"
#include "buffer_layout.cuh"

namespace ep_plugin::intranode {

__device__ __forceinline__ Header* header_of(void* const* peer_buffers, int rank) {
  return reinterpret_cast<Header*>(peer_buffers[rank]);
}

// A combine's receiver loads kSourcesInFlight copies of kCombineUnroll 16-byte units per lane before
// summing them: a token's copies come from different ranks, so their loads need not wait for each other.
// (Loading one copy at a time measured 611 us against 413 us at 4096 x 7168 on 24 SMs, 2 ranks.)
constexpr int kCombineUnroll = 4;
constexpr int kSourcesInFlight = 2;

// What sum_token_copies does with a peer's units once read, before summing them: nothing where every
// copy is whole (the rings); the copy-engine combine reads units still landing again (StagedCopiesLanded).
struct CopiesWhole {
  __device__ __forceinline__ void operator()(int4 (&)[kCombineUnroll], const int4*, int, int) const {}
};

// One warp sums a token's copies (src[r] is rank r's copy, or nullptr) in fp32, adds the optional
// biases and stores the bf16 row. Rank `own`'s copy is user memory, read through the read-only path;
// the others were written by peers into this rank's buffer and are read from L2.
template <typename Landed = CopiesWhole>
__device__ __forceinline__ void sum_token_copies(const int4* const (&src)[kMaxNvlPeers], int own, int num_units,
                                                 const int4* bias_0, const int4* bias_1, int4* out,
                                                 const Landed& landed = Landed{}) {
  const int lane = lane_id();
  for (int base = 0; base < num_units; base += 32 * kCombineUnroll) {
    float acc[kCombineUnroll][8] = {};
#pragma unroll
    for (int r0 = 0; r0 < kMaxNvlPeers; r0 += kSourcesInFlight) {
      int4 values[kSourcesInFlight][kCombineUnroll];
#pragma unroll
      for (int s = 0; s < kSourcesInFlight; ++s) {
        if (src[r0 + s] == nullptr) continue;
#pragma unroll
        for (int u = 0; u < kCombineUnroll; ++u) {
          const int i = base + u * 32 + lane;
          if (i < num_units) values[s][u] = r0 + s == own ? ld_nc_v4(src[r0 + s] + i) : ld_cg_v4(src[r0 + s] + i);
        }
      }
#pragma unroll
      for (int s = 0; s < kSourcesInFlight; ++s)
        if (src[r0 + s] != nullptr && r0 + s != own) landed(values[s], src[r0 + s], r0 + s, base);
#pragma unroll
      for (int s = 0; s < kSourcesInFlight; ++s) {
        if (src[r0 + s] == nullptr) continue;
#pragma unroll
        for (int u = 0; u < kCombineUnroll; ++u)
          if (base + u * 32 + lane < num_units) add_bf16x8(acc[u], values[s][u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i >= num_units) continue;
      if (bias_0 != nullptr) add_bf16x8(acc[u], ld_nc_v4(bias_0 + i));
      if (bias_1 != nullptr) add_bf16x8(acc[u], ld_nc_v4(bias_1 + i));
      st_na_v4(out + i, to_bf16x8(acc[u]));
    }
  }
}

// Lane k < num_topk sums weight k over a token's copies (as sum_token_copies) into out[k].
__device__ __forceinline__ void sum_token_weights(const float* const (&src)[kMaxNvlPeers], int own, int num_topk,
                                                  float* out) {
  const int lane = lane_id();
  if (lane >= num_topk) return;
  float sum = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxNvlPeers; ++r)
    if (src[r] != nullptr) sum += r == own ? src[r][lane] : ld_cg_f32(src[r] + lane);
  out[lane] = sum;
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
