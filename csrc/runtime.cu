#include "runtime.cuh"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

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
    default: return "a signal";
  }
}

}  // namespace

IntranodeRuntime::IntranodeRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s)
    : rank_(rank), num_ranks_(num_ranks), num_nvl_bytes_(num_nvl_bytes), timeout_s_(timeout_s) {
  EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxNvlPeers,
               "the intranode runtime supports 1 to " << kMaxNvlPeers << " ranks, got " << num_ranks);
  EP_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank " << rank << " out of range for " << num_ranks << " ranks");
  EP_CHECK_ARG(num_nvl_bytes >= intranode::kHeaderBytes,
               "num_nvl_bytes must be at least " << intranode::kHeaderBytes << " (got " << num_nvl_bytes
                                                 << "); see Config.get_nvl_buffer_size_hint");
  EP_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
  timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  CUDA_CHECK(cudaGetDevice(&device_));
  CUDA_CHECK(cudaMalloc(&buffer_, num_nvl_bytes));
  // NOTE: counters are epoch-tagged and never reset later; they must start at zero on every rank
  // before any peer can write them (the caller barriers after this constructor).
  CUDA_CHECK(cudaMemset(buffer_, 0, intranode::kHeaderBytes));
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(DeviceStatus), cudaHostAllocMapped));
  std::memset(const_cast<DeviceStatus*>(status_host_), 0, sizeof(DeviceStatus));
  status_host_->bad_input_rank = -1;
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_host_, 0));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&peer_buffers_device_), sizeof(void*) * kMaxNvlPeers));
  CUDA_CHECK(cudaDeviceSynchronize());
  watchdog_ = std::thread([this] { watch_for_device_errors(); });
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

void IntranodeRuntime::dispatch(intranode::DispatchArgs args, cudaStream_t stream) {
  require_connected();
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = num_ranks_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  const intranode::RingLayout layout{num_ranks_, args.num_channels,
                                     intranode::slots_per_sub_ring(args.recv_tokens_per_channel),
                                     intranode::slot_bytes_for(args.row_bytes + 4LL * args.num_scales)};
  require_buffer_fits(layout.total_bytes(), "dispatch");
  intranode::launch_dispatch(args, stream);
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
  if (bad_rank >= 0) {
    Text out;
    out << "rank " << bad_rank << ": topk_idx[" << status_host_->bad_input_detail[0] << ", "
        << status_host_->bad_input_detail[1] << "] = " << status_host_->bad_input_detail[2]
        << " is not an expert id (expected -1 or a value in [0, num_experts)); no data was sent";
    throw InvalidArgument(out.str());
  }
  NotifyResult result;
  result.num_recv_tokens = status_host_->num_recv_tokens;
  result.num_recv_tokens_per_expert.resize(num_local_experts);
  for (int e = 0; e < num_local_experts; ++e)
    result.num_recv_tokens_per_expert[e] = status_host_->num_recv_tokens_per_expert[e];
  return result;
}

}  // namespace ep_plugin
