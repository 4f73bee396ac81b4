// Every kernel family: one Args struct, one launch(const Args&, cudaStream_t). Framework-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/layout_launcher.h"
#include "../common/status.h"

namespace ep_plugin {

// ---- get_dispatch_layout (layout.cu; LayoutArgs in ../common/layout_launcher.h) -----------------
void launch_dispatch_layout(const LayoutArgs& args, cudaStream_t stream);

// ---- gather_sum_rows (permute.cu) ---------------------------------------------------------------
struct GatherSumArgs {
  const void* rows;        // [M, hidden] bf16
  const int32_t* index;    // [num_out_rows, num_slots]: a row of `rows`, or -1 (skipped)
  void* out;               // [num_out_rows, hidden] bf16: the sum of the indexed rows (fp32 inside)
  int64_t num_out_rows;
  int num_slots, hidden;
};
void launch_gather_sum_rows(const GatherSumArgs& args, int num_sms, cudaStream_t stream);

namespace intranode {

// ---- notify (intranode_notify.cu) ---------------------------------------------------------------
struct NotifyArgs {
  void* const* peer_buffers;        // device array [R]: every rank's NVLink buffer, mapped here
  int rank, num_ranks;
  const bool* is_token_in_rank;     // [T, R]
  const int32_t* num_tokens_per_expert;  // [E]
  const int64_t* topk_idx;          // [T, K], checked for out-of-range ids
  int num_tokens, num_topk, num_experts, expert_alignment, num_worst_tokens;
  int64_t row_layout;               // pack_row_layout of this rank's dispatch (every rank's must be equal)
  int32_t* send_pos;                // [T, R]: row of token t on rank r, or -1
  int32_t* recv_rank_offsets;       // [R + 1]: first row of each source rank's block
  int32_t* src_num_tokens;          // [R]: T of every rank
  int32_t* num_recv_tokens;         // [1]
  DeviceStatus* status;             // mapped host memory
  int32_t host_tag;                 // > 0: publish results to `status` with this tag; 0: graph mode
  uint64_t timeout_ns;
};
void launch_notify(const NotifyArgs& args, cudaStream_t stream);

// ---- dispatch (intranode_dispatch.cu) -----------------------------------------------------------
struct DispatchArgs {
  void* const* peer_buffers;
  int rank, num_ranks, num_channels, recv_tokens_per_channel;
  int send_chunk;                   // tokens written before the ring tail is published
  int num_tokens, row_bytes, num_scales, num_topk, num_local_experts;
  const void* x;                    // [T, row_bytes]
  const float* x_scales;            // [T, num_scales] or nullptr; any strides (float32 or int32 words)
  int64_t scale_token_stride;       // x_scales[t][i] is x_scales[t * scale_token_stride + i * scale_stride]
  int64_t scale_stride;
  const int64_t* topk_idx;          // [T, K] or nullptr (cached dispatch)
  const float* topk_weights;        // [T, K] or nullptr
  const int32_t* send_pos;          // [T, R]
  void* recv_x;                     // [rows, row_bytes]
  float* recv_x_scales;             // [rows, num_scales] or nullptr
  int64_t* recv_topk_idx;           // [rows, K] or nullptr
  float* recv_topk_weights;         // [rows, K] or nullptr
  int32_t* recv_src_idx;            // [rows] or nullptr
  int num_worst_tokens;             // > 0: rows past *num_recv_tokens are padding
  const int32_t* num_recv_tokens;   // [1]
  bool bulk_rows;                   // senders copy rows by bulk copies through shared memory (sm_90 on;
                                    // a build without sm_90 code copies through registers)
  int direct_max_blocks;            // direct dispatch: at most this many blocks (0: num_channels * 2)
  int direct_chunk_tokens;          // direct dispatch: tokens per chunk warps claim (>= 1)
  bool direct_has_room;             // direct dispatch: this rank's outputs are in its output region
  int num_engine_runs;              // direct dispatch: runs of tokens whose own rows of recv_x the copy engine
  int32_t engine_run_first[kMaxOwnRuns];  // writes: tokens [first, end) of run i, in token order (the SMs
  int32_t engine_run_end[kMaxOwnRuns];    // write the other rows)
  bool only_after_fallback;         // ring dispatch: run only if the direct dispatch before it fell back
  DeviceStatus* status;
  uint64_t timeout_ns;
};
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);
// Every rank's outputs in its NVLink buffer: senders write rows straight into them (no rings);
// at most num_channels * 2 blocks. When a rank's outputs are not in its region (direct_has_room false
// there), every rank's kernel ends after the start handshake and flags the fallback: launch the ring
// dispatch after it with only_after_fallback (a programmatic dependent launch, which overlaps the
// direct kernel's end).
void launch_direct_dispatch(const DispatchArgs& args, cudaStream_t stream);
// The direct dispatch's blocks: num_channels * 2, at most direct_max_blocks.
int direct_dispatch_blocks(const DispatchArgs& args);
// Blocks of the direct dispatch up to which the copy engine writes the own rows (where notify found few runs
// of them). Fewer blocks than about 15 cannot fill an EP2 link while they also write the own rows (8 SMs
// write about 390 GB/s in that pattern, 48 per SM); at 16 they can, and each copy costs the host about 7 us.
constexpr int kOwnRowsByEngineMaxBlocks = 12;

// ---- combine (intranode_combine.cu) -------------------------------------------------------------
struct CombineArgs {
  void* const* peer_buffers;
  int rank, num_ranks, num_channels, recv_tokens_per_channel;
  int send_chunk;                   // rows written (or consumed) before a ring counter is published
  int num_tokens, hidden, num_topk;
  const void* x;                    // [rows, hidden] bf16: rows received by the dispatch
  const float* topk_weights;        // [rows, K] or nullptr
  const int32_t* recv_src_idx;      // [rows]
  const int32_t* recv_rank_offsets; // [R + 1]
  const int32_t* src_num_tokens;    // [R]
  const int32_t* send_pos;          // [T, R]
  const void* bias_0;               // [T, hidden] bf16 or nullptr
  const void* bias_1;
  void* combined_x;                 // [T, hidden] bf16
  float* combined_topk_weights;     // [T, K] or nullptr
  DeviceStatus* status;
  uint64_t timeout_ns;
};
void launch_combine(const CombineArgs& args, cudaStream_t stream);

// ---- copy-engine combine (intranode_staged_combine.cu; its host side in staged_combine.cu) --------
struct StagedReduceArgs {
  void* const* peer_buffers;
  int rank, num_ranks;
  int64_t staging_offset, staging_bytes;  // StagingLayout::fit of every rank's buffer
  uint32_t epoch;                   // this combine's number, the same on every rank
  int num_tokens, hidden, num_topk;
  const void* x;                    // [rows, hidden] bf16: this rank's own copies
  const float* topk_weights;        // [rows, K] or nullptr
  const int32_t* send_pos;          // [T, R]
  const void* bias_0;               // [T, hidden] bf16 or nullptr
  const void* bias_1;
  void* combined_x;                 // [T, hidden] bf16
  float* combined_topk_weights;     // [T, K] or nullptr
  // The sender's side runs in this kernel too: once owner o has released its staging area, the kernel
  // writes o's staged_rows/base words and, where they fit whole, stores this rank's top-k weights for o,
  // then o's staged_weights_landed word; else the weights go with each piece by copy. First-round rows
  // are summed as they land (see kUnlandedWord).
  // pull_rows (3-4 ranks): each sender's region for owner o lies in the sender's own buffer, filled by
  // copies within its GPU, and o reads the rows across NVLink once its landed word reports them; every
  // row fits the region (no slot is reused) and nothing is read before it is reported.
  int pull_rows;
  int send_first[kMaxNvlPeers];     // [owner]: this rank's first row for owner (rows are ordered by source)
  int send_rows[kMaxNvlPeers];      // [owner]: rows this rank sends back to owner
  DeviceStatus* status;
  uint64_t timeout_ns;
};
void launch_staged_reduce(const StagedReduceArgs& args, int num_blocks, cudaStream_t stream);

// One thread waits until *word >= target: a sender's view of an owner's progress (peer = the owner).
struct StagingWaitArgs {
  const uint64_t* word;
  uint64_t target;
  int peer, slot;                   // slot: the staging slot waited for, or -1 (the whole area)
  int rank;
  DeviceStatus* status;
  int* claim;
  uint64_t timeout_ns;
};
void launch_staging_wait(const StagingWaitArgs& args, cudaStream_t stream);
// Loads the kernels above now. CUDA loads a kernel on its first launch (lazy loading), and a load
// may wait for the kernels already running: a reduction spinning for the copy streams' first waits
// and writes would then never see them run.
void load_staged_combine_kernels();
// Writes `value` to `address` (a peer's header word) with release semantics, after the work queued before.
void launch_write_word(uint64_t* address, uint64_t value, cudaStream_t stream);

}  // namespace intranode
}  // namespace ep_plugin
