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

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs args) {
  __shared__ int token_counts[kMaxNvlPeers];
  __shared__ int first_bad_entry;
  __shared__ uint32_t epoch;
  __shared__ int offset_on_rank[kMaxNvlPeers];  // first row of this rank's block on each destination
  __shared__ int warp_totals[kMaxNvlPeers][kNotifyWarps];
  __shared__ int running_base[kMaxNvlPeers];
  __shared__ int run_totals[2][kNotifyWarps];  // per warp: own runs that start, that end in its tokens
  __shared__ int run_base[2];
  __shared__ int bad_rank;
  __shared__ int other_layout_rank;  // the first rank whose row layout differs from this rank's (-1: none)
  __shared__ bool failed;            // this rank has recorded an error: every thread leaves

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = args.num_ranks;
  Header* me = header_of(args.peer_buffers, args.rank);
  WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpNotify, args.rank, -1, warp};

  if (tid == 0) {
    epoch = me->notify_epoch + 1;
    first_bad_entry = INT_MAX;
    bad_rank = -1;
    other_layout_rank = -1;
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
  // NOTE: every writer fences before the barrier so the signal below publishes all the blocks.
  __threadfence_system();
  __syncthreads();

  // 3. Barrier: signal every rank, wait for every rank's signal.
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

  // 4. Offsets from the full count matrix.
  const NotifyBlock* blocks = me->notify[parity];
  if (tid == 0) {
    int row = 0;
    for (int s = 0; s < R; ++s) {
      args.recv_rank_offsets[s] = row;
      row += blocks[s].tokens_to_rank[args.rank];
      args.src_num_tokens[s] = blocks[s].num_tokens;
      if (blocks[s].bad_input_code != kErrNone && bad_rank < 0) bad_rank = s;
      if (blocks[s].row_layout != args.row_layout && other_layout_rank < 0) other_layout_rank = s;
    }
    args.recv_rank_offsets[R] = row;
    *args.num_recv_tokens = row;
    for (int r = 0; r < R; ++r) {
      int offset = 0;
      for (int s = 0; s < args.rank; ++s) offset += blocks[s].tokens_to_rank[r];
      offset_on_rank[r] = offset;
    }
    if (args.num_worst_tokens > 0) {
      for (int r = 0; r < R; ++r) {
        int total = 0;
        for (int s = 0; s < R; ++s) total += blocks[s].tokens_to_rank[r];
        if (total > args.num_worst_tokens) {
          record_error(args.status, &me->error_claim, kErrTooManyRecvTokens, kOpNotify, 0, args.rank, r, -1, -1,
                       args.num_worst_tokens, total);
          printf("ep_plugin: rank %d receives %d tokens, more than num_worst_tokens = %d\n", r, total,
                 args.num_worst_tokens);
          failed = true;
          break;
        }
      }
    }
    if (!failed && bad_rank >= 0 && args.host_tag == 0) {
      const NotifyBlock& bad = blocks[bad_rank];
      record_error(args.status, &me->error_claim, kErrBadExpertId, kOpNotify, 0, args.rank, bad_rank, -1, -1,
                   bad.bad_input_detail[0], bad.bad_input_detail[2]);
      printf("ep_plugin: rank %d: topk_idx[%lld, %lld] = %lld is not an expert id in [-1, %d)\n", bad_rank,
             static_cast<long long>(bad.bad_input_detail[0]), static_cast<long long>(bad.bad_input_detail[1]),
             static_cast<long long>(bad.bad_input_detail[2]), args.num_experts);
      failed = true;
    }
    if (!failed && other_layout_rank >= 0 && args.host_tag == 0) {
      const int64_t theirs = blocks[other_layout_rank].row_layout;
      record_error(args.status, &me->error_claim, kErrLayoutMismatch, kOpNotify, 0, args.rank, other_layout_rank, -1,
                   -1, args.row_layout, theirs);
      printf("ep_plugin: rank %d dispatches rows of %d bytes, %d scales, top-%d%s; rank %d rows of %d bytes, %d "
             "scales, top-%d%s\n", args.rank, row_layout_bytes(args.row_layout), row_layout_scales(args.row_layout),
             row_layout_topk(args.row_layout), row_layout_weights(args.row_layout) ? " with weights" : "",
             other_layout_rank, row_layout_bytes(theirs), row_layout_scales(theirs), row_layout_topk(theirs),
             row_layout_weights(theirs) ? " with weights" : "");
      failed = true;
    }
  }
  __syncthreads();
  if (failed) return;

  // 5. Per-expert receive counts, aligned (host mode only: the host builds the Python list).
  if (args.host_tag > 0) {
    for (int j = tid; j < experts_per_rank; j += kNotifyThreads) {
      int total = 0;
      for (int s = 0; s < R; ++s) total += blocks[s].expert_counts[j];
      const int align = args.expert_alignment;
      args.status->num_recv_tokens_per_expert[j] = (total + align - 1) / align * align;
    }
    __threadfence_system();  // each writer's counts before the tag below
  }
  __syncthreads();

  // 6. Publish to the host before the send_pos scan: the host allocates the outputs and launches the
  // dispatch meanwhile (the dispatch runs after this kernel on the stream, so it sees send_pos).
  if (tid == 0 && args.host_tag > 0) {
    args.status->num_recv_tokens = *args.num_recv_tokens;
    int largest = 0;
    for (int s = 0; s < R; ++s) {
      args.status->num_recv_tokens_per_rank[s] = blocks[s].tokens_to_rank[args.rank];
      for (int d = 0; d < R; ++d) largest = max(largest, blocks[s].tokens_to_rank[d]);
    }
    args.status->largest_block_rows = largest;
    args.status->bad_input_rank = bad_rank >= 0 ? bad_rank : other_layout_rank;
    if (bad_rank >= 0) {
      args.status->bad_input_code = blocks[bad_rank].bad_input_code;
      for (int i = 0; i < 3; ++i) args.status->bad_input_detail[i] = blocks[bad_rank].bad_input_detail[i];
    } else if (other_layout_rank >= 0) {
      args.status->bad_input_code = kErrLayoutMismatch;
      args.status->bad_input_detail[0] = args.row_layout;
      args.status->bad_input_detail[1] = blocks[other_layout_rank].row_layout;
    }
    __threadfence_system();
    args.status->notify_tag = args.host_tag;
    __threadfence_system();
  }

  // 7. send_pos: exclusive scan over tokens, per destination rank, one tile of the block at a time.
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

  // 8. Advance the epoch.
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
