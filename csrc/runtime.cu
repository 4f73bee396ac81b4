#include "runtime.cuh"

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "common/bulk_rows.cuh"
#include "common/exception.cuh"
#include "common/text.h"
#include "kernels/buffer_layout.cuh"

namespace ep_plugin {
namespace {

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
    case kWaitStagedDispatchRows:
      return "its rows of this dispatch (copy-engine rows: the peer's copy into the staging area has not landed)";
    case kWaitPeerMetadata:
      return "its source indices (direct dispatch with copy-engine rows: the peer has not written them)";
    case kWaitPushEntered: return "it to enter the same combine (push combine: its staging area may still be read)";
    case kWaitPushRows: return "a chunk of its rows (push combine: the peer has not pushed them)";
    default: return "a signal";
  }
}

// Environment variable `name` set to `off` or `on`: whether it is `on`; unset: `current`; else an error.
bool env_picks(const char* name, const char* off, const char* on, bool current) {
  const char* value = std::getenv(name);
  if (value == nullptr) return current;
  EP_CHECK_ARG(std::strcmp(value, off) == 0 || std::strcmp(value, on) == 0,
               name << " must be " << off << " or " << on << ", got " << value);
  return std::strcmp(value, on) == 0;
}

// Environment variable `name` as an integer in [low, high]; unset: `current`; else an error.
int env_int(const char* name, int low, int high, int current) {
  const char* value = std::getenv(name);
  if (value == nullptr) return current;
  int parsed = 0;
  char rest = 0;
  EP_CHECK_ARG(std::sscanf(value, "%d%c", &parsed, &rest) == 1 && parsed >= low && parsed <= high,
               name << " must be an integer from " << low << " to " << high << ", got " << value);
  return parsed;
}

// "rows of 14336 bytes, 0 scales, top-8 with weights": a pack_row_layout word for error messages.
std::string describe_row_layout(int64_t word) {
  Text out;
  out << "rows of " << intranode::row_layout_bytes(word) << " bytes, " << intranode::row_layout_scales(word)
      << " scales, top-" << intranode::row_layout_topk(word)
      << (intranode::row_layout_weights(word) ? " with" : " without") << " weights";
  return out.str();
}

}  // namespace

using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

IntranodeRuntime::IntranodeRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s,
                                   int64_t staging_bytes, int64_t output_bytes)
    : rank_(rank), num_ranks_(num_ranks), num_nvl_bytes_(num_nvl_bytes), timeout_s_(timeout_s) {
  EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxNvlPeers,
               "the intranode runtime supports 1 to " << kMaxNvlPeers << " ranks, got " << num_ranks);
  EP_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank " << rank << " out of range for " << num_ranks << " ranks");
  EP_CHECK_ARG(num_nvl_bytes >= intranode::kHeaderBytes,
               "num_nvl_bytes must be at least " << intranode::kHeaderBytes << " (got " << num_nvl_bytes
                                                 << "); see Config.get_nvl_buffer_size_hint");
  EP_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
  EP_CHECK_ARG(staging_bytes >= 0, "staging_bytes must be >= 0, got " << staging_bytes);
  EP_CHECK_ARG(output_bytes >= 0, "output_bytes must be >= 0, got " << output_bytes);
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
  // The copy-engine combine signals from the stream; without the driver entry point, or with
  // EP_PLUGIN_STREAM_WRITES=kernel, a one-thread kernel writes the word instead.
  const char* stream_writes = std::getenv("EP_PLUGIN_STREAM_WRITES");
  cudaDriverEntryPointQueryResult found;
  if ((stream_writes != nullptr && std::string(stream_writes) == "kernel") ||
      cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &write_value64_, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    write_value64_ = nullptr;
  (void)cudaGetLastError();
  // The dispatch's senders copy rows by bulk copies where the GPU has them (sm_90 on).
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
  dispatch_bulk_rows_ = major >= 9;
  read_tuning_overrides();
  if (staging_bytes > 0) preload_staged_combine();
  CUDA_CHECK(cudaDeviceSynchronize());
  watchdog_ = std::thread([this] { watch_for_device_errors(); });
}

