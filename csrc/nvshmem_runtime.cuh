// LowLatencyRuntime: this PE's NVSHMEM state and symmetric buffer, and the host side of the
// low-latency kernels. Host-safe header (no NVSHMEM or device code): the binding includes it.
//
// NVSHMEM is process-wide: it is initialised by the first runtime of a process (unique id from the
// group's rank 0, every rank a PE, the CUDA device already set) and finalised when the last one is
// destroyed collectively. A later runtime must use the same rank and PE count: NVSHMEM keeps its
// first bootstrap for the life of the process.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "kernels/internode_layout.cuh"
#include "kernels/low_latency_layout.cuh"

namespace ep_plugin {

// This PE's symmetric buffer (the first `header_bytes` zero on every PE when `open` returns) and the
// mapped host record its kernels report errors into. Shared by both runtimes below.
struct SymmetricBuffer {
  void* buffer = nullptr;
  DeviceStatus* status_host = nullptr;
  DeviceStatus* status_device = nullptr;

  // Collective: NVSHMEM acquired for this process (initialised if no runtime holds it), `bytes`
  // allocated on every PE, headers zeroed everywhere. `who` names the Buffer kind in errors.
  void open(int rank, int num_ranks, int64_t bytes, int64_t header_bytes, const std::string& unique_id,
            const char* who);
  // Collective: free the buffer and release NVSHMEM (the last holder finalises it). Not collective
  // (from a destructor): only local resources; the symmetric memory stays allocated.
  void close(bool collective);
  bool is_open() const { return status_host != nullptr && buffer != nullptr; }
  // Whether each PE is reached with direct stores (NVLink / same GPU) rather than the network.
  std::vector<bool> direct_peers(int num_ranks) const;
};

class LowLatencyRuntime {
 public:
  // A fresh NVSHMEM unique id (bytes), to be created on rank 0 and sent to every rank.
  static std::string create_unique_id();

  // Collective over the group's ranks: initialises NVSHMEM if needed, allocates `num_rdma_bytes`
  // of symmetric memory and zeroes its signal header.
  LowLatencyRuntime(int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s, const std::string& unique_id);
  ~LowLatencyRuntime();
  LowLatencyRuntime(const LowLatencyRuntime&) = delete;
  LowLatencyRuntime& operator=(const LowLatencyRuntime&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int num_blocks() const { return num_blocks_; }
  int64_t num_rdma_bytes() const { return num_rdma_bytes_; }
  // Whether each PE is reached with direct stores (NVLink / same GPU) rather than the network.
  std::vector<bool> direct_peers() const;

  // Fill the runtime-owned fields of the Args for round `parity` and launch. A dispatch's send first
  // raises (ValueError) an expert id out of range that an earlier dispatch recorded, launching nothing.
  void dispatch(low_latency::DispatchArgs args, int parity, cudaStream_t stream);
  void combine(low_latency::CombineArgs args, int parity, cudaStream_t stream);
  // Whether a dispatch of these sizes may carry topk_weights for expert-side sums: every peer is
  // reachable by NVLink and the layout admits them (low_latency_layout.cuh).
  bool supports_expert_sums(int num_max_tokens, int hidden, int num_experts) const;

  // Address of round `parity`'s dispatch_recv area: the [E_local, R * T_max, H] bf16 tensor that
  // low_latency_combine(zero_copy=True) sends from.
  uintptr_t combine_buffer_address(int parity, const low_latency::LowLatencyLayout& layout) const;

  // Zero every signal word and the round state on this PE (the caller synchronises the group
  // before and after).
  void clean(cudaStream_t stream);

  // Collective: free the symmetric buffer (and finalise NVSHMEM with the last runtime). Not
  // collective (from a destructor): only local resources; the symmetric memory stays allocated.
  void destroy(bool collective);

  void check_device_error() const;
  // Whether a call would launch with nothing to report first: the buffer is open, no kernel stopped
  // and no dispatch recorded a bad expert id (the unchecked path then launches; else the checked one runs).
  bool nothing_to_report() const;

 private:
  void require_alive() const;
  // Throws InvalidArgument naming the bad topk_idx entry a dispatch kernel recorded (rank, token, k,
  // value) and clears the record; nothing if none.
  void raise_bad_input();
  void check_layout(const low_latency::LowLatencyLayout& layout, const char* op) const;
  // The layout admits expert-side sums and nvshmem_ptr reaches every PE.
  bool expert_sums_allowed(const low_latency::LowLatencyLayout& layout) const;
  std::string describe_device_error() const;
  void watch_for_device_errors();

  int rank_, num_ranks_, device_ = 0, num_blocks_ = 0;
  int64_t num_rdma_bytes_;
  double timeout_s_;
  uint64_t timeout_ns_;
  SymmetricBuffer memory_;
  bool every_peer_direct_ = false;  // nvshmem_ptr reaches every PE (set once the buffer is open)
  std::atomic<bool> stop_watchdog_{false};
  std::thread watchdog_;
};

// InternodeRuntime: this PE's symmetric buffer for the network leg of internode normal mode, and
// the host side of its kernels (csrc/kernels/internode_*.cu). Shares the process's NVSHMEM with
// LowLatencyRuntime (same initialisation path and PE numbering: PE = rank of the group).
class InternodeRuntime {
 public:
  // Collective over the group's ranks: initialises NVSHMEM if needed, allocates `num_rdma_bytes`
  // of symmetric memory and zeroes its header. `force_puts`: the network leg stages and puts even to
  // peers NVLink reaches, so that an NVLink-only machine runs the RDMA code path (network.force_puts).
  InternodeRuntime(int rank, int num_ranks, int ranks_per_node, int64_t num_rdma_bytes, double timeout_s,
                   const std::string& unique_id, bool force_puts = false);
  ~InternodeRuntime();
  InternodeRuntime(const InternodeRuntime&) = delete;
  InternodeRuntime& operator=(const InternodeRuntime&) = delete;

  int rank() const { return place_.rank; }
  int num_nodes() const { return place_.num_nodes; }
  int64_t num_rdma_bytes() const { return num_rdma_bytes_; }
  std::vector<bool> direct_peers() const;
  // Whether the network leg stages and puts even to peers NVLink reaches (network.force_puts).
  bool puts_only() const { return puts_only_; }

  // Fill the runtime-owned fields of the Args and launch. `notify` resets the host-visible result
  // first; `wait_notify` returns the rows received over the network (non-graph dispatch).
  void notify(internode::NotifyArgs args, cudaStream_t stream);
  int wait_notify(int tag, cudaStream_t stream);
  void dispatch(internode::DispatchArgs args, cudaStream_t stream);
  void combine(internode::CombineArgs args, cudaStream_t stream);
  // A barrier of every PE on `stream` (all earlier kernels of every PE have finished after it).
  void barrier(cudaStream_t stream);

  void destroy(bool collective);
  void check_device_error() const;

 private:
  void require_alive() const;
  internode::Common common(int kind) const;
  // Throws unless `num_blocks` divides the layout's channels and `send_chunk` is positive.
  void check_ring_use(const internode::InternodeLayout& layout, int num_blocks, int send_chunk) const;
  void check_layout(const internode::InternodeLayout& layout, const char* op) const;
  std::string describe_device_error() const;

  internode::Place place_{};
  bool puts_only_;  // network.force_puts
  int num_ranks_;
  int64_t num_rdma_bytes_;
  double timeout_s_;
  uint64_t timeout_ns_;
  SymmetricBuffer memory_;
};

}  // namespace ep_plugin
