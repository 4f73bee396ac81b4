// Intranode combine by pushes into the owners' staging areas ("push combine", 3 to 8 ranks).
//
// The direct dispatch in reverse: no rings, no flow control. Every received row has a fixed place in
// its owner's staging area (PushStagingLayout: peer s's copy of owner token t at row t of s's region),
// so a sender stores it there without asking for space, and the owner sums its tokens in place.
// - Handshake: each block tells every peer that this rank has entered the combine (push_entered,
//   tagged with the call's epoch). A rank that has entered has ended its previous combine (stream
//   order), so its staging area is free: a sender waits for an owner's word before its first row to it.
// - Senders (even blocks): a unit is (chunk c of kPushChunkTokens owner tokens, owner o); units are
//   claimed from a counter, chunk by chunk, owners rotated by rank, so that every owner's first chunks
//   come first. A warp stores the unit's rows (the rows of its block for o whose source token is in c)
//   with their top-k weights, waits for its stores, and sets o's ready word of (this rank, c) to the epoch.
// - Owners (odd blocks): warps take tokens in order; lane s waits for the ready word of (s, the token's
//   chunk) when the token has a copy from s, then the warp sums the copies (its own one from x) in fp32
//   with the biases, as the ring combine does.
// - Senders never wait for owners' progress, only for their entry: no cycle can form (see the NOTE in
//   intranode_combine.cu). Ready words are epoch-tagged, so nothing is reset between calls; an owner
//   waits only for chunks it has copies in, and a sender writes a ready word only after rows, so every
//   write into an owner's area is waited for by that owner within the call.
// - Capacity: an owner whose token count exceeds the region's capacity cannot take the pushes. Every
//   rank sees every rank's count (src_num_tokens) and the same layout, so all ranks decide alike: the
//   kernel flags the fallback and ends, and the ring combine launched after it runs.
#include "../common/bulk_rows.cuh"
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"

