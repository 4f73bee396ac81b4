// What the ring dispatch (intranode_dispatch.cu) and the direct dispatch (intranode_direct_dispatch.cu)
// share: the launch checks, how a sender warp moves its tokens' rows (SenderRows), FP8 scales loaded
// ahead of the row, destination-local expert ids and the padding rows of a graph-mode dispatch.
#pragma once

#include "../common/bulk_rows.cuh"
#include "../common/copy.cuh"
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"

namespace ep_plugin::intranode {

inline void check_dispatch_args(const DispatchArgs& args) {
  EP_CHECK_ARG(args.num_ranks >= 1 && args.num_ranks <= kMaxNvlPeers,
               "intranode kernels support 1 to " << kMaxNvlPeers << " ranks, got " << args.num_ranks);
  EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
               "channels (num_sms / 2) must be in [1, " << kMaxChannels << "], got " << args.num_channels);
  EP_CHECK_ARG(args.row_bytes > 0 && args.row_bytes % 16 == 0, "rows must be a multiple of 16 bytes, got "
                                                                   << args.row_bytes);
  EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "top-k must be at most " << kMaxTopk);
  EP_CHECK_ARG(args.send_chunk >= 1, "num_max_nvl_chunked_send_tokens must be >= 1");
  EP_CHECK_ARG(args.num_scales >= 0 && (args.num_scales == 0) == (args.x_scales == nullptr),
               "x_scales and num_scales disagree");
  EP_CHECK_ARG(args.num_scales == 0 || (args.scale_token_stride > 0 && args.scale_stride > 0),
               "x_scales strides must be positive, got (" << args.scale_token_stride << ", " << args.scale_stride
                                                          << ")");
}

// Dynamic shared memory of a dispatch kernel's launch: the bulk copies' stages, with the kernel's limit
// raised on the first bulk launch; 0 on the register path.
template <auto kKernel>
int bulk_rows_shared_bytes_for(const DispatchArgs& args) {
  if (!args.bulk_rows) return 0;
  EP_CHECK_ARG(bulk_rows_fit(args.row_bytes), "rows of " << args.row_bytes << " bytes are too long for bulk copies");
  // NOTE: once per process, which drives one GPU (one rank per process).
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    bulk_rows_shared_bytes(kWarpsPerChannel)));
    return true;
  }();
  (void)attribute_set;
  return bulk_rows_shared_bytes(kWarpsPerChannel);
}

// Expert `expert` as rank r's local id, or -1 when rank r does not hold it.
__device__ __forceinline__ int32_t local_expert_id(int64_t expert, int r, int num_local_experts) {
  const int64_t local = expert - static_cast<int64_t>(r) * num_local_experts;
  return expert >= 0 && local >= 0 && local < num_local_experts ? static_cast<int32_t>(local) : -1;
}

// A token's FP8 scales: the first kEarlyScalesPerLane per lane are loaded before its row is copied, so
// that their latency hides under the copy. Loaded after it, each 32 of them cost a memory round trip
// of their own; an FP8 row (7 KB) is only two. Scale i of a token is at scales[i * stride] (column-major
// scales, as DeepGEMM writes them, are read in place).
constexpr int kEarlyScalesPerLane = 4;

// Scales [0, num_early) are loaded early: min(num_scales, 32 * kEarlyScalesPerLane).
__device__ __forceinline__ int early_scale_count(const DispatchArgs& a) {
  return min(a.num_scales, 32 * kEarlyScalesPerLane);
}

template <Load kLoad>
__device__ __forceinline__ void load_early_scales(const float* scales, int64_t stride, int num_early,
                                                  float (&early)[kEarlyScalesPerLane]) {
  const int lane = lane_id();
#pragma unroll
  for (int k = 0; k < kEarlyScalesPerLane; ++k) {
    const int i = lane + 32 * k;
    early[k] = i < num_early ? load_f32<kLoad>(scales + i * stride) : 0.f;
  }
}