void IntranodeRuntime::read_tuning_overrides() {
  if (const char* share = std::getenv("EP_PLUGIN_DISPATCH_SELF_SHARE")) {
    EP_CHECK_ARG(std::sscanf(share, "%d/%d", &self_copy_receiver_rounds_, &self_copy_period_) == 2 &&
                     self_copy_period_ >= 1 && self_copy_receiver_rounds_ >= 0 &&
                     self_copy_receiver_rounds_ <= self_copy_period_,
                 "EP_PLUGIN_DISPATCH_SELF_SHARE must be K/M with 0 <= K <= M, M >= 1, got " << share);
  }
  if (const char* late = std::getenv("EP_PLUGIN_DISPATCH_LATE_SCALES")) late_scales_ = std::atoi(late) != 0;
  if (const char* bulk = std::getenv("EP_PLUGIN_DISPATCH_BULK")) dispatch_bulk_rows_ = std::atoi(bulk) != 0;
  constexpr int kAny = std::numeric_limits<int>::max();
  direct_max_blocks_ = env_int("EP_PLUGIN_DIRECT_MAX_BLOCKS", 0, kAny, direct_max_blocks_);
  staged_max_blocks_ = env_int("EP_PLUGIN_STAGED_MAX_BLOCKS", 0, kAny, staged_max_blocks_);
  dispatch_ce_share_ = env_int("EP_PLUGIN_DISPATCH_CE_SHARE", 0, 100, dispatch_ce_share_);
  direct_chunk_tokens_ = env_int("EP_PLUGIN_DIRECT_CHUNK", 0, kAny, direct_chunk_tokens_);
  direct_block_fence_sys_ = env_picks("EP_PLUGIN_DIRECT_BLOCK_FENCE", "gpu", "sys", direct_block_fence_sys_);
  direct_acquire_exchange_loads_ =
      env_picks("EP_PLUGIN_DIRECT_EXCHANGE_LOADS", "relaxed", "acquire", direct_acquire_exchange_loads_);
  if (const char* pair = std::getenv("EP_PLUGIN_COMBINE_PAIR")) combine_pair_path_ = std::atoi(pair) != 0;
  if (const char* signals = std::getenv("EP_PLUGIN_COMBINE_SIGNAL_STREAM")) combine_signal_stream_ = std::atoi(signals) != 0;
  combine_reduce_launched_first_ =
      env_picks("EP_PLUGIN_COMBINE_LAUNCH", "copies", "reduce", combine_reduce_launched_first_);
  if (const char* early = std::getenv("EP_PLUGIN_COMBINE_EARLY_ROWS")) combine_early_rows_ = std::atoi(early) != 0;
  combine_sender_kernel_ = env_picks("EP_PLUGIN_COMBINE_SENDER", "engine", "kernel", combine_sender_kernel_);
  combine_trailing_release_ =
      env_picks("EP_PLUGIN_COMBINE_RELEASE_WAIT", "start", "trailing", combine_trailing_release_);
  if (const char* join = std::getenv("EP_PLUGIN_COMBINE_JOIN_SIGNALS")) combine_join_signals_ = std::atoi(join) != 0;
  combine_overlap_loads_ = env_int("EP_PLUGIN_COMBINE_OVERLAP", 0, 2, combine_overlap_loads_);
  combine_prefetch_rows_ = env_int("EP_PLUGIN_COMBINE_PREFETCH", 0, 2, combine_prefetch_rows_);
  combine_copy_pieces_ = env_int("EP_PLUGIN_COMBINE_COPY_PIECES", 0, kAny, combine_early_rows_ ? 0 : 1);
}

