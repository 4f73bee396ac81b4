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
// - Grid: num_channels * 2 blocks, at most direct_max_blocks. Each warp takes chunks of tokens, one at
//   a time from a counter (ClaimedTokens), and writes each row to every rank that has it, this rank
//   included.
// - Copy-engine rows (staged_epoch > 0): the host copies the rows of each rank's last staged_tokens
//   tokens into its peers' staging areas (one cudaMemcpyAsync per peer, runtime.cu); no SM stores those
//   across NVLink. Each rank's warps write every token's metadata first, then the rows of its first
//   tokens to every rank that has them and its own rows of the staged tokens, then move the rows it
//   receives from the staging area into recv_x as they land (staging_marks.cuh): row recv_src_idx[pos]
//   of source s goes to row pos. Each rank tells its first staged token at the handshake: all of x
//   when it goes whole (the default), a later one when x is larger than the area or when
//   EP_PLUGIN_DISPATCH_CE_SHARE leaves the first tokens to the SMs, whose stores then start at once
//   while the copy engine starts up.
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "dispatch_rows.cuh"
#include "intranode_common.cuh"
#include "intranode_profile.cuh"
#include "staging_marks.cuh"

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

// The handshake word's count: bit 0, the outputs are in the rank's region; bits 1-30, 1 + the rank's
// first token whose rows went into its peers' staging areas (copy-engine rows), 0 when none did.
constexpr uint32_t kHasRoom = 1;
constexpr int kNotStaged = -1;

__device__ __forceinline__ uint32_t handshake_count(const DispatchArgs& a) {
  const uint32_t first_staged = a.staged_tokens > 0 ? static_cast<uint32_t>(a.num_tokens - a.staged_tokens) + 1u : 0u;
  return (a.direct_has_room ? kHasRoom : 0u) | first_staged << 1;
}

// Thread r < R: tells rank r where this rank's outputs are, then waits for rank r's word (rank r
// has entered the call) and returns its outputs, whether they are in rank r's region, and rank r's
// first token whose row for this rank is in this rank's staging area (kNotStaged: none).
__device__ PeerOutputs exchange_outputs(const DispatchArgs& a, Header* me, uint32_t epoch, const WaitSite& site,
                                        bool& peer_has_room, int& peer_first_staged) {
  const int r = threadIdx.x;
  const void* own_base = a.peer_buffers[a.rank];
  Header* peer = header_of(a.peer_buffers, r);
  DirectOutputs& mine = peer->direct_outputs[a.rank];
  mine.recv_x = offset_in(own_base, a.recv_x);
  mine.recv_x_scales = offset_in(own_base, a.recv_x_scales);
  mine.recv_topk_idx = offset_in(own_base, a.recv_topk_idx);
  mine.recv_topk_weights = offset_in(own_base, a.recv_topk_weights);
  mine.recv_src_idx = offset_in(own_base, a.recv_src_idx);
  st_release_sys(&peer->direct_ready[a.rank], pack_counter(epoch, handshake_count(a), false));

  Deadline deadline(site);
  uint64_t ready;
  while (true) {
    ready = ld_acquire_sys(&me->direct_ready[r]);
    if (counter_epoch(ready) == epoch) break;
    deadline.check(kWaitPeerOutputs, r, epoch, counter_epoch(ready));
  }
  peer_has_room = (counter_count(ready) & kHasRoom) != 0;
  const uint32_t first_staged = counter_count(ready) >> 1;
  peer_first_staged = r != a.rank && first_staged > 0 ? static_cast<int>(first_staged - 1u) : kNotStaged;
  // NOTE: strong (relaxed, system-scope) loads, so that no word of an earlier call's outputs comes from a
  // stale L1 line; the acquire of `ready` orders them after rank r's writes. Acquire loads of each word
  // (EP_PLUGIN_DIRECT_EXCHANGE_LOADS=acquire) cost about 0.7 us more (twenty-fourth session).
  const DirectOutputs& theirs = me->direct_outputs[r];
  const bool acquire = a.direct_acquire_exchange_loads;
  auto word = [acquire](const int64_t& field) {
    const uint64_t* at = reinterpret_cast<const uint64_t*>(&field);
    return acquire ? ld_acquire_sys(at) : ld_relaxed_sys(at);
  };
  void* base = a.peer_buffers[r];
  return PeerOutputs{output_at<uint8_t>(base, word(theirs.recv_x)), output_at<float>(base, word(theirs.recv_x_scales)),
                     output_at<int64_t>(base, word(theirs.recv_topk_idx)),
                     output_at<float>(base, word(theirs.recv_topk_weights)),
                     output_at<int32_t>(base, word(theirs.recv_src_idx))};
}

