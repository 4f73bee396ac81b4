// IntranodeRuntime: one rank's NVLink buffer, its peers' mappings and the host side of every wait
// (runtime.cu; the copy-engine combine's part in staged_combine.cu).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "kernels/api.cuh"
#include "kernels/buffer_layout.cuh"

namespace ep_plugin {

struct NotifyCounts {
  std::vector<int> num_recv_tokens_per_rank;
  std::vector<int> num_recv_tokens_per_expert;
  int largest_block_rows = 0;  // the most rows any rank received from any one rank (every rank sees the same)
};

// The runs of consecutive tokens a rank sends to itself in a dispatch (notify finds them): the copy
// engine copies the longest runs of rows into recv_x, and the direct dispatch's SMs write the other rows.
struct OwnRuns {
  std::vector<int32_t> first;      // first token of each run
  std::vector<int32_t> end;        // one past its last token
  std::vector<int32_t> first_row;  // recv_x row of its first token
  std::vector<int> by_engine;      // the runs the engine copied in the last dispatch with them
};

// A copy-engine combine (see IntranodeRuntime::staged_combine).
struct StagedCombineRequest {
  intranode::StagedReduceArgs reduce;  // the caller fills tokens, sizes, inputs and outputs
  int64_t staging_bytes;               // the smallest staging area of all ranks
  std::vector<int> rows_from;          // [R]: rows this rank received from each rank (recv order)
  int num_sms;                         // SMs of the reduction
};

class IntranodeRuntime {
 public:
  // `staging_bytes` past the ring buffer hold the copy-engine combine's incoming rows (0: none);
  // `output_bytes` past those hold dispatch outputs that peers write directly (0: none). The direct
  // dispatch runs on at most `direct_max_blocks` blocks (0: num_sms) and its warps claim
  // `direct_chunk_tokens` tokens at a time (YAML dispatch.direct_max_blocks, dispatch.direct_chunk_tokens).
  IntranodeRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s, int64_t staging_bytes = 0,
                   int64_t output_bytes = 0, int direct_max_blocks = 16, int direct_chunk_tokens = 1);
  ~IntranodeRuntime();
  IntranodeRuntime(const IntranodeRuntime&) = delete;
  IntranodeRuntime& operator=(const IntranodeRuntime&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  int64_t num_nvl_bytes() const { return num_nvl_bytes_; }
  int64_t staging_bytes() const { return staging_bytes_; }
  bool dispatch_bulk_rows() const { return dispatch_bulk_rows_; }
  int direct_max_blocks() const { return direct_max_blocks_; }
  int direct_chunk_tokens() const { return direct_chunk_tokens_; }
  // The output region: its first byte's device address here, and its size.
  uintptr_t output_region_address() const;
  int64_t output_region_bytes() const { return output_bytes_; }
  // Rows per peer the staging area holds at `hidden` with `staging_bytes` (0: too small to use).
  int64_t staging_rows(int64_t staging_bytes, int hidden) const;

  // CUDA IPC handle of this rank's buffer (bytes to exchange over the process group).
  std::string ipc_handle() const;
  // Maps every peer's buffer (handles ordered by rank; this rank's own entry is ignored).
  void connect(const std::vector<std::string>& handles);
  // Unmaps peers and frees the buffer; the runtime is unusable afterwards.
  void destroy();

  // Fills the runtime-owned fields (buffers, rank, status, timeout) and launches.
  void notify(intranode::NotifyArgs args, cudaStream_t stream);
  void dispatch(intranode::DispatchArgs args, cudaStream_t stream);
  // The direct dispatch: every rank's outputs (num_recv_rows rows) in its output region, written by
  // the senders themselves. Every rank of the call must take this path. A rank whose outputs are not
  // in its region (has_room false: the region was full) makes every rank fall back to the rings.
  // The copy engine writes this rank's own rows of its longest runs (as many as the host can ask for while
  // the SMs write the peers' rows) where the kernel has at most kOwnRowsByEngineMaxBlocks blocks and its own
  // tokens form at most kMaxOwnRuns runs: the runs of `own_runs` (a cached dispatch), or with `own_runs_tag`
  // > 0 those of that notify (waited for only at those block counts). Returns the runs (null: none), for the
  // handle.
  std::shared_ptr<OwnRuns> direct_dispatch(intranode::DispatchArgs args, int64_t num_recv_rows, bool has_room,
                                           cudaStream_t stream, int own_runs_tag = 0,
                                           std::shared_ptr<OwnRuns> own_runs = nullptr);
  // Whether this rank's last direct dispatch fell back to the rings (synchronises with the device).
  bool direct_fell_back() const;
  void combine(intranode::CombineArgs args, cudaStream_t stream);
  // Combine through the copy engines: each rank copies its rows for every owner into the owner's
  // staging area on `stream` while the owner's SMs sum them on `side`; `stream` then waits for `side`.
  // Needs the host to know the received rows per source (a dispatch that synchronised with the host).
  void staged_combine(StagedCombineRequest request, cudaStream_t stream, cudaStream_t side);

  // Host wait for the notify published with `tag`: its received row count; raises on bad input, device
  // errors and timeout.
  int wait_notify(int tag, cudaStream_t stream);
  // The last waited notify's rows per source rank and aligned rows per local expert. Read after the
  // dispatch's launch, off the path from the count's arrival to the launch; valid until the next notify.
  NotifyCounts notify_counts(int num_local_experts) const;
  // Throws if a kernel of this rank recorded an error (timeout, bad input seen on the device). The
  // kernels then left early: the runtime is failed (its rings are not trusted) and every later call throws.
  void check_device_error() const;

 private:
  void require_connected() const;
  // Host wait until `word` (in mapped host memory) reads `tag`; raises on device errors, a failed stream
  // and after the timeout (naming `what`).
  void wait_for_tag(const volatile int32_t& word, int tag, cudaStream_t stream, const char* what) const;
  // The own runs notify published with `tag` (waited for), or null where there are more than kMaxOwnRuns.
  std::shared_ptr<OwnRuns> published_own_runs(int tag, cudaStream_t stream) const;
  // One copy per run of `runs` from x into recv_x on the own-rows stream, after own_fork_; own_join_ after.
  void copy_own_rows(const intranode::DispatchArgs& args, const OwnRuns& runs);
  void require_buffer_fits(int64_t needed, const char* op) const;
  // Throws unless the dispatch's rings fit the buffer.
  void require_rings_fit(const intranode::DispatchArgs& args) const;
  // Throws unless `bytes` at `output` lie in the output region (or output is null).
  void require_in_output_region(const void* output, int64_t bytes, const char* name) const;
  // The dispatch's runtime-owned fields (buffers, rank, status, timeout, tuning).
  void fill_dispatch_args(intranode::DispatchArgs& args) const;
  std::string describe_device_error() const;
  // Prints a device error report to stderr as soon as a kernel records one (the kernels leave; the
  // host raises at the next call of this runtime).
  void watch_for_device_errors();

  // ---- the copy-engine combine (staged_combine.cu) ----
  // Loads and runs once the copy-engine combine's kernels, before any reduction can spin for them.
  void preload_staged_combine();
  // Writes a 64-bit header word (an owner's, through its mapping) from the stream, after everything
  // queued before it (copies into peers included: the write is ordered behind them, as a system-wide
  // fence would).
  void write_word(uint64_t* address, uint64_t value, cudaStream_t stream);
  // The copy-engine combine's sender side for one owner, on `stream` (see staged_combine): its rows
  // are args.send_rows[owner] rows of x from args.send_first[owner] on. The first round fills every
  // slot of the owner's staging area and returns the rows it copied; the later pieces follow `done`
  // rows, one slot at a time, each after the owner has freed it.
  int64_t copy_first_round(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                           int owner, cudaStream_t stream);
  // On `stream`, before this combine's first copy for `owner`: its release of the previous combine.
  void wait_for_release(const intranode::StagedReduceArgs& args, int owner, cudaStream_t stream);
  // Pulled rows (args.pull_rows): every owner's rows into this rank's region for it, in up to kPulledPieces
  // pieces of at least kPulledPieceRows rows each, on the owners' copy streams, before the reduction is launched.
  static constexpr int kPulledPieces = 4;
  static constexpr int64_t kPulledPieceRows = 1024;
  void copy_pulled_rows(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout);
  void copy_later_pieces(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout, int owner,
                         int64_t done, cudaStream_t stream);
  // `count` rows from row `done` of the owner's rows to staged row `staged` of their region, then their
  // landed word.
  void copy_piece(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout, int owner,
                  int64_t done, int64_t staged, int64_t count, cudaStream_t stream);
  // On each owner's copy stream, after this combine's copies: a wait for the owner's release of `epoch`.
  void wait_for_releases(uint32_t epoch);
  // The owner's reduction on `side`, after the combine's fork; join_ marks its end.
  void launch_reduction(const intranode::StagedReduceArgs& args, int num_sms, cudaStream_t side);
  // After the owner's reduction: refill its staging area with unlanded bytes and tell
  // every sender that the area is free for the next combine.
  void release_staging(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                       cudaStream_t side);
  // Writes `value` to the landed word of this rank's rows in `owner`'s header once the copies queued on
  // `stream` are done, on the owner's signal stream.
  void signal_landed(int owner, uint64_t value, cudaStream_t stream);
  void create_copy_streams(int64_t staging_bytes);
  // A one-thread kernel on `stream` that waits until *word >= target (the owner's progress).
  void wait_for_owner(const uint64_t* word, uint64_t target, int owner, int slot, cudaStream_t stream);

  int rank_, num_ranks_, device_;
  int64_t num_nvl_bytes_;
  int64_t staging_offset_ = 0, staging_bytes_ = 0;
  int64_t output_offset_ = 0, output_bytes_ = 0;
  int direct_max_blocks_;    // the direct dispatch's block cap (0: num_sms)
  int direct_chunk_tokens_;  // tokens per chunk the direct dispatch's warps claim
  uint32_t staged_epoch_ = 0;
  bool dispatch_bulk_rows_ = false;  // sm_90 on
  void* write_value64_ = nullptr;  // the driver's cuStreamWriteValue64
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  // The direct dispatch's own rows by copy engine.
  cudaStream_t own_rows_stream_ = nullptr;
  cudaEvent_t own_fork_ = nullptr, own_join_ = nullptr;
  // The copy-engine combine's copies to each owner (more streams per owner were measured: no faster,
  // the copies to one peer share its engine).
  cudaStream_t copy_streams_[kMaxNvlPeers] = {};  // [owner]
  cudaEvent_t copy_done_[kMaxNvlPeers] = {};
  // The rows-landed words go out on a stream of their own, each after its copy's event, so that a
  // write (~5 us of a stream) never stands between two copies.
  cudaStream_t signal_streams_[kMaxNvlPeers] = {};  // [owner]
  cudaEvent_t copy_landed_[kMaxNvlPeers] = {};
  // The first round of pieces goes out in one copy (the owner sums rows as they land); the wait for
  // each owner's release of a combine is queued at the end of that combine, behind its copies.
  uint32_t released_epoch_waited_[kMaxNvlPeers] = {};  // [owner]: the release the copy stream waited for last
  uint64_t timeout_ns_;
  double timeout_s_;
  void* buffer_ = nullptr;
  void* peer_buffers_[kMaxNvlPeers] = {};
  void** peer_buffers_device_ = nullptr;
  DeviceStatus* status_host_ = nullptr;
  DeviceStatus* status_device_ = nullptr;
  bool connected_ = false;
  std::atomic<bool> stop_watchdog_{false};
  std::thread watchdog_;
};

}  // namespace ep_plugin
