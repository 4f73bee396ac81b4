// IntranodeRuntime: the buffer, the peers' mappings, notify, the dispatches, the SM combine and the
// host side of every wait. The copy-engine combine's host side is in staged_combine.cu.
#include "runtime.cuh"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>

#include "common/binding.h"
#include "common/bulk_rows.cuh"
#include "common/exception.cuh"
#include "common/host_wait.h"
#include "common/text.h"
#include "kernels/buffer_layout.cuh"

namespace ep_plugin {
namespace {

// On the VMs here the host takes about 50 us for a cached dispatch and about 8 us more per cudaMemcpyAsync;
// an SM stores about 38 GB/s into a peer (docs/design.md, "What 8 SMs can move"). NOTE: figures with a
// margin: eager calls back to back have no GPU lead to hide more copies in (a budget of 30 and 6 lost there).
constexpr double kHostUsPerDispatch = 50.0;
constexpr double kHostUsPerCopy = 8.0;
constexpr double kPeerBytesPerUsPerSm = 38e3;

// The copies the host can ask for while the SMs write the rows for peers, so that the copies never hold
// the dispatch (EP2 at 8 SMs: 17 for BF16 rows, 5 for FP8). The rows from peers stand for the rows to
// them (the host does not know those), as many in a balanced routing.
int engine_copy_budget(const intranode::DispatchArgs& args, int64_t peer_rows) {
  const double sm_us = static_cast<double>(peer_rows) * args.row_bytes /
                       (kPeerBytesPerUsPerSm * intranode::direct_dispatch_blocks(args));
  return std::max(0, static_cast<int>((sm_us - kHostUsPerDispatch) / kHostUsPerCopy));
}

// The runs whose own rows the copy engine writes: the longest, as many as engine_copy_budget allows
// (EP2, top-8 of 256, 4096 tokens: about 16 runs; the longest 5 hold about 60% of the rows). Sets them in
// args (in token order) and in runs.by_engine; the SMs write the own rows of the other runs.
void choose_engine_runs(intranode::DispatchArgs& args, OwnRuns& runs, int64_t num_recv_rows) {
  std::vector<int> longest(runs.first.size());
  std::iota(longest.begin(), longest.end(), 0);
  const auto length = [&runs](int i) { return runs.end[i] - runs.first[i]; };
  std::stable_sort(longest.begin(), longest.end(), [&](int a, int b) { return length(a) > length(b); });
  int64_t own_rows = 0;
  for (size_t i = 0; i < runs.first.size(); ++i) own_rows += length(static_cast<int>(i));
  const int budget = engine_copy_budget(args, num_recv_rows - own_rows);
  runs.by_engine.assign(longest.begin(), longest.begin() + std::min<size_t>(longest.size(), budget));
  std::sort(runs.by_engine.begin(), runs.by_engine.end());  // runs are in token order: so are these
  args.num_engine_runs = static_cast<int>(runs.by_engine.size());
  for (int k = 0; k < args.num_engine_runs; ++k) {
    args.engine_run_first[k] = runs.first[runs.by_engine[k]];
    args.engine_run_end[k] = runs.end[runs.by_engine[k]];
  }
}

const char* op_name(int op) {
  switch (op) {
    case kOpNotify: return "dispatch (notify step)";
    case kOpDispatch: return "dispatch";
    case kOpCombine: return "combine";
    case kOpLayout: return "get_dispatch_layout";
    default: return "an ep_plugin kernel";
  }
}

const char* wait_name(int kind) {
  switch (kind) {
    case kWaitBarrier: return "its token counts (the peer has not reached the same call)";
    case kWaitFreeSlot: return "ring space (the peer is not consuming)";
    case kWaitData: return "the next token (the peer is not sending)";
    case kWaitDrain: return "the last tokens to be consumed";
    case kWaitStagedRows: return "its rows of this combine (copy-engine path: the peer has not copied them)";
    case kWaitStagingFree: return "its staging area (copy-engine path: the peer is still summing an earlier piece)";
    case kWaitPeerOutputs: return "where its outputs are (direct dispatch: the peer has not reached the same call)";
    case kWaitPeerRows: return "the last of its rows (direct dispatch: the peer has not finished writing them)";
    default: return "a signal";
  }
}

// "rows of 14336 bytes, 0 scales, top-8 with weights": a pack_row_layout word for error messages.
std::string describe_row_layout(int64_t word) {
  Text out;
  out << "rows of " << intranode::row_layout_bytes(word) << " bytes, " << intranode::row_layout_scales(word)
      << " scales, top-" << intranode::row_layout_topk(word)
      << (intranode::row_layout_weights(word) ? " with" : " without") << " weights";
  return out.str();
}

// The caller's addresses of each operation, checked before anything is launched (Python fills the Args).
void check_addresses(const intranode::NotifyArgs& a) {
  const bool tokens = a.num_tokens > 0;
  check_pointer(a.is_token_in_rank, "is_token_in_rank", tokens);
  check_pointer(a.num_tokens_per_expert, "num_tokens_per_expert");
  check_pointer(a.topk_idx, "topk_idx", tokens);
  check_pointer(a.send_pos, "send_pos", tokens);
  check_pointer(a.recv_rank_offsets, "recv_rank_offsets");
  check_pointer(a.src_num_tokens, "src_num_tokens");
  check_pointer(a.num_recv_tokens, "num_recv_tokens");
}

void check_addresses(const intranode::DispatchArgs& a) {
  const bool tokens = a.num_tokens > 0;
  check_pointer(a.x, "x", tokens, 16);
  check_pointer(a.x_scales, "x_scales", false);
  check_pointer(a.topk_idx, "topk_idx", a.num_topk > 0 && tokens);
  check_pointer(a.topk_weights, "topk_weights", false);
  check_pointer(a.send_pos, "send_pos", tokens);
  check_pointer(a.recv_x, "recv_x", false, 16);
  check_pointer(a.recv_x_scales, "recv_x_scales", a.num_scales > 0);
  check_pointer(a.recv_topk_idx, "recv_topk_idx", false);
  check_pointer(a.recv_topk_weights, "recv_topk_weights", false);
  check_pointer(a.recv_src_idx, "recv_src_idx", false);
  check_pointer(a.num_recv_tokens, "num_recv_tokens");
}

void check_addresses(const intranode::CombineArgs& a) {
  check_pointer(a.x, "x", false, 16);
  check_pointer(a.topk_weights, "topk_weights", false);
  check_pointer(a.recv_src_idx, "recv_src_idx", false);
  check_pointer(a.recv_rank_offsets, "recv_rank_offsets");
  check_pointer(a.src_num_tokens, "src_num_tokens");
  check_pointer(a.send_pos, "send_pos", a.num_tokens > 0);
  check_pointer(a.bias_0, "bias_0", false, 16);
  check_pointer(a.bias_1, "bias_1", false, 16);
  check_pointer(a.combined_x, "combined_x", a.num_tokens > 0, 16);
  check_pointer(a.combined_topk_weights, "combined_topk_weights", false);
}

}  // namespace

IntranodeRuntime::IntranodeRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s,
                                   int64_t staging_bytes, int64_t output_bytes, int direct_max_blocks,
                                   int direct_chunk_tokens)
    : rank_(rank),
      num_ranks_(num_ranks),
      num_nvl_bytes_(num_nvl_bytes),
      direct_max_blocks_(direct_max_blocks),
      direct_chunk_tokens_(direct_chunk_tokens),
      timeout_s_(timeout_s) {
  EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxNvlPeers,
               "the intranode runtime supports 1 to " << kMaxNvlPeers << " ranks, got " << num_ranks);
  EP_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank " << rank << " out of range for " << num_ranks << " ranks");
  EP_CHECK_ARG(num_nvl_bytes >= intranode::kHeaderBytes,
               "num_nvl_bytes must be at least " << intranode::kHeaderBytes << " (got " << num_nvl_bytes
                                                 << "); see Config.get_nvl_buffer_size_hint");
  EP_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
  EP_CHECK_ARG(staging_bytes >= 0, "staging_bytes must be >= 0, got " << staging_bytes);
  EP_CHECK_ARG(output_bytes >= 0, "output_bytes must be >= 0, got " << output_bytes);
  EP_CHECK_ARG(direct_max_blocks >= 0, "direct_max_blocks must be >= 0, got " << direct_max_blocks);
  EP_CHECK_ARG(direct_chunk_tokens >= 1, "direct_chunk_tokens must be >= 1, got " << direct_chunk_tokens);
  timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  staging_offset_ = (num_nvl_bytes + 255) / 256 * 256;
  staging_bytes_ = staging_bytes;
  CUDA_CHECK(cudaGetDevice(&device_));
  output_offset_ = (staging_offset_ + staging_bytes + 255) / 256 * 256;
  output_bytes_ = output_bytes;
  CUDA_CHECK(cudaMalloc(&buffer_, output_bytes > 0    ? output_offset_ + output_bytes
                                  : staging_bytes > 0 ? staging_offset_ + staging_bytes
                                                      : num_nvl_bytes));
  // NOTE: counters are epoch-tagged and never reset later; they must start at zero on every rank
  // before any peer can write them (the caller barriers after this constructor).
  CUDA_CHECK(cudaMemset(buffer_, 0, intranode::kHeaderBytes));
  // The copy-engine combine's owner tells landed staged bytes from the rest by 0xff (kUnlandedWord).
  if (staging_bytes > 0) CUDA_CHECK(cudaMemset(static_cast<uint8_t*>(buffer_) + staging_offset_, 0xff, staging_bytes));
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(DeviceStatus), cudaHostAllocMapped));
  std::memset(const_cast<DeviceStatus*>(status_host_), 0, sizeof(DeviceStatus));
  status_host_->bad_input_rank = -1;
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_host_, 0));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&peer_buffers_device_), sizeof(void*) * kMaxNvlPeers));
  CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  create_copy_streams(staging_bytes);
  if (output_bytes > 0) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&own_rows_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&own_fork_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&own_join_, cudaEventDisableTiming));
  }
  // The copy-engine combine signals from the stream; without the driver entry point, a one-thread
  // kernel writes the word instead.
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &write_value64_, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    write_value64_ = nullptr;
  (void)cudaGetLastError();
  // The dispatch's senders copy rows by bulk copies where the GPU has them (sm_90 on).
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
  dispatch_bulk_rows_ = major >= 9;
  if (staging_bytes > 0) preload_staged_combine();
  CUDA_CHECK(cudaDeviceSynchronize());
  watchdog_ = std::thread([this] { watch_for_device_errors(); });
}

