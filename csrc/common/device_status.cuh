// Device-side error reporting and timeouts.
//
// Every device spin-wait goes through `Deadline`: past the configured timeout it records rank,
// peer, channel and warp here, prints them, and traps. The host reads the record to raise a Python
// error that names the same facts instead of hanging.
#pragma once

#include <cstdint>
#include <cstdio>

#include "ptx.cuh"
#include "status.h"

namespace ep_plugin {

// Records the first error of this rank (claim word in device memory; the record in host memory).
__device__ __noinline__ inline void record_error(DeviceStatus* status, int* claim, int code, int op, int kind,
                                                 int rank, int peer, int channel, int warp, int64_t expected,
                                                 int64_t observed) {
  if (atomicCAS(claim, 0, 1) == 0) {
    status->error_op = op;
    status->error_wait_kind = kind;
    status->error_rank = rank;
    status->error_peer = peer;
    status->error_channel = channel;
    status->error_warp = warp;
    status->error_expected = expected;
    status->error_observed = observed;
    __threadfence_system();
    status->error_code = code;
    __threadfence_system();
  }
}

__device__ __noinline__ inline void trap_timeout(DeviceStatus* status, int* claim, int op, int kind, int rank,
                                                 int peer, int channel, int warp, int64_t expected,
                                                 int64_t observed) {
  record_error(status, claim, kErrTimeout, op, kind, rank, peer, channel, warp, expected, observed);
  printf("ep_plugin: device timeout (op %d, wait %d): rank %d waited for peer %d, channel %d, warp %d "
         "(expected %lld, observed %lld)\n",
         op, kind, rank, peer, channel, warp, static_cast<long long>(expected), static_cast<long long>(observed));
  asm volatile("trap;");
}

// Where a wait happens, for the report.
struct WaitSite {
  DeviceStatus* status;
  int* claim;
  uint64_t timeout_ns;
  int op;
  int rank;
  int channel;
  int warp;
};

// A spin-wait budget: call `check` inside the loop, `restart` after progress.
class Deadline {
 public:
  __device__ __forceinline__ explicit Deadline(const WaitSite& site) : site_(&site), start_(global_timer_ns()) {}

  __device__ __forceinline__ void restart() { start_ = global_timer_ns(); }

  __device__ __forceinline__ void check(int kind, int peer, int64_t expected, int64_t observed) const {
    if (global_timer_ns() - start_ > site_->timeout_ns)
      trap_timeout(site_->status, site_->claim, site_->op, kind, site_->rank, peer, site_->channel, site_->warp,
                   expected, observed);
  }

 private:
  const WaitSite* site_;
  uint64_t start_;
};

}  // namespace ep_plugin
