// gather_sum_rows: out[n] = sum of rows[index[n, s]] over the slots s with index >= 0, in fp32, as bf16.
//
// The reverse of an expert-major permutation (each received row copied once per local expert) without
// atomics: every output row is owned by one warp, which adds its sources in slot order, so the result
// is deterministic. Used for the unpermute of expert outputs and for the permute's backward.
#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "../common/ptx.cuh"
#include "api.cuh"

namespace ep_plugin {
namespace {

constexpr int kGatherThreads = 256;
constexpr int kGatherUnroll = 4;           // 16-byte units per lane per column tile
constexpr int kGatherSourcesInFlight = 2;  // source rows loaded before they are summed

__device__ __forceinline__ void sum_tile(const int4* const (&sources)[kGatherSourcesInFlight], int num_sources,
                                         int base, int num_units, float (&acc)[kGatherUnroll][8]) {
  const int lane = lane_id();
  int4 values[kGatherSourcesInFlight][kGatherUnroll];
#pragma unroll
  for (int s = 0; s < kGatherSourcesInFlight; ++s) {
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (s < num_sources && i < num_units) values[s][u] = ld_nc_v4(sources[s] + i);
    }
  }
#pragma unroll
  for (int s = 0; s < kGatherSourcesInFlight; ++s) {
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u)
      if (s < num_sources && base + u * 32 + lane < num_units) add_bf16x8(acc[u], values[s][u]);
  }
}

__global__ void __launch_bounds__(kGatherThreads) gather_sum_rows_kernel(GatherSumArgs args) {
  const int lane = lane_id();
  const int num_units = args.hidden / 8;
  const int warps_per_block = kGatherThreads / 32;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5);
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int4* rows = static_cast<const int4*>(args.rows);

  for (int64_t n = first_row; n < args.num_out_rows; n += row_stride) {
    const int32_t* slots = args.index + n * args.num_slots;
    int4* out = static_cast<int4*>(args.out) + n * num_units;
    for (int base = 0; base < num_units; base += 32 * kGatherUnroll) {
      float acc[kGatherUnroll][8] = {};
      // Slots are read 32 at a time; the valid ones are visited in slot order.
      for (int slot_base = 0; slot_base < args.num_slots; slot_base += 32) {
        const int slot = slot_base + lane;
        const int32_t source = slot < args.num_slots ? slots[slot] : -1;
        uint32_t valid = __ballot_sync(0xffffffffu, source >= 0);
        while (valid != 0) {
          const int4* sources[kGatherSourcesInFlight];
          int num_sources = 0;
#pragma unroll
          for (int s = 0; s < kGatherSourcesInFlight; ++s) {
            sources[s] = rows;
            if (valid != 0) {
              const int from = __ffs(valid) - 1;
              valid &= valid - 1;
              sources[s] = rows + static_cast<int64_t>(__shfl_sync(0xffffffffu, source, from)) * num_units;
              ++num_sources;
            }
          }
          sum_tile(sources, num_sources, base, num_units, acc);
        }
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < num_units) out[i] = to_bf16x8(acc[u]);
      }
    }
  }
}

}  // namespace

void launch_gather_sum_rows(const GatherSumArgs& args, int num_sms, cudaStream_t stream) {
  EP_CHECK_ARG(args.hidden > 0 && args.hidden % 8 == 0, "bf16 rows must be a multiple of 16 bytes, hidden = "
                                                           << args.hidden);
  EP_CHECK_ARG(args.num_slots >= 0 && args.num_out_rows >= 0, "negative sizes");
  if (args.num_out_rows == 0) return;
  const int64_t warps_per_block = kGatherThreads / 32;
  const int64_t blocks_needed = (args.num_out_rows + warps_per_block - 1) / warps_per_block;
  const int64_t max_blocks = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * (2048 / kGatherThreads);
  const int blocks = static_cast<int>(blocks_needed < max_blocks ? blocks_needed : max_blocks);
  gather_sum_rows_kernel<<<blocks, kGatherThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin
