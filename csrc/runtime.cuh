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

namespace ep_plugin {

struct NotifyResult {
  int num_recv_tokens;
  std::vector<int> num_recv_tokens_per_expert;
};

class IntranodeRuntime {
 public:
  IntranodeRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s);
  ~IntranodeRuntime();
  IntranodeRuntime(const IntranodeRuntime&) = delete;
  IntranodeRuntime& operator=(const IntranodeRuntime&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  int64_t num_nvl_bytes() const { return num_nvl_bytes_; }

  // CUDA IPC handle of this rank's buffer (bytes to exchange over the process group).
  std::string ipc_handle() const;
  // Maps every peer's buffer (handles ordered by rank; this rank's own entry is ignored).
  void connect(const std::vector<std::string>& handles);
  // Unmaps peers and frees the buffer; the runtime is unusable afterwards.
  void destroy();

  // Fills the runtime-owned fields (buffers, rank, status, timeout) and launches.
  void notify(intranode::NotifyArgs args, cudaStream_t stream);
  void dispatch(intranode::DispatchArgs args, cudaStream_t stream);
  void combine(intranode::CombineArgs args, cudaStream_t stream);

  // Host wait for the notify published with `tag`; raises on bad input, device errors and timeout.
  NotifyResult wait_notify(int tag, int num_local_experts, cudaStream_t stream);
  // Throws if a kernel of this rank recorded an error (timeout, bad input seen on the device).
  void check_device_error() const;

 private:
  void require_connected() const;
  void require_buffer_fits(int64_t needed, const char* op) const;
  std::string describe_device_error() const;
  // Prints a device error report to stderr as soon as a kernel records one, wherever the CUDA
  // error later surfaces in the user's program.
  void watch_for_device_errors();

  int rank_, num_ranks_, device_;
  int64_t num_nvl_bytes_;
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