// Calls store(i, scale) for every scale i of the token this lane owns: the early ones from registers,
// the others loaded now.
template <Load kLoad, typename Store>
__device__ __forceinline__ void for_each_scale(const float* scales, int64_t stride, int num_scales, int num_early,
                                               const float (&early)[kEarlyScalesPerLane], Store store) {
  const int lane = lane_id();
#pragma unroll
  for (int k = 0; k < kEarlyScalesPerLane; ++k)
    if (lane + 32 * k < num_early) store(lane + 32 * k, early[k]);
  for (int i = lane + (num_early / 32) * 32; i < num_scales; i += 32)
    if (i >= num_early) store(i, load_f32<kLoad>(scales + i * stride));
}

// Rows past the received count are padding when num_worst_tokens > 0: mark them unrouted.
__device__ inline void mark_padding_rows(const DispatchArgs& a, int receiver_index, int num_receivers) {
  if (a.num_worst_tokens == 0) return;
  const int num_recv = *a.num_recv_tokens;
  const int64_t first = static_cast<int64_t>(num_recv) * a.num_topk;
  const int64_t last = static_cast<int64_t>(a.num_worst_tokens) * a.num_topk;
  const int stride = num_receivers * blockDim.x;
  for (int64_t i = first + receiver_index * blockDim.x + threadIdx.x; i < last; i += stride) {
    if (a.recv_topk_idx != nullptr) a.recv_topk_idx[i] = -1;
    if (a.recv_topk_weights != nullptr) a.recv_topk_weights[i] = 0.f;
  }
  if (a.recv_src_idx != nullptr)
    for (int64_t row = num_recv + receiver_index * blockDim.x + threadIdx.x; row < a.num_worst_tokens; row += stride)
      a.recv_src_idx[row] = -1;
}

// The sender's row copies: loads into registers and stores from them, or (kBulk) bulk copies through
// shared memory. Row k of a warp is the token tokens.lookahead(k) (StridedTokens, or ClaimedTokens of
// the direct dispatch); rows go in order.
template <bool kBulk>
struct SenderRows;

template <>
struct SenderRows<false> {
  __device__ SenderRows(const DispatchArgs&, uint8_t*, int, int) {}
  template <typename Ptr, typename Tokens>
  __device__ void copy(const DispatchArgs& a, int t, int, Ptr const (&dst)[kMaxNvlPeers], uint8_t*, const Tokens&) {
    const int4* src_row = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) +
                                                        static_cast<int64_t>(t) * a.row_bytes);
    warp_copy_units_to_all<Load::kReadOnly>(dst, src_row, a.row_bytes / 16);
  }
  template <typename Tokens>
  __device__ void skip(int, const Tokens&) {}
  __device__ void after_slot_freed() {}
  __device__ void complete() {}
  __device__ void drain(int) {}
};

#ifdef EP_PLUGIN_HAS_BULK_COPIES
template <>
struct SenderRows<true> {
  // Warp `warp` of the block's `num_warps`.
  __device__ SenderRows(const DispatchArgs& a, uint8_t* shared, int warp, int num_warps)
      : rows(shared, warp, num_warps, static_cast<const uint8_t*>(a.x), a.row_bytes) {}
  // The k-th row of the warp to this lane's destination (lane r: rank r's).
  template <typename Ptr, typename Tokens>
  __device__ void copy(const DispatchArgs&, int, int k, Ptr const (&)[kMaxNvlPeers], uint8_t* lane_dst,
                       const Tokens& tokens) {
    rows.copy_row(k, lane_dst, tokens);
  }
  template <typename Tokens>
  __device__ void skip(int k, const Tokens& tokens) {
    rows.copy_row(k, nullptr, tokens);
  }
  // NOTE: the receiver's reads of a slot, seen through this lane's acquire of the ring head, come
  // before the bulk copies' writes into it.
  __device__ void after_slot_freed() { fence_proxy_async(); }
  // Before a release that publishes this lane's rows, and before the kernel ends.
  __device__ void complete() { bulk_wait_all(); }
  // Before the warp leaves at its k-th row without copying it (an error).
  __device__ void drain(int k) { rows.drain(k); }
  WarpBulkRows rows;
};
#endif

}  // namespace ep_plugin::intranode
