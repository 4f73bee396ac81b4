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
//   after it moves the rows instead (outputs anywhere). That launch overlaps this kernel's end.
// - The last block out tells every rank that this rank's rows are written (direct_done), then waits
//   until every rank's rows are here: the outputs are complete when the kernel ends.
// - On an error (a wait that expires, or an earlier kernel of this rank that failed) a block ends as
//   on a fallback, before any row moves; the ring kernel after it then sees the error and ends too.
//   Past the handshake, a wait that expires only ends the wait: the outputs are undefined.
// - Grid: num_channels * 2 blocks, at most direct_max_blocks. Each warp takes chunks of
//   direct_chunk_tokens tokens, one at a time from a counter (ClaimedTokens), and writes each row to
//   every rank that has it, this rank included.
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

// The handshake word's count: 1 when the outputs are in the rank's region, 0 when not.
constexpr uint32_t kHasRoom = 1;

// Thread r < R: tells rank r where this rank's outputs are, then waits for rank r's word (rank r
// has entered the call) and returns its outputs and whether they are in rank r's region. On an error
// (this rank's claim word is set, or the wait expires) `peer_has_room` is false and the outputs unset.
__device__ PeerOutputs exchange_outputs(const DispatchArgs& a, Header* me, uint32_t epoch, const WaitSite& site,
                                        bool& peer_has_room) {
  const int r = threadIdx.x;
  peer_has_room = false;
  if (error_claimed(&me->error_claim)) return PeerOutputs{};
  const void* own_base = a.peer_buffers[a.rank];
  Header* peer = header_of(a.peer_buffers, r);
  DirectOutputs& mine = peer->direct_outputs[a.rank];
  mine.recv_x = offset_in(own_base, a.recv_x);
  mine.recv_x_scales = offset_in(own_base, a.recv_x_scales);
  mine.recv_topk_idx = offset_in(own_base, a.recv_topk_idx);
  mine.recv_topk_weights = offset_in(own_base, a.recv_topk_weights);
  mine.recv_src_idx = offset_in(own_base, a.recv_src_idx);
  st_release_sys(&peer->direct_ready[a.rank], pack_counter(epoch, a.direct_has_room ? kHasRoom : 0u, false));

  Deadline deadline(site);
  uint64_t ready;
  while (true) {
    ready = ld_acquire_sys(&me->direct_ready[r]);
    if (counter_epoch(ready) == epoch) break;
    if (deadline.expired(kWaitPeerOutputs, r, epoch, counter_epoch(ready))) return PeerOutputs{};
  }
  peer_has_room = (counter_count(ready) & kHasRoom) != 0;
  // NOTE: strong (relaxed, system-scope) loads, so that no word of an earlier call's outputs comes from a
  // stale L1 line; the acquire of `ready` orders them after rank r's writes (an acquire load of each
  // word costs about 0.7 us more).
  const DirectOutputs& theirs = me->direct_outputs[r];
  auto word = [](const int64_t& field) { return ld_relaxed_sys(reinterpret_cast<const uint64_t*>(&field)); };
  void* base = a.peer_buffers[r];
  return PeerOutputs{output_at<uint8_t>(base, word(theirs.recv_x)), output_at<float>(base, word(theirs.recv_x_scales)),
                     output_at<int64_t>(base, word(theirs.recv_topk_idx)),
                     output_at<float>(base, word(theirs.recv_topk_weights)),
                     output_at<int32_t>(base, word(theirs.recv_src_idx))};
}

