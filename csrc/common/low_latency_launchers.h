// How ep_plugin._C_torch launches the low-latency kernels of ep_plugin._C_nvshmem in the same binding
// call that allocates their outputs (the eager low-latency fast path, ep_plugin/backends/low_latency.py).
//
// The two modules do not link each other: _C_nvshmem hands out a table of plain functions in a
// PyCapsule named kLowLatencyLaunchersName, and _C_torch calls through it with the per-call device
// addresses. The runtime and the Args template cross as Python objects (void*: this header needs no
// Python or CUDA header) that only _C_nvshmem looks into. A launcher that returns false launched
// nothing: the checked Python path then runs the call again and reports what stopped it.
#pragma once

#include <cstdint>

namespace ep_plugin::low_latency {

constexpr const char* kLowLatencyLaunchersName = "ep_plugin._C_nvshmem.low_latency_launchers";

// A dispatch's per-call addresses (the rest comes from the template DispatchArgs).
struct DispatchCall {
  const void* x;
  const int64_t* topk_idx;
  int num_tokens;
  void* recv_x;
  void* recv_scales;
  int32_t* recv_count;
  int32_t* recv_src_info;
  int64_t* recv_layout;
  int32_t* cumulative_stats;
};

// A combine's per-call addresses (the rest comes from the template CombineArgs).
struct CombineCall {
  const void* x;
  const int32_t* recv_src_info;
  const int64_t* recv_layout;
  const int64_t* topk_idx;
  const float* topk_weights;
  void* out;
  int num_tokens;
};

// Send and receive of one call in one launch on `stream`; true if launched. `runtime`: a
// LowLatencyRuntime, `args`: a DispatchArgs / CombineArgs (both Python objects of _C_nvshmem).
struct LowLatencyLaunchers {
  bool (*dispatch)(void* runtime, void* args, const DispatchCall& call, int parity, uintptr_t stream) noexcept;
  bool (*combine)(void* runtime, void* args, const CombineCall& call, int parity, uintptr_t stream) noexcept;
};

}  // namespace ep_plugin::low_latency