// A warp's tokens, in chunks of `chunk` tokens. With claims, warp w of W starts with chunk w and, each
// time its chunk is done, claims the next one from a counter (chunks W, W + 1, ...), so that the warps
// of faster SMs take more: with fixed shares, blocks finished up to 25% apart (eighteenth session). A
// warp claims a chunk only when it needs one: a chunk claimed ahead is work that a warp which runs out
// first cannot take (claiming one or two ahead measured 1-2% slower). Without claims, warp w has the
// one chunk w. Rows go in order; row k is row k - first_row_ of the current chunk.
class ClaimedTokens {
 public:
  __device__ ClaimedTokens(uint32_t* counter, int warp_index, int num_warps, int chunk, int num_tokens, bool claims)
      : counter_(claims ? counter : nullptr),
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
    if (counter_ == nullptr) return num_tokens_;
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
    scales = a.x_scales + static_cast<int64_t>(t) * a.num_scales;
    num_early = early_scale_count(a);
    load_early_scales<Load::kReadOnly>(scales, num_early, early_scales);
  }

  // Lane r's `pos`: the token's row on rank r (-1: none); row_of[r] the same for every lane.
  __device__ void store(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers], int t, int pos,
                        const int (&row_of)[kMaxNvlPeers], uint32_t dst_mask) const {
    const int lane = lane_id();
    if (pos >= 0 && outputs[lane].src_idx != nullptr) outputs[lane].src_idx[pos] = t;
    for_each_scale<Load::kReadOnly>(scales, a.num_scales, num_early, early_scales, [&](int i, float scale) {
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

// A sender warp writes each token's rows and metadata. With copy-engine rows (kStaged) the metadata went
// first, and of the staged tokens (the last staged_tokens) it writes only this rank's own rows: the peers'
// rows went by copy engine.
template <bool kBulk, bool kStaged>
__device__ void direct_sender(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers], Header* me,
                              uint8_t* shared) {
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;
  const int R = a.num_ranks;
  const int num_warps = gridDim.x * kWarpsPerChannel;
  const bool claims = a.direct_chunk_tokens > 0;
  const int chunk = claims ? a.direct_chunk_tokens : (a.num_tokens + num_warps - 1) / num_warps;
  ClaimedTokens tokens(&me->direct_next_chunk, blockIdx.x * kWarpsPerChannel + warp, num_warps, chunk, a.num_tokens,
                       claims);
  SenderRows<kBulk> rows(a, shared, warp, kWarpsPerChannel);
  DirectSenderCycles cycles;
  constexpr bool with_metadata = !kStaged;
  // NOTE: the next row's positions load during this row when it is in the same chunk.
  auto load_pos = [&](int t) {
    bool lane_gets_row = lane < R && t >= 0;
    if constexpr (kStaged) lane_gets_row = lane_gets_row && (t < a.num_tokens - a.staged_tokens || lane == a.rank);
    return lane_gets_row ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
  };
  int prefetched_token = -1, prefetched_pos = -1;
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
    if (with_metadata) metadata.load(a, t);

    int row_of[kMaxNvlPeers];
    uint8_t* dst[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      row_of[r] = shfl(pos, r);
      dst[r] = r < R && (dst_mask >> r & 1u) ? outputs[r].x + static_cast<int64_t>(row_of[r]) * a.row_bytes : nullptr;
    }
    // Lane r writes rank r's rows.
    uint8_t* const lane_dst = pos < 0 ? nullptr : outputs[lane].x + static_cast<int64_t>(pos) * a.row_bytes;
    rows.copy(a, t, k, dst, lane_dst, tokens);
    prefetched_token = tokens.lookahead(k + 1);
    prefetched_pos = load_pos(prefetched_token);
    cycles.begin();
    if (with_metadata) metadata.store(a, outputs, t, pos, row_of, dst_mask);
    cycles.end_metadata();
  }
  cycles.begin();
  rows.complete();
  cycles.end_sender<kBulk>(rows, a.rank, R);
}

// ---- copy-engine rows --------------------------------------------------------------------------

// Whether this rank has metadata to send besides its rows (a cached BF16 dispatch has none). A rank whose
// peers need its source indices (a non-cached dispatch) always does: it has tokens, so topk_idx.
__device__ __forceinline__ bool has_metadata(const DispatchArgs& a) {
  return a.num_scales > 0 || a.topk_idx != nullptr;
}

// Every token's metadata for every rank that has it, tokens spread over all warps of the grid.
__device__ void write_all_metadata(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers]) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int num_warps = gridDim.x * kWarpsPerChannel;
  for (int t = blockIdx.x * kWarpsPerChannel + (threadIdx.x >> 5); t < a.num_tokens; t += num_warps) {
    const int pos = lane < R ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
    const uint32_t dst_mask = __ballot_sync(0xffffffffu, pos >= 0);
    if (dst_mask == 0) continue;
    TokenMetadata metadata;
    metadata.load(a, t);
    int row_of[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) row_of[r] = shfl(pos, r);
    metadata.store(a, outputs, t, pos, row_of, dst_mask);
  }
}