namespace ep_plugin::intranode {
namespace {

__device__ __forceinline__ bool epoch_reached(uint64_t word, uint32_t epoch) {
  return static_cast<int32_t>(counter_epoch(word) - epoch) >= 0;
}

// Whether every rank's tokens fit a region (the same answer on every rank).
__device__ __forceinline__ bool every_owner_fits(const CombineArgs& a, const PushStagingLayout& layout) {
  bool fits = layout.capacity > 0;
  for (int r = 0; r < a.num_ranks; ++r) fits = fits && a.src_num_tokens[r] <= layout.capacity;
  return fits;
}

// The rows of one unit of a warp's sequence: row k of the sequence is x's row first + (k - k0), for k
// in [k0, k0 + count). WarpBulkRows asks for rows ahead; those of the next unit are not known yet.
struct UnitRows {
  int k0 = 0, first = 0, count = 0;
  __device__ int lookahead(int k) const { return k >= k0 && k < k0 + count ? first + (k - k0) : -1; }
};

// The sender's row copies: bulk copies through shared memory, or loads into registers and stores.
template <bool kBulk>
struct PushRows;

template <>
struct PushRows<false> {
  __device__ PushRows(const CombineArgs&, uint8_t*, int) {}
  // Row k of the warp's sequence (x's row `row`) to `dst` (the same in every lane). Warp-collective.
  __device__ void copy(const CombineArgs& a, int, int row, uint8_t* dst, const UnitRows&) {
    warp_copy_bytes<Load::kReadOnly>(dst, static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2,
                                     2LL * a.hidden);
  }
  __device__ void complete() {}
};

#ifdef EP_PLUGIN_HAS_BULK_COPIES
template <>
struct PushRows<true> {
  __device__ PushRows(const CombineArgs& a, uint8_t* shared, int warp)
      : rows(shared, warp, kWarpsPerChannel, static_cast<const uint8_t*>(a.x), a.hidden * 2) {}
  // Lane 0 stores the row.
  __device__ void copy(const CombineArgs&, int k, int, uint8_t* dst, const UnitRows& unit) {
    rows.copy_row(k, lane_id() == 0 ? dst : nullptr, unit);
  }
  // NOTE: the stores have completed (not only read shared memory), and are ordered before this
  // thread's later generic-proxy writes (the ready word's release).
  __device__ void complete() {
    bulk_wait_all();
    fence_proxy_async();
  }
  WarpBulkRows rows;
};
#else
// Device code before sm_90 has no bulk copies: the launcher's bulk kernel copies through registers there.
template <>
struct PushRows<true> : PushRows<false> {
  using PushRows<false>::PushRows;
};
#endif

// Lane 0 waits until `owner` has entered this combine (its staging area is free).
__device__ void wait_for_entry(const Header* me, int owner, uint32_t epoch, const WaitSite& site) {
  if (lane_id() == 0) {
    Deadline deadline(site);
    uint64_t value;
    while (!epoch_reached(value = ld_acquire_sys(&me->push_entered[owner]), epoch))
      deadline.check(kWaitPushEntered, owner, epoch, counter_epoch(value));
  }
  __syncwarp();
}

template <bool kBulk>
__device__ void push_sender(const CombineArgs& a, const PushStagingLayout& layout, Header* me, uint32_t epoch,
                            uint8_t* shared, const WaitSite& site) {
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;
  const int R = a.num_ranks;
  int max_tokens = 0;
  for (int r = 0; r < R; ++r) max_tokens = max(max_tokens, a.src_num_tokens[r]);
  const int num_units = (max_tokens + kPushChunkTokens - 1) / kPushChunkTokens * (R - 1);
  PushRows<kBulk> rows(a, shared, warp);
  UnitRows unit;
  uint32_t entered = 0;  // owners seen entered
  int k = 0;             // rows of the warp's sequence so far
  while (true) {
    const int u = shfl(lane == 0 ? static_cast<int>(atomicAdd(&me->push_next_unit, 1u)) : 0, 0);
    if (u >= num_units) break;
    const int chunk = u / (R - 1);
    const int owner = (a.rank + 1 + u % (R - 1)) % R;
    const int token_begin = chunk * kPushChunkTokens;
    const int owner_tokens = a.src_num_tokens[owner];
    if (token_begin >= owner_tokens) continue;
    const int token_end = min(token_begin + kPushChunkTokens, owner_tokens);
    // The rows of this rank's block for `owner` (ascending source tokens) whose token is in the chunk.
    const int rows_begin = a.recv_rank_offsets[owner], rows_end = a.recv_rank_offsets[owner + 1];
    const int first = warp_lower_bound(a.recv_src_idx, rows_begin, rows_end, token_begin);
    const int stop = warp_lower_bound(a.recv_src_idx, first, rows_end, token_end);
    if (first == stop) continue;  // no ready word: the owner waits for none here
    if (!(entered >> owner & 1u)) {
      wait_for_entry(me, owner, epoch, site);
      entered |= 1u << owner;
    }
    uint8_t* region = static_cast<uint8_t*>(a.peer_buffers[owner]) + layout.region_offset(owner, a.rank);
    float* weights = reinterpret_cast<float*>(region + layout.weights_offset(0, a.num_topk));
    unit = UnitRows{k, first, stop - first};
    for (int row = first; row < stop; ++row, ++k) {
      const int t = a.recv_src_idx[row];
      rows.copy(a, k, row, region + layout.row_offset(t), unit);
      if (a.topk_weights != nullptr && lane < a.num_topk)
        weights[static_cast<int64_t>(t) * a.num_topk + lane] = a.topk_weights[static_cast<int64_t>(row) * a.num_topk + lane];
    }
    // NOTE: every lane's stores (rows, weights) are done and seen by lane 0 (warp barrier) before its
    // system-scope fence and release of the ready word.
    rows.complete();
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      st_release_sys(reinterpret_cast<uint64_t*>(region + layout.ready_offset(chunk)), pack_counter(epoch, 0, true));
    }
  }
}

__device__ void push_owner(const CombineArgs& a, const PushStagingLayout& layout, uint32_t epoch,
                           const WaitSite& site) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int num_units = a.hidden / 8;
  const int num_warps = a.num_channels * kWarpsPerChannel;
  const int warp_index = (blockIdx.x >> 1) * kWarpsPerChannel + (threadIdx.x >> 5);
  // Lane s (a peer): its region in this rank's area, and the last chunk seen ready.
  const bool is_source = lane < R && lane != a.rank;
  const uint8_t* region = is_source ? static_cast<const uint8_t*>(a.peer_buffers[a.rank]) +
                                          layout.region_offset(a.rank, lane)
                                    : nullptr;
  int ready_chunk = -1;
  const int4* bias_0 = static_cast<const int4*>(a.bias_0);
  const int4* bias_1 = static_cast<const int4*>(a.bias_1);
  for (int t = warp_index; t < a.num_tokens; t += num_warps) {
    const int pos = lane < R ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
    const uint32_t src_mask = __ballot_sync(0xffffffffu, pos >= 0);
    const int chunk = t / kPushChunkTokens;
    if (is_source && pos >= 0 && chunk != ready_chunk) {
      const uint64_t* ready = reinterpret_cast<const uint64_t*>(region + layout.ready_offset(chunk));
      Deadline deadline(site);
      uint64_t value;
      // NOTE: exact epoch: a sender writes the next combine's words only after this rank enters it.
      while (counter_epoch(value = ld_acquire_sys(ready)) != epoch)
        deadline.check(kWaitPushRows, lane, chunk, counter_epoch(value));
      ready_chunk = chunk;
    }
    // NOTE: orders each lane's acquire before every lane's reads of the rows.
    __syncwarp();

    const int4* src[kMaxNvlPeers];
    const float* src_weights[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      const uint8_t* base = static_cast<const uint8_t*>(shfl_ptr(region, r < R ? r : 0));
      const int row = shfl(pos, r < R ? r : 0);
      src[r] = nullptr;
      src_weights[r] = nullptr;
      if (r >= R || !(src_mask >> r & 1u)) continue;
      if (r == a.rank) {
        src[r] = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2);
        if (a.topk_weights != nullptr) src_weights[r] = a.topk_weights + static_cast<int64_t>(row) * a.num_topk;
      } else {
        src[r] = reinterpret_cast<const int4*>(base + layout.row_offset(t));
        src_weights[r] = reinterpret_cast<const float*>(base + layout.weights_offset(t, a.num_topk));
      }
    }
    const int64_t row_units = static_cast<int64_t>(t) * num_units;
    sum_token_copies(src, a.rank, num_units, bias_0 == nullptr ? nullptr : bias_0 + row_units,
                     bias_1 == nullptr ? nullptr : bias_1 + row_units,
                     reinterpret_cast<int4*>(a.combined_x) + row_units);
    if (a.combined_topk_weights != nullptr)
      sum_token_weights(src_weights, a.rank, a.num_topk, a.combined_topk_weights + static_cast<int64_t>(t) * a.num_topk);
  }
}