// A warp's tokens, in chunks of `chunk` tokens. Warp w of W starts with chunk w and, each time its
// chunk is done, claims the next one from a counter (chunks W, W + 1, ...), so that the warps of faster
// SMs take more: with fixed shares, blocks finished up to 25% apart. A warp claims a chunk only when it
// needs one: a chunk claimed ahead is work that a warp which runs out first cannot take (claiming one
// or two ahead measured 1-2% slower). Rows go in order; row k is row k - first_row_ of the current chunk.
class ClaimedTokens {
 public:
  __device__ ClaimedTokens(uint32_t* counter, int warp_index, int num_warps, int chunk, int num_tokens)
      : counter_(counter),
        num_warps_(num_warps),
        chunk_(chunk),
        num_tokens_(num_tokens),
        current_(warp_index * chunk) {}

  // Every lane, as row k starts (k = 0, 1, ...): whether the warp has a row k.
  __device__ bool begin_row(int k) {
    if (k == first_row_ + chunk_) {
      first_row_ = k;
      current_ = shfl(claim(), 0);
    }
    return token(k) < num_tokens_;
  }
  // The token of row k (begun).
  __device__ int token(int k) const { return current_ + (k - first_row_); }
  // The token of row k >= the current row if it is in the current chunk, else -1. Any lane.
  __device__ int lookahead(int k) const {
    return k - first_row_ < chunk_ && token(k) < num_tokens_ ? token(k) : -1;
  }

 private:
  // Lane 0: the first token of a newly claimed chunk (num_tokens once past the end); others: 0.
  __device__ int claim() const {
    if (lane_id() != 0) return 0;
    const int64_t first = (static_cast<int64_t>(atomicAdd(counter_, 1u)) + num_warps_) * chunk_;
    return first < num_tokens_ ? static_cast<int>(first) : num_tokens_;
  }

  uint32_t* counter_;
  int num_warps_, chunk_, num_tokens_;
  int first_row_ = 0;  // the warp's row index of the current chunk's first token
  int current_;        // first token of the current chunk (num_tokens: none)
};

// A token's metadata for every rank that has it: the source index, FP8 scales and top-k ids (made
// destination-local, -1 elsewhere) with their weights. Loaded before the token's row copy, so that
// its latency hides under the copy; stored after it.
struct TokenMetadata {
  int64_t expert;
  float weight;
  bool has_topk;
  const float* scales;
  int num_early;
  float early_scales[kEarlyScalesPerLane];

  __device__ void load(const DispatchArgs& a, int t) {
    const int lane = lane_id();
    has_topk = a.num_topk > 0 && lane < a.num_topk;
    expert = has_topk ? a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane] : -1;
    weight = has_topk && a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;
    scales = a.x_scales + static_cast<int64_t>(t) * a.scale_token_stride;
    num_early = early_scale_count(a);
    load_early_scales<Load::kReadOnly>(scales, a.scale_stride, num_early, early_scales);
  }

  // Lane r's `pos`: the token's row on rank r (-1: none); row_of[r] the same for every lane.
  __device__ void store(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers], int t, int pos,
                        const int (&row_of)[kMaxNvlPeers], uint32_t dst_mask) const {
    const int lane = lane_id();
    if (pos >= 0 && outputs[lane].src_idx != nullptr) outputs[lane].src_idx[pos] = t;
    for_each_scale<Load::kReadOnly>(scales, a.scale_stride, a.num_scales, num_early, early_scales,
                                    [&](int i, float scale) {
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r)
        if (dst_mask >> r & 1u) outputs[r].scales[static_cast<int64_t>(row_of[r]) * a.num_scales + i] = scale;
    });
    if (!has_topk) return;
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      if (!(dst_mask >> r & 1u)) continue;
      const int32_t local_id = local_expert_id(expert, r, a.num_local_experts);
      const int64_t at = static_cast<int64_t>(row_of[r]) * a.num_topk + lane;
      if (outputs[r].topk_idx != nullptr) outputs[r].topk_idx[at] = local_id;
      if (outputs[r].topk_weights != nullptr) outputs[r].topk_weights[at] = local_id >= 0 ? weight : 0.f;
    }
  }
};