// After every block's metadata: the last block past it tells each peer that this rank's metadata is
// written there (its receivers read the source indices it wrote). The other blocks go on at once.
__device__ void signal_metadata_written(const DispatchArgs& a, Header* me, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (atomicAdd(&me->metadata_blocks_done, 1u) + 1u != gridDim.x) return;
  me->metadata_blocks_done = 0;
  __threadfence_system();
  for (int r = 0; r < a.num_ranks; ++r)
    if (r != a.rank)
      st_release_sys(&header_of(a.peer_buffers, r)->direct_metadata_done[a.rank], pack_counter(epoch, 0, true));
}

__device__ __forceinline__ bool epoch_reached(uint64_t word, uint32_t epoch) {
  return static_cast<int32_t>(counter_epoch(word) - epoch) >= 0;
}

// One thread waits until `word` (written by `source`) carries this call's epoch or a later one.
__device__ void wait_for_word(const uint64_t* word, uint32_t epoch, int source, int kind, const WaitSite& site) {
  Deadline deadline(site);
  uint64_t value;
  while (!epoch_reached(value = ld_acquire_sys(word), epoch)) deadline.check(kind, source, epoch, counter_epoch(value));
}

// Source s's staged rows in this rank's staging area (from its first staged token on).
__device__ __forceinline__ const int4* staged_x_of(const DispatchArgs& a, int source) {
  return reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.peer_buffers[a.rank]) +
                                       staged_x_offset(a.staging_offset, a.staging_peer_bytes, a.rank, source));
}

// Re-reads a staged unit until no word of it is unlanded or its source's copy is reported landed.
// NOTE: the acquire comes before the re-read, so a read after the report sees the landed bytes.
__device__ int4 wait_for_staged_unit(const int4* at, const uint64_t* landed, uint32_t epoch, int source,
                                     const WaitSite& site) {
  Deadline deadline(site);
  while (true) {
    const bool reported = epoch_reached(ld_acquire_sys(landed), epoch);
    const int4 value = load_staged(at);
    if (reported || !has_unlanded_word(value)) return value;
    deadline.check(kWaitStagedDispatchRows, source, epoch, 0);
  }
}

constexpr int kMoveUnroll = 8;  // 16-byte units in flight per lane while a warp moves a staged row

// One warp moves a staged row into recv_x, each unit once it has landed.
__device__ void move_staged_row(const int4* src, int4* dst, int num_units, const uint64_t* landed, uint32_t epoch,
                                int source, const WaitSite& site) {
  const int lane = lane_id();
  for (int base = 0; base < num_units; base += 32 * kMoveUnroll) {
    int4 units[kMoveUnroll];
#pragma unroll
    for (int u = 0; u < kMoveUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < num_units) units[u] = load_staged(src + i);
    }
#pragma unroll
    for (int u = 0; u < kMoveUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i >= num_units) continue;
      if (has_unlanded_word(units[u])) units[u] = wait_for_staged_unit(src + i, landed, epoch, source, site);
      st_na_v4(dst + i, units[u]);
    }
  }
}

// The rows this rank receives from the staged sources: source s's block of recv_x, in recv order. The
// rows of a source's tokens before its first staged one (a prefix of the block) came by SM stores.
struct StagedBlocks {
  int begin[kMaxNvlPeers];  // first received row of the source's block
  int count[kMaxNvlPeers];  // its rows (0: not staged)
  int total;

  __device__ StagedBlocks(const DispatchArgs& a, const int (&first_staged)[kMaxNvlPeers]) : total(0) {
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      begin[r] = r < a.num_ranks ? a.recv_rank_offsets[r] : 0;
      count[r] = r < a.num_ranks && first_staged[r] != kNotStaged ? a.recv_rank_offsets[r + 1] - begin[r] : 0;
      total += count[r];
    }
  }
  // The source of the index-th staged row; index becomes the row's place in the source's block.
  __device__ int source_of(int& index) const {
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers - 1; ++r) {
      if (index < count[r]) return r;
      index -= count[r];
    }
    return kMaxNvlPeers - 1;
  }
};