// Last block out resets the unit counter and advances the operation epoch.
// NOTE: every sender warp of every block made its last claim before its block arrives here.
__device__ void finish_push(Header* me, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(&me->blocks_done, 1u) + 1u != gridDim.x) return;
  me->blocks_done = 0;
  me->push_next_unit = 0;
  me->op_epoch = epoch;
  __threadfence();
}

template <bool kBulk>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) push_combine_kernel(PushCombineArgs args) {
  // NOTE: 128-byte aligned, as the direct dispatch's (bulk copies lose rate on 16-byte alignment).
  extern __shared__ __align__(128) uint8_t shared[];
  const CombineArgs& a = args.combine;
  Header* me = header_of(a.peer_buffers, a.rank);
  const uint32_t epoch = me->op_epoch + 1;
  const PushStagingLayout layout =
      PushStagingLayout::fit(a.num_ranks, args.staging_offset, args.staging_bytes, 2LL * a.hidden);
  if (!every_owner_fits(a, layout)) {
    // NOTE: read by the ring combine launched after this kernel, once it has ended.
    if (blockIdx.x == 0 && threadIdx.x == 0) me->push_fell_back = 1;
    return;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) me->push_fell_back = 0;
  // NOTE: a timeout report's "channel" is the block here.
  const WaitSite site{a.status, &me->error_claim, a.timeout_ns, kOpCombine, a.rank, static_cast<int>(blockIdx.x),
                      static_cast<int>(threadIdx.x >> 5)};
  if (threadIdx.x < a.num_ranks && static_cast<int>(threadIdx.x) != a.rank)
    st_release_sys(&header_of(a.peer_buffers, threadIdx.x)->push_entered[a.rank], pack_counter(epoch, 0, false));
  if ((blockIdx.x & 1) == 0) push_sender<kBulk>(a, layout, me, epoch, shared, site);
  else push_owner(a, layout, epoch, site);
  // The ring combine launched after this one (it only checks push_fell_back) may start now.
  launch_dependents();
  finish_push(me, epoch);
}

}  // namespace

void launch_push_combine(const PushCombineArgs& args, cudaStream_t stream) {
  const CombineArgs& a = args.combine;
  EP_CHECK_ARG(a.num_ranks >= 2 && a.num_ranks <= kMaxNvlPeers,
               "the push combine needs 2 to " << kMaxNvlPeers << " ranks, got " << a.num_ranks);
  EP_CHECK_ARG(a.num_channels >= 1 && a.num_channels <= kMaxChannels,
               "channels (num_sms / 2) must be in [1, " << kMaxChannels << "], got " << a.num_channels);
  EP_CHECK_ARG(a.hidden > 0 && a.hidden % 8 == 0, "bf16 rows must be a multiple of 16 bytes, hidden = " << a.hidden);
  EP_CHECK_ARG(a.num_topk >= 0 && a.num_topk <= kMaxTopk, "top-k must be at most " << kMaxTopk);
  EP_CHECK_ARG(args.staging_bytes > 0 && args.staging_offset % 128 == 0,
               "the push combine needs a staging area on a 128-byte boundary");
#ifdef EP_PLUGIN_HAS_BULK_COPIES
  // Rows too long for the bulk pipeline's pieces (about 200 KB) go through registers.
  if (args.bulk_rows && bulk_rows_fit(2 * a.hidden)) {
    const int shared_bytes = bulk_rows_shared_bytes(kWarpsPerChannel);
    // NOTE: once per process, which drives one GPU (one rank per process).
    static const bool attribute_set = [shared_bytes] {
      CUDA_CHECK(cudaFuncSetAttribute(push_combine_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      shared_bytes));
      return true;
    }();
    (void)attribute_set;
    push_combine_kernel<true><<<a.num_channels * 2, kThreadsPerBlock, shared_bytes, stream>>>(args);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
#endif
  push_combine_kernel<false><<<a.num_channels * 2, kThreadsPerBlock, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