void IntranodeRuntime::watch_for_device_errors() {
  while (!stop_watchdog_.load()) {
    if (status_host_->error_code != kErrNone) {
      std::fprintf(stderr, "ep_plugin: a kernel stopped on rank %d: %s\n", rank_, describe_device_error().c_str());
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
  for (int r = 0; r < kMaxNvlPeers; ++r) {
    if (copy_streams_[r] != nullptr) cudaStreamDestroy(copy_streams_[r]);
    if (copy_done_[r] != nullptr) cudaEventDestroy(copy_done_[r]);
    if (signal_streams_[r] != nullptr) cudaStreamDestroy(signal_streams_[r]);
    if (copy_landed_[r] != nullptr) cudaEventDestroy(copy_landed_[r]);
    if (signals_done_[r] != nullptr) cudaEventDestroy(signals_done_[r]);
    copy_streams_[r] = signal_streams_[r] = nullptr;
    copy_done_[r] = copy_landed_[r] = signals_done_[r] = nullptr;
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
  args.self_copy_receiver_rounds = self_copy_receiver_rounds_;
  args.self_copy_period = self_copy_period_;
  args.late_scales = late_scales_;
  // Rows past the bulk split's reach (about 200 KB) go through registers.
  args.bulk_rows = dispatch_bulk_rows_ && bulk_rows_fit(args.row_bytes);
  args.direct_max_blocks = direct_max_blocks_;
  args.direct_chunk_tokens = direct_chunk_tokens_;
  args.direct_block_fence_sys = direct_block_fence_sys_;
  args.direct_acquire_exchange_loads = direct_acquire_exchange_loads_;
}

void IntranodeRuntime::dispatch(intranode::DispatchArgs args, cudaStream_t stream) {
  require_connected();
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

int IntranodeRuntime::direct_dispatch(intranode::DispatchArgs args, int64_t num_recv_rows, bool has_room,
                                       cudaStream_t stream, const StagedDispatch* staged) {
  require_connected();
  EP_CHECK_ARG(output_bytes_ > 0, "direct dispatch needs an output region (buffer.dispatch_output_bytes > 0)");
  EP_CHECK_ARG(num_recv_rows >= 0, "num_recv_rows must be >= 0, got " << num_recv_rows);
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
  if (staged != nullptr) {
    EP_CHECK_ARG(num_ranks_ > 1, "copy-engine dispatch rows need 2 or more ranks");
    EP_CHECK_ARG(staged->staging_bytes > 0 && staged->staging_bytes <= staging_bytes_,
                 "staging_bytes must be in (0, " << staging_bytes_ << "], got " << staged->staging_bytes);
    EP_CHECK_ARG(combine_early_rows_, "copy-engine dispatch rows need the staging area refilled after each use "
                                      "(EP_PLUGIN_COMBINE_EARLY_ROWS=0 turns that off)");
    EP_CHECK_ARG(args.recv_rank_offsets != nullptr, "copy-engine dispatch rows need recv_rank_offsets");
    EP_CHECK_ARG(num_recv_rows == 0 || args.cached_src_idx != nullptr || args.recv_src_idx != nullptr,
                 "copy-engine dispatch rows need the received rows' source indices (cached_src_idx or recv_src_idx)");
    // NOTE: every rank numbers this call alike (the combine's copies share the area and the numbers).
    args.staged_epoch = ++staged_epoch_;
    args.direct_max_blocks = staged_max_blocks_;
    args.staging_offset = staging_offset_;
    args.staging_peer_bytes = staging_peer_bytes(staged->staging_bytes);
    args.staged_tokens = staged_token_count(args.num_tokens, args.row_bytes, args.staging_peer_bytes);
    CUDA_CHECK(cudaEventRecord(fork_, stream));
    if (args.staged_tokens > 0)
      for (int r = 0; r < num_ranks_; ++r)
        if (r != rank_) copy_x_to_peer(args, r);
  }
  intranode::launch_direct_dispatch(args, stream);
  // NOTE: ends at once unless some rank had no room (the direct kernel's flag in this rank's header);
  // launched as a programmatic dependent, it overlaps the direct kernel's end.
  args.only_after_fallback = true;
  intranode::launch_dispatch(args, stream);
  if (staged != nullptr) {
    if (args.staged_tokens > 0) {
      for (int r = 0; r < num_ranks_; ++r) {
        if (r == rank_) continue;
        CUDA_CHECK(cudaStreamWaitEvent(stream, copy_done_[r], 0));  // x is read
        if (combine_signal_stream_) {
          CUDA_CHECK(cudaEventRecord(signals_done_[r], signal_streams_[r]));
          CUDA_CHECK(cudaStreamWaitEvent(stream, signals_done_[r], 0));
        }
      }
    }
    release_dispatch_staging(args, stream, staged->side);
  }
  return args.staged_tokens;
}

int64_t IntranodeRuntime::staging_peer_bytes(int64_t staging_bytes) const {
  return num_ranks_ > 1 ? staging_bytes / (num_ranks_ - 1) / 256 * 256 : 0;
}

int IntranodeRuntime::staged_token_count(int num_tokens, int row_bytes, int64_t peer_bytes) const {
  const int64_t share = (static_cast<int64_t>(num_tokens) * dispatch_ce_share_ + 99) / 100;
  return static_cast<int>(std::min({share, peer_bytes / row_bytes, static_cast<int64_t>(num_tokens)}));
}

void IntranodeRuntime::copy_x_to_peer(const intranode::DispatchArgs& args, int peer) {
  cudaStream_t stream = copy_streams_[peer];
  auto* mine = reinterpret_cast<intranode::Header*>(buffer_);
  const uint32_t epoch = args.staged_epoch;
  CUDA_CHECK(cudaStreamWaitEvent(stream, fork_, 0));
  // The peer must have finished reading (and refilled) its area after the call before.
  wait_for_owner(&mine->staged_released[peer], epoch - 1, peer, -1, stream);
  uint8_t* region = static_cast<uint8_t*>(peer_buffers_[peer]) +
                    intranode::staged_x_offset(staging_offset_, args.staging_peer_bytes, peer, rank_);
  const int64_t first_staged = args.num_tokens - args.staged_tokens;
  CUDA_CHECK(cudaMemcpyAsync(region, static_cast<const uint8_t*>(args.x) + first_staged * args.row_bytes,
                             static_cast<int64_t>(args.staged_tokens) * args.row_bytes, cudaMemcpyDeviceToDevice,
                             stream));
  signal_landed(peer, intranode::staged_word(epoch, static_cast<uint32_t>(args.staged_tokens)), stream);
  CUDA_CHECK(cudaEventRecord(copy_done_[peer], stream));
}

void IntranodeRuntime::release_dispatch_staging(const intranode::DispatchArgs& args, cudaStream_t stream,
                                                cudaStream_t side) {
  // NOTE: off the caller's stream, as after a combine: the kernel has seen every staged copy land whole.
  // Each source's part is refilled whole: the host does not know how many rows a source sent.
  CUDA_CHECK(cudaEventRecord(join_, stream));
  CUDA_CHECK(cudaStreamWaitEvent(side, join_, 0));
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    CUDA_CHECK(cudaMemsetAsync(
        static_cast<uint8_t*>(buffer_) + intranode::staged_x_offset(staging_offset_, args.staging_peer_bytes, rank_, r),
        0xff, args.staging_peer_bytes, side));
  }
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_)
      write_word(&static_cast<intranode::Header*>(peer_buffers_[r])->staged_released[rank_], args.staged_epoch, side);
}

void IntranodeRuntime::signal_landed(int owner, uint64_t value, cudaStream_t stream) {
  auto* theirs = static_cast<intranode::Header*>(peer_buffers_[owner]);
  if (!combine_signal_stream_) {
    write_word(&theirs->staged_landed[rank_], value, stream);
    return;
  }
  // NOTE: the event keeps the writes in copy order; each wait takes the event's latest record.
  cudaStream_t signals = signal_streams_[owner];
  CUDA_CHECK(cudaEventRecord(copy_landed_[owner], stream));
  CUDA_CHECK(cudaStreamWaitEvent(signals, copy_landed_[owner], 0));
  write_word(&theirs->staged_landed[rank_], value, signals);
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

int64_t IntranodeRuntime::staging_rows(int64_t staging_bytes, int hidden) const {
  if (staging_bytes > staging_bytes_) return 0;
  return intranode::StagingLayout::fit(num_ranks_, staging_offset_, staging_bytes, 2LL * hidden).rows_capacity();
}

void IntranodeRuntime::create_copy_streams(int64_t staging_bytes) {
  if (staging_bytes == 0) return;
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_streams_[r], cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&copy_done_[r], cudaEventDisableTiming));
    CUDA_CHECK(cudaStreamCreateWithFlags(&signal_streams_[r], cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&copy_landed_[r], cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&signals_done_[r], cudaEventDisableTiming));
  }
}