// Each warp claims staged sources' rows one at a time and moves those that were staged: row pos of source
// s's block is token src_idx[pos] of s. Without the handle's source indices (a cached dispatch has them),
// the warp first waits until s has written them (direct_metadata_done).
__device__ void move_staged_rows(const DispatchArgs& a, Header* me, const int (&first_staged)[kMaxNvlPeers],
                                 uint32_t epoch, const WaitSite& site) {
  const StagedBlocks blocks(a, first_staged);
  const int lane = lane_id();
  const int num_units = a.row_bytes / 16;
  uint32_t metadata_seen = 0;  // sources whose metadata this warp has seen written
  while (true) {
    int index = lane == 0 ? static_cast<int>(atomicAdd(&me->direct_next_move, 1u)) : 0;
    index = shfl(index, 0);
    if (index >= blocks.total) return;
    const int source = blocks.source_of(index);
    const int pos = blocks.begin[source] + index;
    const int32_t* src_idx = a.cached_src_idx;
    if (src_idx == nullptr) {
      if (!(metadata_seen >> source & 1u)) {
        if (lane == 0) wait_for_word(&me->direct_metadata_done[source], epoch, source, kWaitPeerMetadata, site);
        __syncwarp();
        metadata_seen |= 1u << source;
      }
      src_idx = a.recv_src_idx;
    }
    // NOTE: written by the source through NVLink; read from L2, never from a stale L1 line.
    const int t = ld_cg_s32(src_idx + pos);
    if (t < first_staged[source]) continue;  // the source's SMs wrote this row
    move_staged_row(staged_x_of(a, source) + static_cast<int64_t>(t - first_staged[source]) * num_units,
                    reinterpret_cast<int4*>(static_cast<uint8_t*>(a.recv_x) + static_cast<int64_t>(pos) * a.row_bytes),
                    num_units, &me->staged_landed[source], epoch, source, site);
  }
}

// Thread 0: waits until every staged source's copy has landed whole (also its rows this rank does not
// receive), so that the host may refill the area once the kernel has ended.
__device__ void wait_for_staged_copies(const DispatchArgs& a, Header* me, const int (&first_staged)[kMaxNvlPeers],
                                       uint32_t epoch, const WaitSite& site) {
  for (int r = 0; r < a.num_ranks; ++r)
    if (first_staged[r] != kNotStaged) wait_for_word(&me->staged_landed[r], epoch, r, kWaitStagedDispatchRows, site);
}

// After every block's writes: the last block out tells each rank that this rank's rows are all
// written, waits until every rank's rows are here, and ends the operation.
__device__ void finish_direct(const DispatchArgs& a, Header* me, uint32_t epoch, const WaitSite& site,
                              const int (&first_staged)[kMaxNvlPeers]) {
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
  // system-scope fence in every block (EP_PLUGIN_DIRECT_BLOCK_FENCE=sys) cost about 1.3 us.
  if (a.direct_block_fence_sys) __threadfence_system();
  else __threadfence();
  if (atomicAdd(&me->blocks_done, 1u) + 1u != gridDim.x) return;
  me->blocks_done = 0;
  me->direct_next_chunk = 0;  // every warp has made its last claim
  me->direct_next_move = 0;
  __threadfence_system();
  for (int r = 0; r < a.num_ranks; ++r)
    st_release_sys(&header_of(a.peer_buffers, r)->direct_done[a.rank], pack_counter(epoch, 0, true));
  // NOTE: a peer already in its next call has written a later epoch.
  for (int r = 0; r < a.num_ranks; ++r) wait_for_word(&me->direct_done[r], epoch, r, kWaitPeerRows, site);
  if (a.staged_epoch > 0) wait_for_staged_copies(a, me, first_staged, a.staged_epoch, site);
  me->op_epoch = epoch;
  __threadfence();
}

// kStaged: copy-engine rows (a kernel of its own, so that the plain path's registers stay as they were).
template <bool kBulk, bool kStaged>
__device__ void direct_rows_and_metadata(const DispatchArgs& a, const PeerOutputs (&outputs)[kMaxNvlPeers],
                                         Header* me, uint8_t* shared, const int (&first_staged)[kMaxNvlPeers],
                                         const WaitSite& site) {
  if constexpr (!kStaged) {
    direct_sender<kBulk, false>(a, outputs, me, shared);
    return;
  }
  // Copy-engine rows: the metadata first (a peer's warps need its source indices to move its rows),
  // then the rows the SMs write (the first tokens' rows to every rank, then the own rows of the staged
  // ones), then the received rows as they land.
  if (has_metadata(a)) {
    write_all_metadata(a, outputs);
    signal_metadata_written(a, me, a.staged_epoch);
  }
  direct_sender<kBulk, true>(a, outputs, me, shared);
  move_staged_rows(a, me, first_staged, a.staged_epoch, site);
}

