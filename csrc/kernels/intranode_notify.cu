// Notify: exchange token counts between the ranks of one NVLink domain and derive the layout.
//
// One block. Each rank checks its expert ids, counts its tokens per destination rank, writes the
// counts (and its per-expert counts) into every peer's header, then raises its notify signal there.
// After all signals arrived, every rank knows the full rank-to-rank count matrix and computes:
//   recv_rank_offsets[s]   first row of source s's tokens in this rank's recv_x
//   send_pos[t][r]         row of this rank's token t on rank r (or -1)
//   per-expert receive counts and the received-token total (for the host, or checked on device).
// Notify areas are double-buffered by epoch parity: a peer can be at most one notify ahead.
// On an error (a timed-out wait; in graph mode also bad input) the kernel records it and leaves, as
// it does when an earlier kernel of this rank failed: its outputs are then undefined.
#include <climits>

#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"

namespace ep_plugin::intranode {
namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kNotifyWarps = kNotifyThreads / 32;

// Per-warp counts into exclusive offsets from `base`; `base` moves past them.
__device__ __forceinline__ void warp_counts_to_offsets(int (&counts)[kNotifyWarps], int& base) {
  int offset = base;
  for (int w = 0; w < kNotifyWarps; ++w) {
    const int count = counts[w];
    counts[w] = offset;
    offset += count;
  }
  base = offset;
}

constexpr uint32_t kAllLanes = 0xffffffffu;

// Notify found bad input or too many received tokens (num_worst_tokens): records it and prints the reason.
__device__ void record_notify_error(const NotifyArgs& args, const NotifyBlock* blocks, int over_rank, int over_total,
                                    int bad_rank, int other_layout_rank) {
  Header* me = header_of(args.peer_buffers, args.rank);
  if (over_rank >= 0) {
    record_error(args.status, &me->error_claim, kErrTooManyRecvTokens, kOpNotify, 0, args.rank, over_rank, -1, -1,
                 args.num_worst_tokens, over_total);
    printf("ep_plugin: rank %d receives %d tokens, more than num_worst_tokens = %d\n", over_rank, over_total,
           args.num_worst_tokens);
  } else if (bad_rank >= 0) {
    const NotifyBlock& bad = blocks[bad_rank];
    record_error(args.status, &me->error_claim, kErrBadExpertId, kOpNotify, 0, args.rank, bad_rank, -1, -1,
                 bad.bad_input_detail[0], bad.bad_input_detail[2]);
    printf("ep_plugin: rank %d: topk_idx[%lld, %lld] = %lld is not an expert id in [-1, %d)\n", bad_rank,
           static_cast<long long>(bad.bad_input_detail[0]), static_cast<long long>(bad.bad_input_detail[1]),
           static_cast<long long>(bad.bad_input_detail[2]), args.num_experts);
  } else {
    const int64_t theirs = blocks[other_layout_rank].row_layout;
    record_error(args.status, &me->error_claim, kErrLayoutMismatch, kOpNotify, 0, args.rank, other_layout_rank, -1,
                 -1, args.row_layout, theirs);
    printf("ep_plugin: rank %d dispatches rows of %d bytes, %d scales, top-%d%s; rank %d rows of %d bytes, %d "
           "scales, top-%d%s\n", args.rank, row_layout_bytes(args.row_layout), row_layout_scales(args.row_layout),
           row_layout_topk(args.row_layout), row_layout_weights(args.row_layout) ? " with weights" : "",
           other_layout_rank, row_layout_bytes(theirs), row_layout_scales(theirs), row_layout_topk(theirs),
           row_layout_weights(theirs) ? " with weights" : "");
  }
}

// The host's view of the count matrix, by warp 0 (lane s: source rank s); the tag goes after.
__device__ void publish_rank_counts(const NotifyArgs& args, const NotifyBlock* blocks, int lane, int from_source,
                                    int num_recv, int largest, int bad_rank, int other_layout_rank) {
  DeviceStatus* status = args.status;
  if (lane < args.num_ranks) status->num_recv_tokens_per_rank[lane] = from_source;
  if (lane != 0) return;
  status->num_recv_tokens = num_recv;
  status->largest_block_rows = largest;
  status->bad_input_rank = bad_rank >= 0 ? bad_rank : other_layout_rank;
  if (bad_rank >= 0) {
    status->bad_input_code = blocks[bad_rank].bad_input_code;
    for (int i = 0; i < 3; ++i) status->bad_input_detail[i] = blocks[bad_rank].bad_input_detail[i];
  } else if (other_layout_rank >= 0) {
    status->bad_input_code = kErrLayoutMismatch;
    status->bad_input_detail[0] = args.row_layout;
    status->bad_input_detail[1] = blocks[other_layout_rank].row_layout;
  }
}

// Warp 0 after the barrier, every lane's loads at once (lane s: what source rank s sends here; lane r: what
// every rank sends destination r): the offsets of this rank's received blocks and of its blocks on each
// destination, the checks of every rank's input, and (host mode) the counts for the host. Sets `failed`
// where this rank records an error.
__device__ void read_count_matrix(const NotifyArgs& args, const NotifyBlock* blocks, int lane,
                                  int (&offset_on_rank)[kMaxNvlPeers], bool& failed) {
  const int R = args.num_ranks;
  const bool is_rank = lane < R;
  const int from_source = is_rank ? blocks[lane].tokens_to_rank[args.rank] : 0;
  int below = 0, into = 0, largest = 0;  // for destination `lane`: rows from ranks below this one, from all
#pragma unroll
  for (int s = 0; s < kMaxNvlPeers; ++s) {
    if (s < R && is_rank) {
      const int rows = blocks[s].tokens_to_rank[lane];
      if (s < args.rank) below += rows;
      into += rows;
      largest = max(largest, rows);
    }
  }
  int inclusive = from_source;
  for (int d = 1; d < 32; d <<= 1) {
    const int value = __shfl_up_sync(kAllLanes, inclusive, d);
    if (lane >= d) inclusive += value;
  }
  const int num_recv = __shfl_sync(kAllLanes, inclusive, R - 1);
  for (int d = 16; d > 0; d >>= 1) largest = max(largest, __shfl_xor_sync(kAllLanes, largest, d));
  const uint32_t bad = __ballot_sync(kAllLanes, is_rank && blocks[lane].bad_input_code != kErrNone);
  const uint32_t other = __ballot_sync(kAllLanes, is_rank && blocks[lane].row_layout != args.row_layout);
  const uint32_t over = __ballot_sync(kAllLanes, is_rank && args.num_worst_tokens > 0 && into > args.num_worst_tokens);
  const int bad_rank = bad ? __ffs(bad) - 1 : -1, other_layout_rank = other ? __ffs(other) - 1 : -1;
  const int over_rank = over ? __ffs(over) - 1 : -1;
  const int over_total = __shfl_sync(kAllLanes, into, over ? over_rank : 0);
  if (is_rank) {
    args.recv_rank_offsets[lane] = inclusive - from_source;
    args.src_num_tokens[lane] = blocks[lane].num_tokens;
    offset_on_rank[lane] = below;
  }
  if (lane == 0) args.recv_rank_offsets[R] = num_recv, *args.num_recv_tokens = num_recv;
  // Host mode reports bad input from the host, after the tag; too many received tokens always here.
  const bool reported_here = over_rank >= 0 || (args.host_tag == 0 && (bad_rank >= 0 || other_layout_rank >= 0));
  if (reported_here) {
    if (lane == 0) record_notify_error(args, blocks, over_rank, over_total, bad_rank, other_layout_rank), failed = true;
    return;
  }
  if (args.host_tag > 0) publish_rank_counts(args, blocks, lane, from_source, num_recv, largest, bad_rank, other_layout_rank);
}

// Per-expert receive counts, aligned, into the host's status (thread `first` of `stride` threads).
__device__ void publish_expert_counts(const NotifyArgs& args, const NotifyBlock* blocks, int experts_per_rank,
                                      int first, int stride) {
  for (int j = first; j < experts_per_rank; j += stride) {
    int total = 0;
    for (int s = 0; s < args.num_ranks; ++s) total += blocks[s].expert_counts[j];
    const int align = args.expert_alignment;
    args.status->num_recv_tokens_per_expert[j] = (total + align - 1) / align * align;
  }
}

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs args) {
  __shared__ int token_counts[kMaxNvlPeers];
  __shared__ int first_bad_entry;
  __shared__ uint32_t epoch;
  __shared__ int offset_on_rank[kMaxNvlPeers];  // first row of this rank's block on each destination
  __shared__ int warp_totals[kMaxNvlPeers][kNotifyWarps];
  __shared__ int running_base[kMaxNvlPeers];
  __shared__ int run_totals[2][kNotifyWarps];  // per warp: own runs that start, that end in its tokens
  __shared__ int run_base[2];
  __shared__ bool failed;            // this rank has recorded an error: every thread leaves

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = args.num_ranks;
  Header* me = header_of(args.peer_buffers, args.rank);
  WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpNotify, args.rank, -1, warp};

  if (tid == 0) {
    epoch = me->notify_epoch + 1;
    first_bad_entry = INT_MAX;
    failed = error_claimed(&me->error_claim);
  }
  if (tid < kMaxNvlPeers) token_counts[tid] = 0, running_base[tid] = 0;
  if (tid < 2) run_base[tid] = 0;
  __syncthreads();
  if (failed) return;

  // 1. Count tokens per destination rank; check expert ids. The ids are read as one flat array, each
  // warp a contiguous stretch, several loads in flight per thread (one block reads them all).
  int counts[kMaxNvlPeers] = {};
  for (int t = tid; t < args.num_tokens; t += kNotifyThreads) {
    const bool* flags = args.is_token_in_rank + static_cast<int64_t>(t) * R;
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r)
      if (r < R && flags[r]) ++counts[r];
  }
  const int num_ids = args.num_tokens * args.num_topk;
  int first_bad = INT_MAX;
