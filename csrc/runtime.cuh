// IntranodeRuntime: one rank's NVLink buffer, its peers' mappings and the host side of every wait.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "kernels/api.cuh"
#include "kernels/buffer_layout.cuh"

namespace ep_plugin {

struct NotifyResult {
  int num_recv_tokens;
  std::vector<int> num_recv_tokens_per_rank;
  std::vector<int> num_recv_tokens_per_expert;
};

// A copy-engine combine (see IntranodeRuntime::staged_combine).
struct StagedCombineRequest {
  intranode::StagedReduceArgs reduce;  // the caller fills tokens, sizes, inputs and outputs
  int64_t staging_bytes;               // the smallest staging area of all ranks
  std::vector<int> rows_from;          // [R]: rows this rank received from each rank (recv order)
  int num_sms;                         // SMs of the reduction
};

// Copy-engine rows of a direct dispatch (see IntranodeRuntime::direct_dispatch).
struct StagedDispatch {
  int64_t staging_bytes;  // the smallest staging area of all ranks
  cudaStream_t side;      // refills and releases this rank's staging area after the kernel
};

class IntranodeRuntime {
 public:
  // `staging_bytes` past the ring buffer hold the copy-engine combine's incoming rows (0: none);
  // `output_bytes` past those hold dispatch outputs that peers write directly (0: none).
  IntranodeRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s, int64_t staging_bytes = 0,
                   int64_t output_bytes = 0);
  ~IntranodeRuntime();
  IntranodeRuntime(const IntranodeRuntime&) = delete;
  IntranodeRuntime& operator=(const IntranodeRuntime&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  int64_t num_nvl_bytes() const { return num_nvl_bytes_; }
  int64_t staging_bytes() const { return staging_bytes_; }
  bool dispatch_bulk_rows() const { return dispatch_bulk_rows_; }
  int direct_chunk_tokens() const { return direct_chunk_tokens_; }
  int dispatch_ce_share() const { return dispatch_ce_share_; }
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
  // With `staged` (every rank alike), the rows cross NVLink by copy engine: the rows of this rank's last
  // tokens go into each peer's staging area (staged_token_count: as many as fit, all by default), and each
  // rank's SMs move the rows it receives from its own area; the SMs store the first tokens' rows to the
  // peers. args.recv_rank_offsets, and args.cached_src_idx or args.recv_src_idx, are set.
  // Returns how many of this rank's tokens had their rows go by copy engine.
  int direct_dispatch(intranode::DispatchArgs args, int64_t num_recv_rows, bool has_room, cudaStream_t stream,
                       const StagedDispatch* staged = nullptr);
  // Whether this rank's last direct dispatch fell back to the rings (synchronises with the device).
  bool direct_fell_back() const;
  void combine(intranode::CombineArgs args, cudaStream_t stream);
  // Combine through the copy engines: each rank copies its rows for every owner into the owner's
  // staging area on `stream` while the owner's SMs sum them on `side`; `stream` then waits for `side`.
  // Needs the host to know the received rows per source (a dispatch that synchronised with the host).
  void staged_combine(StagedCombineRequest request, cudaStream_t stream, cudaStream_t side);
  // ---- push combine (push_combine.cu) ----
  // Combine by SM pushes into the owners' staging areas (`staging_bytes`: every rank's smallest), with the
  // ring combine launched after it for the case some rank's tokens exceed the area (see launch_push_combine).
  void push_combine(intranode::CombineArgs args, int64_t staging_bytes, cudaStream_t stream);

  // Host wait for the notify published with `tag`; raises on bad input, device errors and timeout.
  NotifyResult wait_notify(int tag, int num_local_experts, cudaStream_t stream);
  // Throws if a kernel of this rank recorded an error (timeout, bad input seen on the device).
  void check_device_error() const;

 private:
  void require_connected() const;
  void require_buffer_fits(int64_t needed, const char* op) const;
  // Throws unless the dispatch's rings fit the buffer.
  void require_rings_fit(const intranode::DispatchArgs& args) const;
  // Throws unless `bytes` at `output` lie in the output region (or output is null).
  void require_in_output_region(const void* output, int64_t bytes, const char* name) const;
  // The dispatch's runtime-owned fields (buffers, rank, status, timeout, tuning).
  void fill_dispatch_args(intranode::DispatchArgs& args) const;
  std::string describe_device_error() const;
  // Loads and runs once the copy-engine combine's kernels, before any reduction can spin for them.
  void preload_staged_combine();
  // Writes a 64-bit header word (an owner's, through its mapping) from the stream, after everything
  // queued before it (copies into peers included: the write is ordered behind them, as a system-wide
  // fence would).
  void write_word(uint64_t* address, uint64_t value, cudaStream_t stream);
  // The copy-engine combine's sender side for one owner, on `stream` (see staged_combine).
  // Its rows are args.send_rows[owner] rows of x from args.send_first[owner] on.
  void copy_rows_to_owner(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                          int owner, cudaStream_t stream);
  // On each owner's copy stream, after this combine's copies: a wait for the owner's release of `epoch`.
  void wait_for_releases(uint32_t epoch);
  // The owner's reduction on `side`, after the combine's fork; join_ marks its end.
  void launch_reduction(const intranode::StagedReduceArgs& args, int num_sms, cudaStream_t side);
  // After the owner's reduction: refill its staging area with unlanded bytes (early rows) and tell
  // every sender that the area is free for the next combine.
  void release_staging(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                       cudaStream_t side);
  // Bytes of each source's part of a staging area of `staging_bytes` (copy-engine dispatch rows).
  int64_t staging_peer_bytes(int64_t staging_bytes) const;
  // How many of a rank's last tokens go by copy engine: the share EP_PLUGIN_DISPATCH_CE_SHARE gives them
  // (rounded up), at most what fits the rank's part of a peer's area, `peer_bytes`.
  int staged_token_count(int num_tokens, int row_bytes, int64_t peer_bytes) const;
  // The copy-engine dispatch's sender side for one peer, on its copy stream: once the peer has released
  // its staging area, the rows of this rank's staged tokens go there in one copy, then the landed word.
  void copy_x_to_peer(const intranode::DispatchArgs& args, int peer);
  // After the direct kernel: refill this rank's staging area with unlanded bytes and tell every sender
  // that the area is free (as release_staging does after a combine).
  void release_dispatch_staging(const intranode::DispatchArgs& args, cudaStream_t stream, cudaStream_t side);
  // Writes `value` to the landed word of this rank's rows in `owner`'s header once the copies queued on
  // `stream` are done (on the owner's signal stream unless EP_PLUGIN_COMBINE_SIGNAL_STREAM=0).
  void signal_landed(int owner, uint64_t value, cudaStream_t stream);
  void create_copy_streams(int64_t staging_bytes);
  // Diagnostics for tuning runs: EP_PLUGIN_DISPATCH_SELF_SHARE, EP_PLUGIN_DISPATCH_LATE_SCALES,
  // EP_PLUGIN_DISPATCH_BULK, EP_PLUGIN_DIRECT_MAX_BLOCKS, EP_PLUGIN_STAGED_MAX_BLOCKS, EP_PLUGIN_DIRECT_CHUNK,
  // EP_PLUGIN_COMBINE_PAIR, EP_PLUGIN_COMBINE_SIGNAL_STREAM, EP_PLUGIN_COMBINE_EARLY_ROWS,
  // EP_PLUGIN_COMBINE_COPY_PIECES, EP_PLUGIN_COMBINE_SENDER, EP_PLUGIN_COMBINE_RELEASE_WAIT,
  // EP_PLUGIN_COMBINE_JOIN_SIGNALS, EP_PLUGIN_COMBINE_PREFETCH, EP_PLUGIN_COMBINE_OVERLAP
  // (docs/configuration.md).
  void read_tuning_overrides();
  // A one-thread kernel on `stream` that waits until *word >= target (the owner's progress).
  // Then it makes the writes given (a sender's words in the owner's header).
  void wait_for_owner(const uint64_t* word, uint64_t target, int owner, int slot, cudaStream_t stream,
                      intranode::WordWrite then_0 = {}, intranode::WordWrite then_1 = {});
  // Prints a device error report to stderr as soon as a kernel records one, wherever the CUDA
  // error later surfaces in the user's program.
  void watch_for_device_errors();

  int rank_, num_ranks_, device_;
  int64_t num_nvl_bytes_;
  int64_t staging_offset_ = 0, staging_bytes_ = 0;
  int64_t output_offset_ = 0, output_bytes_ = 0;
  // The direct dispatch on at most this many blocks (EP_PLUGIN_DIRECT_MAX_BLOCKS; 0: num_sms): on 2x H200,
  // 16 blocks moved the rows faster than 24 (docs/benchmarks.md, sixteenth session).
  int direct_max_blocks_ = 16;
  // With copy-engine rows the SMs copy within the GPU only, so they gain from every SM:
  // EP_PLUGIN_STAGED_MAX_BLOCKS (0: num_sms).
  int staged_max_blocks_ = 0;
  int direct_chunk_tokens_ = 1;  // EP_PLUGIN_DIRECT_CHUNK: tokens per claimed chunk (0: fixed shares)
  // The code before the twenty-fourth session, as diagnostics (docs/configuration.md).
  bool direct_block_fence_sys_ = false;         // EP_PLUGIN_DIRECT_BLOCK_FENCE=sys
  bool direct_acquire_exchange_loads_ = false;  // EP_PLUGIN_DIRECT_EXCHANGE_LOADS=acquire
  // EP_PLUGIN_DISPATCH_CE_SHARE: percent of a rank's tokens (its last ones) whose rows go to the peers by
  // copy engine with copy-engine dispatch rows; the SMs store the first tokens' rows across NVLink.
  int dispatch_ce_share_ = 100;
  uint32_t staged_epoch_ = 0;
  int self_copy_receiver_rounds_ = 0, self_copy_period_ = 1;
  bool late_scales_ = false;  // EP_PLUGIN_DISPATCH_LATE_SCALES
  bool dispatch_bulk_rows_ = false;  // sm_90 on, unless EP_PLUGIN_DISPATCH_BULK=0
  void* write_value64_ = nullptr;  // the driver's cuStreamWriteValue64
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  // The copy-engine combine's copies to each owner (more streams per owner were measured: no faster,
  // the copies to one peer share its engine).
  cudaStream_t copy_streams_[kMaxNvlPeers] = {};  // [owner]
  cudaEvent_t copy_done_[kMaxNvlPeers] = {};
  // The rows-landed words go out on a stream of their own, each after its copy's event, so that a
  // write (~5 us of a stream) never stands between two copies.
  cudaStream_t signal_streams_[kMaxNvlPeers] = {};  // [owner]
  cudaEvent_t copy_landed_[kMaxNvlPeers] = {}, signals_done_[kMaxNvlPeers] = {};
  bool combine_signal_stream_ = true;
  bool combine_pair_path_ = true;
  // EP_PLUGIN_COMBINE_EARLY_ROWS: the owner sums the first round of pieces as their rows land, so the
  // first round goes out in copies of up to combine_copy_pieces_ pieces (EP_PLUGIN_COMBINE_COPY_PIECES;
  // 0: the whole round). Without early rows, every piece is a copy of its own and the staging area
  // is never refilled.
  bool combine_early_rows_ = true;
  int combine_copy_pieces_ = 0;
  // EP_PLUGIN_COMBINE_LAUNCH=reduce: the owner's reduction is launched before the copies are queued
  // (the code before the twenty-fifth session; its launch held the copies back by about 7 us).
  bool combine_reduce_launched_first_ = false;
  // EP_PLUGIN_COMBINE_SENDER=engine: the copy stream's wait kernel writes the owner's staged_rows/base
  // words and the weights go by a copy before the rows (the code before the twenty-seventh session);
  // `kernel`: the reduction kernel writes both (StagedReduceArgs::sender_kernel).
  bool combine_sender_kernel_ = true;
  // EP_PLUGIN_COMBINE_RELEASE_WAIT=start: each combine's copy stream first waits for the owner's release
  // of the combine before; `trailing` (with the kernel sender): that wait is queued at the end of the
  // combine before, behind its copies.
  bool combine_trailing_release_ = true;
  uint32_t released_epoch_waited_[kMaxNvlPeers] = {};  // [owner]: the release the copy stream waited for last
  // EP_PLUGIN_COMBINE_JOIN_SIGNALS=1: the caller's stream also waits for the landed words' writes.
  bool combine_join_signals_ = false;
  // EP_PLUGIN_COMBINE_PREFETCH: L2 prefetches in the owner's reduction (StagedReduceArgs::prefetch_rows).
  int combine_prefetch_rows_ = 1;
  // EP_PLUGIN_COMBINE_OVERLAP: StagedReduceArgs::overlap_loads (0: the reduction's loop before).
  int combine_overlap_loads_ = 2;
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