void IntranodeRuntime::preload_staged_combine() {
  // NOTE: on 2x H200 every copy-engine combine timed out until these kernels were loaded up front:
  // the first launch of a kernel loads it, and the load waited for the running reduction, which
  // waited for the very copies queued behind that launch.
  intranode::load_staged_combine_kernels();
  // One harmless run of each sender-side kernel, on this rank's own words (never read by a peer).
  auto* header = reinterpret_cast<intranode::Header*>(buffer_);
  wait_for_owner(&header->staged_released[rank_], 0, rank_, -1, nullptr);
  intranode::launch_write_word(&header->staged_released[rank_], 0, nullptr);
}

void IntranodeRuntime::write_word(uint64_t* address, uint64_t value, cudaStream_t stream) {
  if (write_value64_ == nullptr) {
    intranode::launch_write_word(address, value, stream);
    return;
  }
  // NOTE: the default flags put a memory barrier before the write: the copies queued before it are
  // visible to whoever reads the new value.
  const CUresult result = reinterpret_cast<WriteValue64>(write_value64_)(
      reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value, 0);
  if (result != CUDA_SUCCESS) {
    Text out;
    out << "ep_plugin: rank " << rank_ << ": cuStreamWriteValue64 failed with CUresult " << static_cast<int>(result);
    throw Error(out.str());
  }
}

