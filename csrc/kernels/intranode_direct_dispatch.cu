// Intranode dispatch straight into every rank's outputs ("direct dispatch").
//
// When every rank's outputs (recv_x, its scales, top-k, source indices) live in its NVLink buffer, a
// sender needs no ring and no receiver copies: it writes each token's row and metadata into the
// destination rank's outputs, at the row notify gave it (send_pos).
// - Each block first tells every rank where this rank's outputs of the call are (direct_outputs,
//   tagged with the call's epoch), then waits for every rank's word: a rank that publishes has
//   entered this call, so its outputs are its own for this call.
// - A rank whose region had no room for its outputs says so in that word. Every rank then sees the
//   same words, and every rank's kernel ends there and flags the fallback: the ring dispatch launched
//   after it moves the rows instead (outputs anywhere).
// - The last block out tells every rank that this rank's rows are written (direct_done), then waits
//   until every rank's rows are here: the outputs are complete when the kernel ends.
// - Grid: num_channels * 2 blocks, at most direct_max_blocks. Each warp takes a contiguous run of
//   tokens and writes each row to every rank that has it, this rank included.
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "dispatch_rows.cuh"
#include "intranode_common.cuh"

namespace ep_plugin::intranode {
namespace {

constexpr int64_t kNoOutput = -1;

// Rank r's outputs of this call, mapped here.
struct PeerOutputs {
  uint8_t* x;
  float* scales;
  int64_t* topk_idx;
  float* topk_weights;
  int32_t* src_idx;
};

__device__ __forceinline__ int64_t offset_in(const void* base, const void* output) {
  return output == nullptr ? kNoOutput : static_cast<const uint8_t*>(output) - static_cast<const uint8_t*>(base);
}

template <typename T>
__device__ __forceinline__ T* output_at(void* base, uint64_t offset) {
  return static_cast<int64_t>(offset) == kNoOutput ? nullptr
                                                   : reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

// Thread r < R: tells rank r where this rank's outputs are, then waits for rank r's word (rank r
// has entered the call) and returns its outputs, and whether they are in rank r's region.
__device__ PeerOutputs exchange_outputs(const DispatchArgs& a, Header* me, uint32_t epoch, const WaitSite& site,
                                        bool& peer_has_room) {
  const int r = threadIdx.x;
  const void* own_base = a.peer_buffers[a.rank];
  Header* peer = header_of(a.peer_buffers, r);
  DirectOutputs& mine = peer->direct_outputs[a.rank];
  mine.recv_x = offset_in(own_base, a.recv_x);
  mine.recv_x_scales = offset_in(own_base, a.recv_x_scales);
  mine.recv_topk_idx = offset_in(own_base, a.recv_topk_idx);
  mine.recv_topk_weights = offset_in(own_base, a.recv_topk_weights);
  mine.recv_src_idx = offset_in(own_base, a.recv_src_idx);
  st_release_sys(&peer->direct_ready[a.rank], pack_counter(epoch, a.direct_has_room ? 1 : 0, false));

  Deadline deadline(site);
  uint64_t ready;
  while (true) {
    ready = ld_acquire_sys(&me->direct_ready[r]);
    if (counter_epoch(ready) == epoch) break;
    deadline.check(kWaitPeerOutputs, r, epoch, counter_epoch(ready));
  }
  peer_has_room = counter_count(ready) != 0;
  // NOTE: acquire loads, so that no word of an earlier call's outputs comes from a stale L1 line.
  const DirectOutputs& theirs = me->direct_outputs[r];
  auto word = [](const int64_t& field) { return ld_acquire_sys(reinterpret_cast<const uint64_t*>(&field)); };
  void* base = a.peer_buffers[r];
  return PeerOutputs{output_at<uint8_t>(base, word(theirs.recv_x)), output_at<float>(base, word(theirs.recv_x_scales)),
                     output_at<int64_t>(base, word(theirs.recv_topk_idx)),
                     output_at<float>(base, word(theirs.recv_topk_weights)),
                     output_at<int32_t>(base, word(theirs.recv_src_idx))};
}

template <bool kBulk>
__device__ void direct_sender(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers], uint8_t* shared) {
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;
  const int R = a.num_ranks;
  // Lane r writes rank r's rows; each warp takes a contiguous run of tokens.
  int token_begin, token_end;
  channel_token_range(a.num_tokens, gridDim.x * kWarpsPerChannel, blockIdx.x * kWarpsPerChannel + warp, token_begin,
                      token_end);
  SenderRows<kBulk> rows(a, shared, warp, kWarpsPerChannel, token_begin, 1, token_end);

  // NOTE: the next token's positions are loaded one iteration ahead; the loop is latency-bound.
  auto load_pos = [&](int t) { return lane < R && t < token_end ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1; };
  int next_pos = load_pos(token_begin);
  for (int t = token_begin; t < token_end; ++t) {
    const int pos = next_pos;
    next_pos = load_pos(t + 1);
    const uint32_t dst_mask = __ballot_sync(0xffffffffu, pos >= 0);
    const int k = t - token_begin;
    if (dst_mask == 0) {
      rows.skip(k);
      continue;
    }
    // Issue the top-k and scale loads before the row copy, which does not depend on them.
    const bool has_topk = a.num_topk > 0 && lane < a.num_topk;
    const int64_t expert = has_topk ? a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane] : -1;
    const float weight =
        has_topk && a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;
    const float* token_scales = a.x_scales + static_cast<int64_t>(t) * a.num_scales;
    const int num_early = early_scale_count(a);
    float early_scales[kEarlyScalesPerLane];
    load_early_scales<Load::kReadOnly>(token_scales, num_early, early_scales);

    int row_of[kMaxNvlPeers];
    uint8_t* dst[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      row_of[r] = shfl(pos, r);
      dst[r] = r < R && (dst_mask >> r & 1u) ? outputs[r].x + static_cast<int64_t>(row_of[r]) * a.row_bytes : nullptr;
    }
    uint8_t* const lane_dst = pos < 0 ? nullptr : outputs[lane].x + static_cast<int64_t>(pos) * a.row_bytes;
    rows.copy(a, t, k, dst, lane_dst);

    for_each_scale<Load::kReadOnly>(token_scales, a.num_scales, num_early, early_scales, [&](int i, float scale) {
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r)
        if (dst[r] != nullptr) outputs[r].scales[static_cast<int64_t>(row_of[r]) * a.num_scales + i] = scale;
    });
    // Top-k ids become destination-local expert ids (-1 elsewhere); weights follow them.
    if (has_topk) {
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r) {
        if (dst[r] == nullptr) continue;
        const int32_t local_id = local_expert_id(expert, r, a.num_local_experts);
        const int64_t at = static_cast<int64_t>(row_of[r]) * a.num_topk + lane;
        if (outputs[r].topk_idx != nullptr) outputs[r].topk_idx[at] = local_id;
        if (outputs[r].topk_weights != nullptr) outputs[r].topk_weights[at] = local_id >= 0 ? weight : 0.f;
      }
    }
    if (pos >= 0 && outputs[lane].src_idx != nullptr) outputs[lane].src_idx[pos] = t;
  }
  rows.complete();
}

