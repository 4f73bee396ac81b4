// Where the intranode dispatch's warps spend their time, compiled in only with
// -DEP_PLUGIN_PHASE_PROFILE (a diagnostic build, never the shipped one; see phase_profile.cuh for the
// low-latency kernels). Each warp sums the SM cycles of its phases; the last block of every 16th
// launch prints, for sender and receiver warps apart, each phase's mean and max over warps in
// thousands of cycles, beside the kernel's wall time.
#pragma once

#include <cstdio>

#include "../common/ptx.cuh"
#include "buffer_layout.cuh"

namespace ep_plugin::intranode {

// Sender phases: waiting for ring space, copying rows (and metadata), publishing tails, draining.
// Receiver phases: polls that found nothing, copying slots, publishing heads.
constexpr int kNumWarpPhases = 4;

#ifdef EP_PLUGIN_PHASE_PROFILE
namespace profile {

struct WarpRecord {
  unsigned long long cycles[kNumWarpPhases];
  unsigned long long total_cycles;
  unsigned int items;
};

__device__ WarpRecord g_warps[2 * kMaxChannels][kWarpsPerChannel];
__device__ unsigned long long g_first_start = ~0ull, g_last_end = 0;
__device__ unsigned int g_blocks_done, g_launches;

}  // namespace profile

class WarpPhases {
 public:
  __device__ WarpPhases() { start_ = clock64(); }
  __device__ void begin() { mark_ = clock64(); }
  __device__ void end(int phase) { cycles_[phase] += clock64() - mark_; }
  __device__ void item() { ++items_; }
  // Every lane calls it once, at the warp's end.
  __device__ void store() {
    if (lane_id() != 0) return;
    profile::WarpRecord& r = profile::g_warps[blockIdx.x][threadIdx.x >> 5];
    for (int p = 0; p < kNumWarpPhases; ++p) r.cycles[p] = cycles_[p];
    r.total_cycles = clock64() - start_;
    r.items = items_;
  }

 private:
  long long start_ = 0, mark_ = 0;
  long long cycles_[kNumWarpPhases] = {};
  unsigned int items_ = 0;
};

// Every thread of every block calls it at the kernel's very end.
__device__ inline void report_warp_phases(int rank, const char* const (&sender_phases)[kNumWarpPhases],
                                          const char* const (&receiver_phases)[kNumWarpPhases], uint64_t start_ns) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  atomicMin(&profile::g_first_start, static_cast<unsigned long long>(start_ns));
  atomicMax(&profile::g_last_end, static_cast<unsigned long long>(global_timer_ns()));
  __threadfence();
  if (atomicAdd(&profile::g_blocks_done, 1u) != gridDim.x - 1) return;
  __threadfence();
  profile::g_blocks_done = 0;
  const unsigned int launch = profile::g_launches++;
  const double wall_us = (profile::g_last_end - profile::g_first_start) * 1e-3;
  profile::g_first_start = ~0ull;
  profile::g_last_end = 0;
  if (launch % 16 != 15) return;
  for (int role = 0; role < 2; ++role) {
    const char* const* names = role == 0 ? sender_phases : receiver_phases;
    double sum[kNumWarpPhases + 1] = {}, max[kNumWarpPhases + 1] = {};
    double items = 0;
    int warps = 0;
    for (int b = role; b < static_cast<int>(gridDim.x); b += 2) {
      for (int w = 0; w < kWarpsPerChannel; ++w) {
        const profile::WarpRecord& r = profile::g_warps[b][w];
        for (int p = 0; p <= kNumWarpPhases; ++p) {
          const double k = (p == kNumWarpPhases ? r.total_cycles : r.cycles[p]) * 1e-3;
          sum[p] += k;
          max[p] = k > max[p] ? k : max[p];
        }
        items += r.items;
        ++warps;
      }
    }
    printf("[phase] intranode dispatch rank %d launch %u wall %.1f us %s warps %d, items/warp %.1f, kcycles mean/max:"
           " total %.1f/%.1f",
           rank, launch, wall_us, role == 0 ? "sender" : "receiver", warps, items / warps, sum[kNumWarpPhases] / warps,
           max[kNumWarpPhases]);
    for (int p = 0; p < kNumWarpPhases; ++p)
      if (names[p] != nullptr) printf(", %s %.1f/%.1f", names[p], sum[p] / warps, max[p]);
    printf("\n");
  }
}

#else

class WarpPhases {
 public:
  __device__ void begin() {}
  __device__ void end(int) {}
  __device__ void item() {}
  __device__ void store() {}
};

#endif


// The direct dispatch (intranode_direct_dispatch.cu), same diagnostic build: every block stamps
// %globaltimer at its start, once the outputs are exchanged, once its rows are written and at its end;
// warps add the cycles they spent in each DirectCycles part. The last block of every 8th launch
// prints each mark's min / mean / max over blocks (us after the first block's start) and each part's
// mean per warp (thousands of cycles).
enum DirectMark { kMarkStart, kMarkExchanged, kMarkRowsWritten, kMarkEnd, kNumDirectMarks };
enum DirectCycles {
  kCyclesSender,          // the whole sender loop, from its first token to its stores' completion
  kCyclesLoadWait,        // waiting for the bulk loads of pieces (lane 0)
  kCyclesOwnStoreWait,    // the lane that stores this rank's rows, waiting for its stores' reads
  kCyclesPeerStoreWait,   // the lane that stores the next rank's rows, the same
  kCyclesMetadata,        // scales, top-k and source-index stores
  kCyclesDrain,           // waiting for the last stores' completion
  kNumDirectCycles
};