void IntranodeRuntime::staged_combine(StagedCombineRequest request, cudaStream_t stream, cudaStream_t side) {
  require_connected();
  const int R = num_ranks_;
  intranode::StagedReduceArgs& args = request.reduce;
  EP_CHECK_ARG(static_cast<int>(request.rows_from.size()) == R, "rows_from needs one count per rank");
  EP_CHECK_ARG(request.staging_bytes > 0 && request.staging_bytes <= staging_bytes_,
               "staging_bytes must be in (0, " << staging_bytes_ << "], got " << request.staging_bytes);
  const auto layout = intranode::StagingLayout::fit(R, staging_offset_, request.staging_bytes, 2LL * args.hidden);
  EP_CHECK_ARG(layout.num_slots >= 2, "the staging area holds fewer than two pieces of rows of hidden " << args.hidden);
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = R;
  args.staging_offset = staging_offset_;
  args.staging_bytes = request.staging_bytes;
  args.epoch = ++staged_epoch_;
  args.pair_path = combine_pair_path_;
  args.early_rows = combine_early_rows_;
  // NOTE: without early rows the staging area is not refilled with unlanded bytes, which the owner's
  // reads of the kernel-stored weights rely on.
  args.sender_kernel = combine_sender_kernel_ && combine_early_rows_;
  args.prefetch_rows = combine_prefetch_rows_;
  args.overlap_loads = combine_overlap_loads_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  // Rows received from rank r are rows [first, first + rows_from[r]) of x: they go back to r.
  for (int r = 0, first = 0; r < R; first += request.rows_from[r], ++r) {
    args.send_first[r] = first;
    args.send_rows[r] = request.rows_from[r];
  }

  // The owner side sums on `side`; the rows for each owner go out on that owner's copy stream.
  // NOTE: one stream per owner: a sender that waits for one owner to free a slot must not hold back
  // its rows for another owner, which may need them to free its own slots.
  CUDA_CHECK(cudaEventRecord(fork_, stream));
  if (combine_reduce_launched_first_) launch_reduction(args, request.num_sms, side);
  // NOTE: the copies are queued before the reduction is launched: the critical path is the copy, and
  // the reduction has nothing to sum before its first rows land (twenty-fifth session: a launch
  // before the copies held them back by about 7 us).
  for (int r = 0; r < R; ++r) {
    if (r == rank_) continue;
    CUDA_CHECK(cudaStreamWaitEvent(copy_streams_[r], fork_, 0));
    copy_rows_to_owner(args, layout, r, copy_streams_[r]);
    CUDA_CHECK(cudaEventRecord(copy_done_[r], copy_streams_[r]));
    CUDA_CHECK(cudaStreamWaitEvent(stream, copy_done_[r], 0));
    // NOTE: the caller need not wait for the landed words: they touch only the owner's header, and the
    // next writes to it queue behind them on the same signal stream (no graph captures this combine).
    if (combine_signal_stream_ && combine_join_signals_) {
      CUDA_CHECK(cudaEventRecord(signals_done_[r], signal_streams_[r]));
      CUDA_CHECK(cudaStreamWaitEvent(stream, signals_done_[r], 0));
    }
  }
  if (!combine_reduce_launched_first_) launch_reduction(args, request.num_sms, side);
  if (args.sender_kernel && combine_trailing_release_) wait_for_releases(args.epoch);
  CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
  // NOTE: queued last, so that nothing the host might block on stands before the copies the
  // running reduction waits for.
  release_staging(args, layout, side);
}