// Whether the copy engine writes a token's own row: the token lies in one of its runs. A warp's tokens
// increase (ClaimedTokens), so its cursor over the runs (in token order) only moves forward.
// NOTE: a token missed here would only have its row written twice, with the same bytes.
class EngineRuns {
 public:
  __device__ bool cover(const DispatchArgs& a, int t) {
    while (next_ < a.num_engine_runs && a.engine_run_end[next_] <= t) ++next_;
    return next_ < a.num_engine_runs && t >= a.engine_run_first[next_];
  }

 private:
  int next_ = 0;
};

// A sender warp writes each token's rows and metadata.
template <bool kBulk>
__device__ void direct_sender(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers], Header* me,
                              uint8_t* shared) {
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;
  const int R = a.num_ranks;
  const int num_warps = gridDim.x * kWarpsPerChannel;
  ClaimedTokens tokens(&me->direct_next_chunk, blockIdx.x * kWarpsPerChannel + warp, num_warps,
                       a.direct_chunk_tokens, a.num_tokens);
  SenderRows<kBulk> rows(a, shared, warp, kWarpsPerChannel);
  // NOTE: the next row's positions load during this row when it is in the same chunk.
  auto load_pos = [&](int t) { return lane < R && t >= 0 ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1; };
  int prefetched_token = -1, prefetched_pos = -1;
  EngineRuns engine_runs;
  for (int k = 0; tokens.begin_row(k); ++k) {
    const int t = tokens.token(k);
    const int pos = t == prefetched_token ? prefetched_pos : load_pos(t);
    const uint32_t dst_mask = __ballot_sync(0xffffffffu, pos >= 0);
    if (dst_mask == 0) {
      rows.skip(k, tokens);
      prefetched_token = tokens.lookahead(k + 1);
      prefetched_pos = load_pos(prefetched_token);
      continue;
    }
    // Issue the top-k and scale loads before the row copy, which does not depend on them.
    TokenMetadata metadata;
    metadata.load(a, t);

    int row_of[kMaxNvlPeers];
    uint8_t* dst[kMaxNvlPeers];
    // Ranks whose row this warp writes: the own row may be the copy engine's.
    const uint32_t row_mask = engine_runs.cover(a, t) ? dst_mask & ~(1u << a.rank) : dst_mask;
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      row_of[r] = shfl(pos, r);
      dst[r] = r < R && (row_mask >> r & 1u) ? outputs[r].x + static_cast<int64_t>(row_of[r]) * a.row_bytes : nullptr;
    }
    // Lane r writes rank r's rows.
    uint8_t* const lane_dst = (row_mask >> lane & 1u) ? outputs[lane].x + static_cast<int64_t>(pos) * a.row_bytes
                                                      : nullptr;
    if (row_mask != 0) rows.copy(a, t, k, dst, lane_dst, tokens);
    else rows.skip(k, tokens);
    prefetched_token = tokens.lookahead(k + 1);
    prefetched_pos = load_pos(prefetched_token);
    metadata.store(a, outputs, t, pos, row_of, dst_mask);
  }
  rows.complete();
}

__device__ __forceinline__ bool epoch_reached(uint64_t word, uint32_t epoch) {
  return static_cast<int32_t>(counter_epoch(word) - epoch) >= 0;
}

// One thread waits until `word` (written by `source`) carries this call's epoch or a later one; false
// if the wait expired.
__device__ bool wait_for_word(const uint64_t* word, uint32_t epoch, int source, int kind, const WaitSite& site) {
  Deadline deadline(site);
  uint64_t value;
  while (!epoch_reached(value = ld_acquire_sys(word), epoch))
    if (deadline.expired(kind, source, epoch, counter_epoch(value))) return false;
  return true;
}

