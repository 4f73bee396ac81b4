// Per-phase timestamps of the low-latency kernels, compiled in only with -DEP_PLUGIN_PHASE_PROFILE
// (EP_PLUGIN_NVCC_FLAGS="-DEP_PLUGIN_PHASE_PROFILE" at build time): a diagnostic build, never the
// shipped one. Thread 0 of every block stamps %globaltimer at each mark; the last block of every
// 256th launch prints, per mark, the min / mean / max over blocks in us after the earliest start.
#pragma once

#include <cstdio>

#include "../common/ptx.cuh"
#include "low_latency_layout.cuh"

#ifdef EP_PLUGIN_PHASE_PROFILE
namespace ep_plugin::low_latency {
namespace {

constexpr int kProfiledBlocks = 1024;
constexpr int kMarks = 6;
constexpr uint32_t kReportEvery = 256;

__device__ uint64_t g_marks[kProfiledBlocks][kMarks];
__device__ uint32_t g_blocks_done;
__device__ uint32_t g_launches;

__device__ __forceinline__ void phase_mark(int mark) {
  if (threadIdx.x == 0 && blockIdx.x < kProfiledBlocks) g_marks[blockIdx.x][mark] = global_timer_ns();
}

// Called by every thread of every block at its very end (after its last mark). A launch of one phase
// only (a receive hook) is reported as kernel_send / kernel_recv.
__device__ void phase_report(const char* kernel, int phases, int rank, int num_tokens, const char* const* names) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(&g_blocks_done, 1u) != gridDim.x - 1) return;
  __threadfence();
  g_blocks_done = 0;
  const uint32_t launch = g_launches++;
  const int blocks = min(static_cast<int>(gridDim.x), kProfiledBlocks);
  const bool report = launch % kReportEvery == kReportEvery - 1;
  uint64_t start = ~0ull;
  for (int b = 0; b < blocks; ++b) start = min(start, g_marks[b][0]);
  for (int m = 0; m < kMarks && report; ++m) {
    if (names[m] == nullptr) break;
    uint64_t lo = ~0ull, hi = 0, sum = 0;
    int n = 0;
    for (int b = 0; b < blocks; ++b) {
      const uint64_t t = g_marks[b][m];
      if (t < start) continue;  // not stamped in this launch
      lo = min(lo, t - start), hi = max(hi, t - start), sum += t - start, ++n;
    }
    if (n > 0)
      printf("[phase] %s%s rank %d tokens %d launch %u start %llu: %-12s blocks %4d min %7.2f mean %7.2f max %7.2f us\n",
             kernel, phases == kPhaseSend ? "_send" : phases == kPhaseRecv ? "_recv" : "", rank, num_tokens, launch, static_cast<unsigned long long>(start), names[m], n, lo * 1e-3,
             static_cast<double>(sum) / n * 1e-3, hi * 1e-3);
  }
}

}  // namespace
}  // namespace ep_plugin::low_latency
#define EP_PHASE_MARK(mark) ::ep_plugin::low_latency::phase_mark(mark)
#define EP_PHASE_SYNC() __syncthreads()
#else
#define EP_PHASE_MARK(mark) ((void)0)
#define EP_PHASE_SYNC() ((void)0)
#endif