void IntranodeRuntime::wait_for_releases(uint32_t epoch) {
  // The next combine's copies need each owner's release of this one: waited for now, behind this
  // combine's copies (after their events, so the caller does not wait), it is usually over before the
  // next combine starts.
  auto* mine = reinterpret_cast<intranode::Header*>(buffer_);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    wait_for_owner(&mine->staged_released[r], epoch, r, -1, copy_streams_[r]);
    released_epoch_waited_[r] = epoch;
  }
}

void IntranodeRuntime::launch_reduction(const intranode::StagedReduceArgs& args, int num_sms, cudaStream_t side) {
  CUDA_CHECK(cudaStreamWaitEvent(side, fork_, 0));
  intranode::launch_staged_reduce(args, num_sms, side);
  CUDA_CHECK(cudaEventRecord(join_, side));
}

void IntranodeRuntime::release_staging(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                                       cudaStream_t side) {
  // NOTE: after the reduction, off the caller's stream: the caller waits for the sums only. The next
  // combine's reduction follows on `side`, and its senders copy once they see the release.
  if (combine_early_rows_) {
    // Every row and weight a source can have sent: each of this rank's tokens has at most one copy per rank.
    const int64_t rows = std::min<int64_t>(args.num_tokens, layout.rows_capacity());
    const int64_t weights = std::min<int64_t>(static_cast<int64_t>(args.num_tokens) * args.num_topk,
                                              layout.rows_capacity() * intranode::kMaxTopk);
    for (int r = 0; r < num_ranks_; ++r) {
      if (r == rank_ || rows == 0) continue;
      uint8_t* region = static_cast<uint8_t*>(buffer_) + layout.region_offset(rank_, r);
      CUDA_CHECK(cudaMemsetAsync(region, 0xff, rows * layout.row_bytes, side));
      if (weights > 0) CUDA_CHECK(cudaMemsetAsync(region + layout.weights_offset(0, 1), 0xff, weights * 4, side));
    }
  }
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_) write_word(&static_cast<intranode::Header*>(peer_buffers_[r])->staged_released[rank_], args.epoch, side);
}

void IntranodeRuntime::copy_rows_to_owner(const intranode::StagedReduceArgs& args,
                                          const intranode::StagingLayout& layout, int owner, cudaStream_t stream) {
  using intranode::staged_word;
  auto* mine = reinterpret_cast<intranode::Header*>(buffer_);
  auto* theirs = static_cast<intranode::Header*>(peer_buffers_[owner]);
  const uint32_t epoch = args.epoch;
  const int64_t first = args.send_first[owner], rows = args.send_rows[owner];
  // The owner must have finished reading the previous combine's staging area and words (unless the
  // previous combine's copy stream already waited for that); then this combine's block is told, by the
  // wait here or by the reduction kernel (sender_kernel).
  if (!args.sender_kernel)
    wait_for_owner(&mine->staged_released[owner], epoch - 1, owner, -1, stream,
                   {&theirs->staged_rows[rank_], staged_word(epoch, static_cast<uint32_t>(rows))},
                   {&theirs->staged_base[rank_], staged_word(epoch, static_cast<uint32_t>(first))});
  else if (released_epoch_waited_[owner] != epoch - 1)
    wait_for_owner(&mine->staged_released[owner], epoch - 1, owner, -1, stream);

  uint8_t* region = static_cast<uint8_t*>(peer_buffers_[owner]) + layout.region_offset(owner, rank_);
  const bool has_weights = args.topk_weights != nullptr && args.num_topk > 0;
  const bool weights_whole = layout.weights_fit_whole(rows, args.num_topk);
  // NOTE: one copy for all the weights: a small copy per piece cost ~5 us of the stream each.
  if (has_weights && weights_whole && rows > 0 && !args.sender_kernel)
    CUDA_CHECK(cudaMemcpyAsync(region + layout.weights_offset(0, args.num_topk), args.topk_weights + first * args.num_topk,
                               rows * args.num_topk * 4, cudaMemcpyDeviceToDevice, stream));
  const int64_t row_bytes = 2LL * args.hidden;
  const int64_t rows_per_piece = layout.rows_per_piece;
  for (int64_t piece = 0, done = 0; done < rows;) {
    const int slot = static_cast<int>(piece % layout.num_slots);
    if (piece >= layout.num_slots)  // the owner must have summed the slot's previous piece
      wait_for_owner(&mine->staged_freed[owner][slot],
                     staged_word(epoch, static_cast<uint32_t>(piece - layout.num_slots + 1)), owner, slot, stream);
    // The first round of slots (free, and summed as it lands) in copies of up to combine_copy_pieces_
    // pieces; later pieces one per copy, each after its slot is freed.
    int64_t pieces = 1;
    if (piece < layout.num_slots) {
      pieces = layout.num_slots - piece;
      if (combine_copy_pieces_ > 0) pieces = std::min<int64_t>(pieces, combine_copy_pieces_);
    }
    const int64_t count = std::min(pieces * rows_per_piece, rows - done);
    piece += pieces;
    const int64_t row = first + done;
    const int64_t staged = static_cast<int64_t>(slot) * rows_per_piece;
    CUDA_CHECK(cudaMemcpyAsync(region + layout.row_offset(staged), static_cast<const uint8_t*>(args.x) + row * row_bytes,
                               count * row_bytes, cudaMemcpyDeviceToDevice, stream));
    if (has_weights && !weights_whole)
      CUDA_CHECK(cudaMemcpyAsync(region + layout.weights_offset(staged, args.num_topk),
                                 args.topk_weights + row * args.num_topk, count * args.num_topk * 4,
                                 cudaMemcpyDeviceToDevice, stream));
    done += count;
    // Copies land in order on this one stream: the owner counts the rows landed.
    signal_landed(owner, staged_word(epoch, static_cast<uint32_t>(done)), stream);
  }
}