// After every block's writes: the last block out tells each rank that this rank's rows are all
// written, waits until every rank's rows are here, and ends the operation.
__device__ void finish_direct(const DispatchArgs& a, Header* me, uint32_t epoch, const WaitSite& site) {
  // NOTE: each thread's bulk stores completed (SenderRows::complete); the barrier, the fence before the
  // count and the last block's system-scope fence make every block's writes visible before its release.
#ifdef EP_PLUGIN_HAS_BULK_COPIES
  fence_proxy_async();
#endif
  __syncthreads();
  // The ring kernel launched after this one (it only checks direct_fell_back) may start now.
  launch_dependents();
  if (threadIdx.x != 0) return;
  // NOTE: a GPU-scope fence is enough: the last block's system-scope fence below, after it has seen every
  // block's count, orders all their writes before its release to the peers (fences are cumulative). A
  // system-scope fence in every block cost about 1.3 us.
  __threadfence();
  if (atomicAdd(&me->blocks_done, 1u) + 1u != gridDim.x) return;
  me->blocks_done = 0;
  me->direct_next_chunk = 0;  // every warp has made its last claim
  __threadfence_system();
  for (int r = 0; r < a.num_ranks; ++r)
    st_release_sys(&header_of(a.peer_buffers, r)->direct_done[a.rank], pack_counter(epoch, 0, true));
  // NOTE: a peer already in its next call has written a later epoch.
  for (int r = 0; r < a.num_ranks; ++r)
    if (!wait_for_word(&me->direct_done[r], epoch, r, kWaitPeerRows, site)) return;
  me->op_epoch = epoch;
  __threadfence();
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) direct_dispatch_kernel(DispatchArgs args) {
  // NOTE: 128-byte aligned whatever the static shared memory before it: the bulk copies' pieces lost
  // a third of their rate when one more static byte array left them only 16-byte aligned.
  extern __shared__ __align__(128) uint8_t shared[];
  __shared__ PeerOutputs outputs[kMaxNvlPeers];
  Header* me = header_of(args.peer_buffers, args.rank);
  const uint32_t epoch = me->op_epoch + 1;
  // NOTE: a timeout report's "channel" is the block here.
  const WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpDispatch, args.rank,
                      static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x >> 5)};
  bool peer_has_room = true;
  if (threadIdx.x < args.num_ranks) outputs[threadIdx.x] = exchange_outputs(args, me, epoch, site, peer_has_room);
  const bool every_rank_has_room = __syncthreads_and(peer_has_room);
  // NOTE: read by the ring kernel launched after this one, once this kernel has ended (it waits for
  // that with griddepcontrol.wait); it runs on a fallback.
  if (blockIdx.x == 0 && threadIdx.x == 0) me->direct_fell_back = every_rank_has_room ? 0u : 1u;
  if (!every_rank_has_room) return;  // the ring kernel moves the rows (or, on an error, ends)
  mark_padding_rows(args, blockIdx.x, gridDim.x);
#ifdef EP_PLUGIN_HAS_BULK_COPIES
  if (args.bulk_rows) direct_sender<true>(args, outputs, me, shared);
  else
#endif
    direct_sender<false>(args, outputs, me, shared);
  finish_direct(args, me, epoch, site);
}

}  // namespace

int direct_dispatch_blocks(const DispatchArgs& args) {
  return args.direct_max_blocks > 0 && args.direct_max_blocks < args.num_channels * 2 ? args.direct_max_blocks
                                                                                       : args.num_channels * 2;
}

void launch_direct_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  check_dispatch_args(args);
  EP_CHECK_ARG(args.direct_max_blocks >= 0, "dispatch.direct_max_blocks must be >= 0, got " << args.direct_max_blocks);
  EP_CHECK_ARG(args.direct_chunk_tokens >= 1,
               "dispatch.direct_chunk_tokens must be >= 1, got " << args.direct_chunk_tokens);
  const int shared_bytes = bulk_rows_shared_bytes_for<direct_dispatch_kernel>(args);
  direct_dispatch_kernel<<<direct_dispatch_blocks(args), kThreadsPerBlock, shared_bytes, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