void IntranodeRuntime::watch_for_device_errors() {
  while (!stop_watchdog_.load()) {
    if (status_host_->error_code != kErrNone) {
      std::fprintf(stderr, "ep_plugin: a kernel ended early on rank %d: %s\n", rank_, describe_device_error().c_str());
      std::fflush(stderr);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

IntranodeRuntime::~IntranodeRuntime() {
  try {
    destroy();
  } catch (...) {  // NOTE: never throw from a destructor
  }
}

std::string IntranodeRuntime::ipc_handle() const {
  EP_HOST_ASSERT(buffer_ != nullptr, "the runtime has been destroyed");
  cudaIpcMemHandle_t handle;
  CUDA_CHECK(cudaIpcGetMemHandle(&handle, buffer_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void IntranodeRuntime::connect(const std::vector<std::string>& handles) {
  EP_HOST_ASSERT(!connected_, "connect() called twice");
  EP_CHECK_ARG(static_cast<int>(handles.size()) == num_ranks_,
               "expected " << num_ranks_ << " IPC handles, got " << handles.size());
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) {
      peer_buffers_[r] = buffer_;
      continue;
    }
    EP_CHECK_ARG(handles[r].size() == sizeof(cudaIpcMemHandle_t), "IPC handle of rank " << r << " is malformed");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handles[r].data(), sizeof(handle));
    cudaError_t err = cudaIpcOpenMemHandle(&peer_buffers_[r], handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      Text out;
      out << "rank " << rank_ << " cannot map the NVLink buffer of rank " << r << ": " << cudaGetErrorName(err)
          << " (" << cudaGetErrorString(err) << "); all ranks of the group must share an NVLink/P2P domain";
      throw Error(out.str());
    }
  }
  CUDA_CHECK(cudaMemcpy(peer_buffers_device_, peer_buffers_, sizeof(void*) * kMaxNvlPeers, cudaMemcpyHostToDevice));
  connected_ = true;
}

void IntranodeRuntime::destroy() {
  if (buffer_ == nullptr) return;
  stop_watchdog_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  cudaDeviceSynchronize();
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_ && peer_buffers_[r] != nullptr) cudaIpcCloseMemHandle(peer_buffers_[r]);
  cudaFree(peer_buffers_device_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
  if (own_rows_stream_ != nullptr) {
    cudaStreamDestroy(own_rows_stream_);
    cudaEventDestroy(own_fork_);
    cudaEventDestroy(own_join_);
    own_rows_stream_ = nullptr;
    own_fork_ = own_join_ = nullptr;
  }
  for (int r = 0; r < kMaxNvlPeers; ++r) {
    if (copy_streams_[r] != nullptr) cudaStreamDestroy(copy_streams_[r]);
    if (copy_done_[r] != nullptr) cudaEventDestroy(copy_done_[r]);
    if (signal_streams_[r] != nullptr) cudaStreamDestroy(signal_streams_[r]);
    if (copy_landed_[r] != nullptr) cudaEventDestroy(copy_landed_[r]);
    copy_streams_[r] = signal_streams_[r] = nullptr;
    copy_done_[r] = copy_landed_[r] = nullptr;
  }
  cudaFreeHost(const_cast<DeviceStatus*>(status_host_));
  cudaFree(buffer_);
  buffer_ = nullptr;
  peer_buffers_device_ = nullptr;
  status_host_ = status_device_ = nullptr;
  connected_ = false;
}

void IntranodeRuntime::require_connected() const {
  EP_HOST_ASSERT(buffer_ != nullptr, "the runtime has been destroyed");
  EP_HOST_ASSERT(connected_, "connect() has not been called");
  check_device_error();
}

void IntranodeRuntime::require_buffer_fits(int64_t needed, const char* op) const {
  EP_CHECK_ARG(needed <= num_nvl_bytes_, op << " needs num_nvl_bytes >= " << needed << " for this hidden size and "
                                           << "config, but the buffer has " << num_nvl_bytes_
                                           << " (size it with Config.get_nvl_buffer_size_hint)");
}

void IntranodeRuntime::notify(intranode::NotifyArgs args, cudaStream_t stream) {
  require_connected();
  check_addresses(args);
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = num_ranks_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  if (args.host_tag > 0) status_host_->notify_tag = 0;
  intranode::launch_notify(args, stream);
}

void IntranodeRuntime::fill_dispatch_args(intranode::DispatchArgs& args) const {
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = num_ranks_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  // Rows past the bulk split's reach (about 200 KB) go through registers.
  args.bulk_rows = dispatch_bulk_rows_ && bulk_rows_fit(args.row_bytes);
  args.direct_max_blocks = direct_max_blocks_;
  args.direct_chunk_tokens = direct_chunk_tokens_;
}

void IntranodeRuntime::dispatch(intranode::DispatchArgs args, cudaStream_t stream) {
  require_connected();
  check_addresses(args);
  fill_dispatch_args(args);
  require_rings_fit(args);
  intranode::launch_dispatch(args, stream);
}

void IntranodeRuntime::require_rings_fit(const intranode::DispatchArgs& args) const {
  const intranode::RingLayout layout{num_ranks_, args.num_channels,
                                     intranode::slots_per_sub_ring(args.recv_tokens_per_channel),
                                     intranode::slot_bytes_for(args.row_bytes + 4LL * args.num_scales)};
  require_buffer_fits(layout.total_bytes(), "dispatch");
}

uintptr_t IntranodeRuntime::output_region_address() const {
  EP_HOST_ASSERT(buffer_ != nullptr, "the runtime has been destroyed");
  return reinterpret_cast<uintptr_t>(buffer_) + output_offset_;
}

void IntranodeRuntime::require_in_output_region(const void* output, int64_t bytes, const char* name) const {
  if (output == nullptr) return;
  const int64_t offset = static_cast<const uint8_t*>(output) - static_cast<const uint8_t*>(buffer_);
  EP_CHECK_ARG(offset >= output_offset_ && offset + bytes <= output_offset_ + output_bytes_,
               "direct dispatch: " << name << " (" << bytes << " bytes) is not in this rank's output region of "
                                   << output_bytes_ << " bytes (buffer.dispatch_output_bytes)");
}

std::shared_ptr<OwnRuns> IntranodeRuntime::direct_dispatch(intranode::DispatchArgs args, int64_t num_recv_rows,
                                                            bool has_room, cudaStream_t stream, int own_runs_tag,
                                                            std::shared_ptr<OwnRuns> own_runs) {
  require_connected();
  EP_CHECK_ARG(output_bytes_ > 0, "direct dispatch needs an output region (buffer.dispatch_output_bytes > 0)");
  EP_CHECK_ARG(num_recv_rows >= 0, "num_recv_rows must be >= 0, got " << num_recv_rows);
  check_addresses(args);
  fill_dispatch_args(args);
  require_rings_fit(args);  // for a fallback
  args.direct_has_room = has_room;
  if (has_room) {
    const int64_t rows = num_recv_rows;
    require_in_output_region(args.recv_x, rows * args.row_bytes, "recv_x");
    require_in_output_region(args.recv_x_scales, rows * args.num_scales * 4, "recv_x_scales");
    require_in_output_region(args.recv_topk_idx, rows * args.num_topk * 8, "recv_topk_idx");
    require_in_output_region(args.recv_topk_weights, rows * args.num_topk * 4, "recv_topk_weights");
    require_in_output_region(args.recv_src_idx, rows * 4, "recv_src_idx");
  }
  // NOTE: notify publishes the runs a few microseconds after the count, while the host places the outputs;
  // the host waits for them only where this call may use them (the handle then keeps them).
  const bool few_blocks = intranode::direct_dispatch_blocks(args) <= intranode::kOwnRowsByEngineMaxBlocks;
  if (has_room && few_blocks && own_runs_tag > 0) own_runs = published_own_runs(own_runs_tag, stream);
  args.num_engine_runs = 0;
  if (has_room && few_blocks && own_runs != nullptr) choose_engine_runs(args, *own_runs, num_recv_rows);
  const bool engine_copies = args.num_engine_runs > 0;
  // The copies start behind everything queued before the dispatch (the outputs' memory may be in use).
  if (engine_copies) CUDA_CHECK(cudaEventRecord(own_fork_, stream));
  intranode::launch_direct_dispatch(args, stream);
  // NOTE: ends at once unless some rank had no room (the direct kernel's flag in this rank's header);
  // launched as a programmatic dependent, it overlaps the direct kernel's end. On a fallback it writes
  // the own rows too, the same bytes as the engine.
  args.only_after_fallback = true;
  intranode::launch_dispatch(args, stream);
  if (engine_copies) {
    copy_own_rows(args, *own_runs);
    CUDA_CHECK(cudaStreamWaitEvent(stream, own_join_, 0));
  }
  return own_runs;
}

std::shared_ptr<OwnRuns> IntranodeRuntime::published_own_runs(int tag, cudaStream_t stream) const {
  wait_for_tag(status_host_->own_runs_tag, tag, stream, "notify did not publish the runs of its own tokens");
  const int count = status_host_->num_own_runs;
  if (count <= 0) return nullptr;
  auto runs = std::make_shared<OwnRuns>();
  // This rank's rows for itself follow those of the ranks before it.
  int row = 0;
  for (int s = 0; s < rank_; ++s) row += status_host_->num_recv_tokens_per_rank[s];
  for (int i = 0; i < count; ++i) {
    runs->first.push_back(static_cast<int32_t>(status_host_->own_run_first[i]));
    runs->end.push_back(static_cast<int32_t>(status_host_->own_run_end[i]));
    runs->first_row.push_back(row);
    row += runs->end.back() - runs->first.back();
  }
  return runs;
}

void IntranodeRuntime::copy_own_rows(const intranode::DispatchArgs& args, const OwnRuns& runs) {
  CUDA_CHECK(cudaStreamWaitEvent(own_rows_stream_, own_fork_, 0));
  // NOTE: a copy per run: one cudaMemcpyBatchAsync call of them takes the host as long (7-10 us a copy)
  // and the engine as long (16 copies of 3.7 MB: 146 us, 400 GB/s, against 149).
  for (const int i : runs.by_engine)
    CUDA_CHECK(cudaMemcpyAsync(
        static_cast<uint8_t*>(args.recv_x) + static_cast<int64_t>(runs.first_row[i]) * args.row_bytes,
        static_cast<const uint8_t*>(args.x) + static_cast<int64_t>(runs.first[i]) * args.row_bytes,
        static_cast<size_t>(runs.end[i] - runs.first[i]) * args.row_bytes, cudaMemcpyDeviceToDevice,
        own_rows_stream_));
  CUDA_CHECK(cudaEventRecord(own_join_, own_rows_stream_));
}

bool IntranodeRuntime::direct_fell_back() const {
  require_connected();
  uint32_t flag = 0;
  const auto* header = static_cast<const intranode::Header*>(buffer_);
  CUDA_CHECK(cudaMemcpy(&flag, &header->direct_fell_back, sizeof(flag), cudaMemcpyDeviceToHost));
  return flag != 0;
}

void IntranodeRuntime::combine(intranode::CombineArgs args, cudaStream_t stream) {
  require_connected();
  check_addresses(args);
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = num_ranks_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  const intranode::RingLayout layout{num_ranks_, args.num_channels,
                                     intranode::slots_per_sub_ring(args.recv_tokens_per_channel),
                                     intranode::slot_bytes_for(2LL * args.hidden)};
  require_buffer_fits(layout.total_bytes(), "combine");
  intranode::launch_combine(args, stream);
}
std::string IntranodeRuntime::describe_device_error() const {
  const DeviceStatus& s = *status_host_;
  Text out;
  if (s.error_code == kErrTimeout) {
    out << "timeout in " << op_name(s.error_op) << " after " << timeout_s_ << " s: rank " << s.error_rank
        << " waited for peer " << s.error_peer << " (channel " << s.error_channel << ", warp " << s.error_warp
        << ") for " << wait_name(s.error_wait_kind) << "; expected " << s.error_expected << ", observed "
        << s.error_observed << ". Every rank must make the same sequence of ep_plugin calls.";
  } else if (s.error_code == kErrTooManyRecvTokens) {
    out << "rank " << s.error_peer << " receives " << s.error_observed << " tokens, more than num_worst_tokens = "
        << s.error_expected;
  } else if (s.error_code == kErrBadExpertId) {
    out << "rank " << s.error_peer << " passed an expert id out of range (token " << s.error_expected << ", id "
        << s.error_observed << ")";
  } else if (s.error_code == kErrLayoutMismatch) {
    out << "ranks disagree on the row layout of a dispatch: rank " << s.error_rank << " sends "
        << describe_row_layout(s.error_expected) << ", rank " << s.error_peer << " "
        << describe_row_layout(s.error_observed) << " (x, x_scales, topk_idx and topk_weights must have the same "
        << "widths, dtypes and presence on every rank)";
  } else {
    out << "device error code " << s.error_code;
  }
  return out.str();
}

// NOTE: the kernels leave on an error (they do not trap): the CUDA context stays usable, and every
// later call of this runtime throws here before it launches anything.
void IntranodeRuntime::check_device_error() const {
  if (status_host_ != nullptr && status_host_->error_code != kErrNone)
    throw Error("ep_plugin: a kernel ended early on rank " + std::to_string(rank_) + ": " + describe_device_error());
}

void IntranodeRuntime::wait_for_tag(const volatile int32_t& word, int tag, cudaStream_t stream,
                                    const char* what) const {
  // The device gives up after timeout_s; the host allows a little more so the device's report wins.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_ + 5.0);
  int spins = 0;
  while (word != tag) {
    check_device_error();
    if (++spins % 1024 == 0) {
      const cudaError_t state = cudaStreamQuery(stream);
      if (state != cudaSuccess && state != cudaErrorNotReady) {
        check_device_error();
        throw Error(std::string("ep_plugin: dispatch failed on rank ") + std::to_string(rank_) + ": " +
                    cudaGetErrorName(state) + " (" + cudaGetErrorString(state) + ")");
      }
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline) {
        Text out;
        out << "rank " << rank_ << ": " << what << " within " << timeout_s_
            << " s (a peer never reached the same dispatch call?)";
        throw TimeoutError(out.str());
      }
      yield_if_waiting_long(start, now);
    }
  }
}

int IntranodeRuntime::wait_notify(int tag, cudaStream_t stream) {
  EP_HOST_ASSERT(tag > 0, "notify tags are positive");
  wait_for_tag(status_host_->notify_tag, tag, stream, "the notify step of dispatch did not finish");
  const int bad_rank = status_host_->bad_input_rank;
  if (bad_rank >= 0 && status_host_->bad_input_code == kErrLayoutMismatch) {
    Text out;
    out << "dispatch rejected on every rank: ranks disagree on the row layout (x, x_scales, topk_idx and "
        << "topk_weights must have the same widths, dtypes and presence on every rank): rank " << rank_ << " sends "
        << describe_row_layout(status_host_->bad_input_detail[0]) << ", rank " << bad_rank << " "
        << describe_row_layout(status_host_->bad_input_detail[1]) << "; no data was sent";
    throw InvalidArgument(out.str());
  }
  if (bad_rank >= 0) {
    Text out;
    out << "rank " << bad_rank << ": topk_idx[" << status_host_->bad_input_detail[0] << ", "
        << status_host_->bad_input_detail[1] << "] = " << status_host_->bad_input_detail[2]
        << " is not an expert id (expected -1 or a value in [0, num_experts)); no data was sent";
    throw InvalidArgument(out.str());
  }
  return status_host_->num_recv_tokens;
}

NotifyCounts IntranodeRuntime::notify_counts(int num_local_experts) const {
  EP_CHECK_ARG(num_local_experts >= 0 && num_local_experts <= kMaxLocalExperts, "bad num_local_experts");
  NotifyCounts result;
  result.num_recv_tokens_per_rank.resize(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) result.num_recv_tokens_per_rank[r] = status_host_->num_recv_tokens_per_rank[r];
  result.num_recv_tokens_per_expert.resize(num_local_experts);
  for (int e = 0; e < num_local_experts; ++e)
    result.num_recv_tokens_per_expert[e] = status_host_->num_recv_tokens_per_expert[e];
  result.largest_block_rows = status_host_->largest_block_rows;
  return result;
}

}  // namespace ep_plugin