void IntranodeRuntime::wait_for_owner(const uint64_t* word, uint64_t target, int owner, int slot, cudaStream_t stream,
                                      intranode::WordWrite then_0, intranode::WordWrite then_1) {
  intranode::StagingWaitArgs wait{};
  wait.word = word;
  wait.target = target;
  wait.peer = owner;
  wait.slot = slot;
  wait.rank = rank_;
  wait.status = status_device_;
  wait.claim = &reinterpret_cast<intranode::Header*>(buffer_)->error_claim;
  wait.timeout_ns = timeout_ns_;
  wait.then_write[0] = then_0;
  wait.then_write[1] = then_1;
  intranode::launch_staging_wait(wait, stream);
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

void IntranodeRuntime::check_device_error() const {
  if (status_host_ != nullptr && status_host_->error_code != kErrNone)
    throw Error("ep_plugin: a kernel stopped on rank " + std::to_string(rank_) + ": " + describe_device_error());
}

NotifyResult IntranodeRuntime::wait_notify(int tag, int num_local_experts, cudaStream_t stream) {
  EP_HOST_ASSERT(tag > 0, "notify tags are positive");
  EP_CHECK_ARG(num_local_experts >= 0 && num_local_experts <= kMaxLocalExperts, "bad num_local_experts");
  // The device gives up after timeout_s; the host allows a little more so the device's report wins.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_ + 5.0);
  int spins = 0;
  while (status_host_->notify_tag != tag) {
    check_device_error();
    if (++spins % 1024 == 0) {
      const cudaError_t state = cudaStreamQuery(stream);
      if (state != cudaSuccess && state != cudaErrorNotReady) {
        check_device_error();
        throw Error(std::string("ep_plugin: dispatch failed on rank ") + std::to_string(rank_) + ": " +
                    cudaGetErrorName(state) + " (" + cudaGetErrorString(state) + ")");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        Text out;
        out << "rank " << rank_ << ": the notify step of dispatch did not finish within " << timeout_s_
            << " s (a peer never reached the same dispatch call?)";
        throw TimeoutError(out.str());
      }
      if (spins > (1 << 16)) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
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
  NotifyResult result;
  result.num_recv_tokens = status_host_->num_recv_tokens;
  result.num_recv_tokens_per_rank.resize(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) result.num_recv_tokens_per_rank[r] = status_host_->num_recv_tokens_per_rank[r];
  result.num_recv_tokens_per_expert.resize(num_local_experts);
  for (int e = 0; e < num_local_experts; ++e)
    result.num_recv_tokens_per_expert[e] = status_host_->num_recv_tokens_per_expert[e];
  return result;
}

}  // namespace ep_plugin