#pragma unroll 8
  for (int i = tid; i < num_ids; i += kNotifyThreads) {
    const int64_t id = __ldg(args.topk_idx + i);
    if ((id < -1 || id >= args.num_experts) && i < first_bad) first_bad = i;
  }
  if (first_bad != INT_MAX) atomicMin(&first_bad_entry, first_bad);
#pragma unroll
  for (int r = 0; r < kMaxNvlPeers; ++r) {
    int value = counts[r];
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    if (lane == 0 && value != 0) atomicAdd(&token_counts[r], value);
  }
  __syncthreads();

  // 2. Write this rank's block into every rank's header (its own included).
  const int parity = epoch & 1;
  const int experts_per_rank = args.num_experts / R;
  for (int r = 0; r < R; ++r) {
    NotifyBlock* block = &header_of(args.peer_buffers, r)->notify[parity][args.rank];
    if (tid == 0) {
      const bool bad = first_bad_entry != INT_MAX;
      block->bad_input_code = bad ? kErrBadExpertId : kErrNone;
      block->num_tokens = args.num_tokens;
      block->row_layout = args.row_layout;
      block->bad_input_detail[0] = bad ? first_bad_entry / args.num_topk : 0;
      block->bad_input_detail[1] = bad ? first_bad_entry % args.num_topk : 0;
      block->bad_input_detail[2] = bad ? args.topk_idx[first_bad_entry] : 0;
    }
    if (tid < R) block->tokens_to_rank[tid] = token_counts[tid];
    for (int j = tid; j < experts_per_rank; j += kNotifyThreads)
      block->expert_counts[j] = args.num_tokens_per_expert[r * experts_per_rank + j];
  }
  __syncthreads();

  // 3. Barrier: signal every rank, wait for every rank's signal. NOTE: a signal is a system-scope release
  // after the block barrier, so it publishes every thread's block writes above, not only its own.
  bool expired = false;
  if (tid < R) {
    st_release_sys(&header_of(args.peer_buffers, tid)->notify_signal[args.rank], epoch);
    Deadline deadline(site);
    while (true) {
      const uint64_t seen = ld_acquire_sys(&me->notify_signal[tid]);
      if (seen >= epoch) break;
      if ((expired = deadline.expired(kWaitBarrier, tid, epoch, static_cast<int64_t>(seen)))) break;
    }
  }
  if (__syncthreads_or(expired)) return;

  // 4. From the full count matrix: warp 0 the offsets, the input checks and the host's counts; the other
  // warps the per-expert receive counts (host mode only: the host builds the Python list).
  const NotifyBlock* blocks = me->notify[parity];
  if (warp == 0)
    read_count_matrix(args, blocks, lane, offset_on_rank, failed);
  else if (args.host_tag > 0)
    publish_expert_counts(args, blocks, experts_per_rank, tid - 32, kNotifyThreads - 32);
  __syncthreads();
  if (failed) return;

  // 5. Publish to the host before the send_pos scan: the host allocates the outputs and launches the
  // dispatch meanwhile (the dispatch runs after this kernel on the stream, so it sees send_pos).
  // NOTE: one system fence after the block barrier orders every thread's counts before the tag.
  if (tid == 0 && args.host_tag > 0) {
    __threadfence_system();
    args.status->notify_tag = args.host_tag;
  }

  // 6. send_pos: exclusive scan over tokens, per destination rank, one tile of the block at a time.
  for (int tile = 0; tile < args.num_tokens; tile += kNotifyThreads) {
    const int t = tile + tid;
    const bool valid = t < args.num_tokens;
    const bool* flags = args.is_token_in_rank + static_cast<int64_t>(valid ? t : 0) * R;
    int lane_prefix[kMaxNvlPeers];
    bool sent[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      sent[r] = valid && r < R && flags[r];
      const uint32_t ballot = __ballot_sync(0xffffffffu, sent[r]);
      lane_prefix[r] = __popc(ballot & ((1u << lane) - 1u));
      if (lane == 0 && r < R) warp_totals[r][warp] = __popc(ballot);
    }
    // This rank's own runs: token t starts one when it is sent here and t - 1 is not, ends one when
    // t + 1 is not. NOTE: a lane past the last token reads no flag (its t - 1 is past the end too).
    const bool own = valid && flags[args.rank];
    const bool lane_before = __shfl_up_sync(0xffffffffu, own, 1), lane_after = __shfl_down_sync(0xffffffffu, own, 1);
    const bool own_before = lane > 0 ? lane_before
                                     : valid && t > 0 &&
                                           args.is_token_in_rank[static_cast<int64_t>(t - 1) * R + args.rank];
    const bool own_after = lane < 31 ? lane_after
                                     : t + 1 < args.num_tokens &&
                                           args.is_token_in_rank[static_cast<int64_t>(t + 1) * R + args.rank];
    const bool starts = own && !own_before;
    const bool ends = own && !own_after;
    const uint32_t start_ballot = __ballot_sync(0xffffffffu, starts), end_ballot = __ballot_sync(0xffffffffu, ends);
    if (lane == 0) run_totals[0][warp] = __popc(start_ballot), run_totals[1][warp] = __popc(end_ballot);
    __syncthreads();
    // Thread r turns rank r's warp totals into exclusive warp offsets; threads 32 and 33 the runs' starts and ends.
    if (tid < R) warp_counts_to_offsets(warp_totals[tid], running_base[tid]);
    else if (tid >= 32 && tid < 34) warp_counts_to_offsets(run_totals[tid - 32], run_base[tid - 32]);
    __syncthreads();
    if (valid) {
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r)
        if (r < R)
          args.send_pos[static_cast<int64_t>(t) * R + r] =
              sent[r] ? offset_on_rank[r] + warp_totals[r][warp] + lane_prefix[r] : -1;
    }
    if (args.host_tag > 0) {
      const uint32_t before = (1u << lane) - 1u;
      const int start_index = run_totals[0][warp] + __popc(start_ballot & before);
      const int end_index = run_totals[1][warp] + __popc(end_ballot & before);
      if (starts && start_index < kMaxOwnRuns) args.status->own_run_first[start_index] = t;
      if (ends && end_index < kMaxOwnRuns) args.status->own_run_end[end_index] = t + 1;
    }
    __syncthreads();
  }
  if (tid == 0 && args.host_tag > 0) {
    args.status->num_own_runs = run_base[0] <= kMaxOwnRuns ? run_base[0] : -1;
    __threadfence_system();
    args.status->own_runs_tag = args.host_tag;
  }

  // 7. Advance the epoch.
  if (tid == 0) me->notify_epoch = epoch;
}

}  // namespace

void launch_notify(const NotifyArgs& args, cudaStream_t stream) {
  EP_CHECK_ARG(args.num_ranks >= 1 && args.num_ranks <= kMaxNvlPeers,
               "intranode kernels support 1 to " << kMaxNvlPeers << " ranks, got " << args.num_ranks);
  EP_CHECK_ARG(args.num_experts > 0 && args.num_experts % args.num_ranks == 0,
               "num_experts (" << args.num_experts << ") must be a positive multiple of the rank count");
  EP_CHECK_ARG(args.num_experts / args.num_ranks <= kMaxLocalExperts,
               "at most " << kMaxLocalExperts << " experts per rank, got " << args.num_experts / args.num_ranks);
  EP_CHECK_ARG(args.expert_alignment >= 1, "expert_alignment must be >= 1");
  // Top-k 0: a dispatch routed by is_token_in_rank alone (DeepEP allows it); no id is read.
  EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "top-k must be in [0, " << kMaxTopk << "]");
  notify_kernel<<<1, kNotifyThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