#ifdef EP_PLUGIN_PHASE_PROFILE
namespace {
namespace direct_profile {
__device__ unsigned long long g_marks[2 * kMaxChannels][kNumDirectMarks];
__device__ unsigned long long g_cycles[kNumDirectCycles];
__device__ unsigned int g_blocks_done, g_launches;
}  // namespace direct_profile

__device__ inline void direct_mark(DirectMark mark) {
  if (threadIdx.x == 0) direct_profile::g_marks[blockIdx.x][mark] = global_timer_ns();
}

// The mark once every warp of the block has reached it.
__device__ inline void direct_mark_block(DirectMark mark) {
  __syncthreads();
  direct_mark(mark);
}

// Called by the lane whose cycles these are.
__device__ inline void direct_add_cycles(DirectCycles part, long long cycles) {
  atomicAdd(&direct_profile::g_cycles[part], static_cast<unsigned long long>(cycles));
}

// Every thread of every block calls it at the kernel's very end.
__device__ inline void report_direct_phases(int rank, int num_tokens, int row_bytes, bool cached) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  direct_mark(kMarkEnd);
  __threadfence();
  if (atomicAdd(&direct_profile::g_blocks_done, 1u) != gridDim.x - 1) return;
  __threadfence();
  direct_profile::g_blocks_done = 0;
  const unsigned int launch = direct_profile::g_launches++;
  const int blocks = gridDim.x;
  if (launch % 8 == 7) {
    unsigned long long start = ~0ull;
    for (int b = 0; b < blocks; ++b) start = min(start, direct_profile::g_marks[b][kMarkStart]);
    printf("[phase] direct %s rank %d launch %u blocks %d tokens %d row_bytes %d (us after the first start, "
           "min/mean/max over blocks):",
           cached ? "cached_dispatch" : "dispatch", rank, launch, blocks, num_tokens, row_bytes);
    const char* const mark_names[kNumDirectMarks] = {"start", "exchanged", "rows_written", "end"};
    for (int m = 0; m < kNumDirectMarks; ++m) {
      double lo = 1e30, hi = 0, sum = 0;
      for (int b = 0; b < blocks; ++b) {
        const double t = (direct_profile::g_marks[b][m] - start) * 1e-3;
        lo = t < lo ? t : lo, hi = t > hi ? t : hi, sum += t;
      }
      printf(" %s %.1f/%.1f/%.1f", mark_names[m], lo, sum / blocks, hi);
    }
    const char* const cycle_names[kNumDirectCycles] = {"sender", "load_wait", "own_store_wait", "peer_store_wait",
                                                       "metadata", "drain"};
    const double warps = static_cast<double>(blocks) * (blockDim.x / 32);
    printf("; kcycles per warp:");
    for (int p = 0; p < kNumDirectCycles; ++p) printf(" %s %.1f", cycle_names[p], direct_profile::g_cycles[p] / warps * 1e-3);
    printf("\n");
  }
  for (int p = 0; p < kNumDirectCycles; ++p) direct_profile::g_cycles[p] = 0;
}
}  // namespace
#else
__device__ inline void direct_mark(DirectMark) {}
__device__ inline void direct_mark_block(DirectMark) {}
__device__ inline void report_direct_phases(int, int, int, bool) {}
#endif

// A direct-dispatch sender warp's cycles by DirectCycles part; every call is a no-op outside the
// diagnostic build. begin() marks the start of a metadata or drain part, which the next end_* closes.
class DirectSenderCycles {
 public:
#ifdef EP_PLUGIN_PHASE_PROFILE
  __device__ DirectSenderCycles() { start_ = clock64(); }
  __device__ void begin() { mark_ = clock64(); }
  __device__ void end_metadata() { metadata_ += clock64() - mark_; }
  // At the sender's end, after the drain: lane 0 adds the warp's parts, and on the bulk path the lanes
  // of this rank's and the next rank's stores add their waits.
  template <bool kBulk, typename Rows>
  __device__ void end_sender(const Rows& rows, int rank, int num_ranks) {
    const long long end = clock64();
    const int lane = lane_id();
    if (lane == 0) {
      direct_add_cycles(kCyclesSender, end - start_);
      direct_add_cycles(kCyclesMetadata, metadata_);
      direct_add_cycles(kCyclesDrain, end - mark_);
    }
    if constexpr (kBulk) {
      if (lane == 0) direct_add_cycles(kCyclesLoadWait, rows.rows.load_wait_cycles);
      if (lane == rank) direct_add_cycles(kCyclesOwnStoreWait, rows.rows.store_wait_cycles);
      if (lane == (rank + 1) % num_ranks) direct_add_cycles(kCyclesPeerStoreWait, rows.rows.store_wait_cycles);
    }
  }

 private:
  long long start_ = 0, mark_ = 0, metadata_ = 0;
#else
  __device__ void begin() {}
  __device__ void end_metadata() {}
  template <bool kBulk, typename Rows>
  __device__ void end_sender(const Rows&, int, int) {}
#endif
};

}  // namespace ep_plugin::intranode