template <bool kStaged>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) direct_dispatch_kernel(DispatchArgs args) {
  // NOTE: 128-byte aligned whatever the static shared memory before it: the bulk copies' pieces lost
  // a third of their rate when one more static byte array left them only 16-byte aligned.
  extern __shared__ __align__(128) uint8_t shared[];
  __shared__ PeerOutputs outputs[kMaxNvlPeers];
  __shared__ int first_staged[kMaxNvlPeers];  // [r]: rank r's first token staged here (kNotStaged: none)
  Header* me = header_of(args.peer_buffers, args.rank);
  const uint32_t epoch = me->op_epoch + 1;
  // NOTE: a timeout report's "channel" is the block here.
  const WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpDispatch, args.rank,
                      static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x >> 5)};
  bool peer_has_room = true;
  int peer_first_staged = kNotStaged;
  direct_mark(kMarkStart);
  if (threadIdx.x < kMaxNvlPeers) first_staged[threadIdx.x] = kNotStaged;
  __syncthreads();
  if (threadIdx.x < args.num_ranks) {
    outputs[threadIdx.x] = exchange_outputs(args, me, epoch, site, peer_has_room, peer_first_staged);
    first_staged[threadIdx.x] = peer_first_staged;
  }
  const bool every_rank_has_room = __syncthreads_and(peer_has_room);
  // NOTE: read by the ring kernel launched after this one, once this kernel has ended (it waits for
  // that with griddepcontrol.wait); it runs on a fallback.
  if (blockIdx.x == 0 && threadIdx.x == 0) me->direct_fell_back = every_rank_has_room ? 0u : 1u;
  if (!every_rank_has_room) {
    // The ring kernel moves the rows; the staged copies must still land before the host refills the area.
    if (blockIdx.x == 0 && threadIdx.x == 0 && args.staged_epoch > 0)
      wait_for_staged_copies(args, me, first_staged, args.staged_epoch, site);
    return;
  }
  direct_mark(kMarkExchanged);
  mark_padding_rows(args, blockIdx.x, gridDim.x);
#ifdef EP_PLUGIN_HAS_BULK_COPIES
  if (args.bulk_rows) direct_rows_and_metadata<true, kStaged>(args, outputs, me, shared, first_staged, site);
  else
#endif
    direct_rows_and_metadata<false, kStaged>(args, outputs, me, shared, first_staged, site);
  direct_mark_block(kMarkRowsWritten);
  finish_direct(args, me, epoch, site, first_staged);
  report_direct_phases(args.rank, args.num_tokens, args.row_bytes, args.topk_idx == nullptr);
}

}  // namespace

void launch_direct_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  check_dispatch_args(args);
  const int num_blocks = args.direct_max_blocks > 0 && args.direct_max_blocks < args.num_channels * 2
                             ? args.direct_max_blocks
                             : args.num_channels * 2;
  if (args.staged_epoch > 0) {
    EP_CHECK_ARG(args.num_ranks >= 2 && args.staging_peer_bytes > 0 && args.recv_rank_offsets != nullptr,
                 "copy-engine dispatch rows need 2 or more ranks, a staging area and recv_rank_offsets");
    EP_CHECK_ARG(args.staged_tokens >= 0 && args.staged_tokens <= args.num_tokens &&
                     static_cast<int64_t>(args.staged_tokens) * args.row_bytes <= args.staging_peer_bytes,
                 "staged_tokens (" << args.staged_tokens << ") must be in [0, num_tokens] and fit staging_peer_bytes");
    EP_CHECK_ARG(args.num_tokens < (1 << 29), "copy-engine dispatch rows: the handshake holds tokens below 2^29");
    const int shared_bytes = bulk_rows_shared_bytes_for<direct_dispatch_kernel<true>>(args);
    direct_dispatch_kernel<true><<<num_blocks, kThreadsPerBlock, shared_bytes, stream>>>(args);
  } else {
    EP_CHECK_ARG(args.staged_tokens == 0, "staged_tokens needs copy-engine rows (staged_epoch > 0)");
    const int shared_bytes = bulk_rows_shared_bytes_for<direct_dispatch_kernel<false>>(args);
    direct_dispatch_kernel<false><<<num_blocks, kThreadsPerBlock, shared_bytes, stream>>>(args);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