// After every block's writes: the last block out tells each rank that this rank's rows are all
// written, waits until every rank's rows are here, and ends the operation.
__device__ void finish_direct(const DispatchArgs& a, Header* me, uint32_t epoch, const WaitSite& site) {
  // NOTE: each thread's bulk stores completed (SenderRows::complete); the barrier and the system-scope
  // fence before the count make every block's writes visible before the last block's release.
#ifdef EP_PLUGIN_HAS_BULK_COPIES
  fence_proxy_async();
#endif
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (atomicAdd(&me->blocks_done, 1u) + 1u != gridDim.x) return;
  me->blocks_done = 0;
  __threadfence_system();
  for (int r = 0; r < a.num_ranks; ++r)
    st_release_sys(&header_of(a.peer_buffers, r)->direct_done[a.rank], pack_counter(epoch, 0, true));
  for (int r = 0; r < a.num_ranks; ++r) {
    Deadline deadline(site);
    while (true) {
      // A peer already in its next call has written a later epoch.
      const uint32_t seen = counter_epoch(ld_acquire_sys(&me->direct_done[r]));
      if (static_cast<int32_t>(seen - epoch) >= 0) break;
      deadline.check(kWaitPeerRows, r, epoch, seen);
    }
  }
  me->op_epoch = epoch;
  __threadfence();
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) direct_dispatch_kernel(DispatchArgs args) {
  extern __shared__ __align__(16) uint8_t shared[];
  __shared__ PeerOutputs outputs[kMaxNvlPeers];
  Header* me = header_of(args.peer_buffers, args.rank);
  const uint32_t epoch = me->op_epoch + 1;
  // NOTE: a timeout report's "channel" is the block here.
  const WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpDispatch, args.rank,
                      static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x >> 5)};
  bool peer_has_room = true;
  if (threadIdx.x < args.num_ranks) outputs[threadIdx.x] = exchange_outputs(args, me, epoch, site, peer_has_room);
  const bool every_rank_has_room = __syncthreads_and(peer_has_room);
  // NOTE: read by the ring kernel launched after this one (kernel boundary), which runs on a fallback.
  if (blockIdx.x == 0 && threadIdx.x == 0) me->direct_fell_back = every_rank_has_room ? 0u : 1u;
  if (!every_rank_has_room) return;
  mark_padding_rows(args, blockIdx.x, gridDim.x);
#ifdef EP_PLUGIN_HAS_BULK_COPIES
  if (args.bulk_rows) direct_sender<true>(args, outputs, shared);
  else
#endif
    direct_sender<false>(args, outputs, shared);
  finish_direct(args, me, epoch, site);
}

}  // namespace

void launch_direct_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  check_dispatch_args(args);
  const int num_blocks = args.direct_max_blocks > 0 && args.direct_max_blocks < args.num_channels * 2
                             ? args.direct_max_blocks
                             : args.num_channels * 2;
  const int shared_bytes = bulk_rows_shared_bytes_for<direct_dispatch_kernel>(args);
  direct_dispatch_kernel<<<num_blocks, kThreadsPerBlock, shared_bytes, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
