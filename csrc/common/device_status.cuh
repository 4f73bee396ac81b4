// Device-side error reporting and timeouts.
//
// Every device spin-wait goes through `Deadline`: past the configured timeout it records rank,
// peer, channel and warp here and prints them. The intranode kernels then leave (`expired`): every
// other wait of this rank stops once the error is claimed, and the host raises from the record. The
// NVSHMEM kernels (low-latency, internode) trap instead (`check`), except low-latency waits in shrink
// mode, which mask the peer (`passed`, low_latency_layout.cuh): see docs/faults.md.
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

__device__ __noinline__ inline void report_timeout(DeviceStatus* status, int* claim, int op, int kind, int rank,
                                                   int peer, int channel, int warp, int64_t expected,
                                                   int64_t observed) {
  record_error(status, claim, kErrTimeout, op, kind, rank, peer, channel, warp, expected, observed);
  printf("ep_plugin: device timeout (op %d, wait %d): rank %d waited for peer %d, channel %d, warp %d "
         "(expected %lld, observed %lld)\n",
         op, kind, rank, peer, channel, warp, static_cast<long long>(expected), static_cast<long long>(observed));
}

// Whether a kernel of this rank has recorded an error (its claim word is set).
__device__ __forceinline__ bool error_claimed(const int* claim) {
  return *reinterpret_cast<const volatile int*>(claim) != 0;
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

// Spins between two reads of the claim word in `Deadline::expired`: a wait notices another wait's error
// within this many spins, and a wait that is answered soon reads no more than it did without the check.
constexpr uint32_t kSpinsPerClaimRead = 64;

// A spin-wait budget: call `expired` (or `check`) inside the loop, `restart` after progress.
class Deadline {
 public:
  __device__ __forceinline__ explicit Deadline(const WaitSite& site) : site_(&site), start_(global_timer_ns()) {}

  __device__ __forceinline__ void restart() { start_ = global_timer_ns(); }

  // Whether the wait must end without its signal: its timeout passed (recorded and printed here), or
  // another wait of this rank recorded an error. The caller then leaves with its outputs undefined.
  __device__ __forceinline__ bool expired(int kind, int peer, int64_t expected, int64_t observed) {
    if (++spins_ % kSpinsPerClaimRead == 0 && error_claimed(site_->claim)) return true;
    if (global_timer_ns() - start_ <= site_->timeout_ns) return false;
    report_timeout(site_->status, site_->claim, site_->op, kind, site_->rank, peer, site_->channel, site_->warp,
                   expected, observed);
    return true;
  }

  // Whether the timeout has passed (no report: the caller decides what follows).
  __device__ __forceinline__ bool passed() const { return global_timer_ns() - start_ > site_->timeout_ns; }

  // Past the timeout: records, prints and traps (the NVSHMEM kernels: their process cannot recover anyway).
  __device__ __forceinline__ void check(int kind, int peer, int64_t expected, int64_t observed) const {
    if (global_timer_ns() - start_ > site_->timeout_ns) {
      report_timeout(site_->status, site_->claim, site_->op, kind, site_->rank, peer, site_->channel, site_->warp,
                     expected, observed);
      asm volatile("trap;");
    }
  }

 private:
  const WaitSite* site_;
  uint64_t start_;
  uint32_t spins_ = 0;
};

}  // namespace ep_plugin
