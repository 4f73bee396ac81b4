// What a peer write plus its "published" signal costs over NVLink, from every warp of the GPU at
// once: the pattern of the low-latency combine's send (each warp stores a piece into the peer, then
// signals it). Both GPUs write into each other at the same time, as two ranks do.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a benchmarks/p2p_publish_bench.cu -o /tmp/p2p_publish
//   /tmp/p2p_publish            (needs 2 GPUs with peer access)
//
// Modes (how each warp signals after its stores):
//   none            no signal: the stores alone
//   warp_release    red.release.sys per warp (what publish_direct does)
//   warp_relaxed    red.relaxed.sys per warp: no ordering, shows what the release itself costs
//   block_release   the block's warps store, one barrier, then one fence.sys by one thread and a
//                   relaxed red per warp's word (the release paid once per block)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t e = (call);                                                           \
    if (e != cudaSuccess) {                                                           \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

enum Mode { kNone, kWarpRelease, kWarpRelaxed, kBlockRelease, kNumModes };
const char* kModeNames[] = {"none", "warp_release", "warp_relaxed", "block_release"};

constexpr int kThreads = 512, kWarps = kThreads / 32, kUnroll = 8;

__device__ __forceinline__ int4 ld_nc(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_na(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    publish_kernel(int4* dst, const int4* src, int64_t units_per_warp, uint64_t* words, int mode) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t global_warp = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int4* in = src + global_warp * units_per_warp;
  int4* out = dst + global_warp * units_per_warp;
  for (int64_t base = 0; base < units_per_warp; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 32 + lane < units_per_warp) v[u] = ld_nc(in + base + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 32 + lane < units_per_warp) st_na(out + base + u * 32 + lane, v[u]);
  }
  uint64_t* word = words + global_warp;
  if (mode == kWarpRelease || mode == kWarpRelaxed) {
    __syncwarp();
    if (lane == 0) {
      if (mode == kWarpRelease)
        asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(word) : "memory");
      else
        asm volatile("red.relaxed.sys.global.add.u64 [%0], 1;" ::"l"(word) : "memory");
    }
  } else if (mode == kBlockRelease) {
    __syncthreads();
    if (warp == 0) {
      if (lane == 0) asm volatile("fence.acq_rel.sys;" ::: "memory");
      __syncwarp();
      if (lane < kWarps)
        asm volatile("red.relaxed.sys.global.add.u64 [%0], 1;" ::"l"(words + static_cast<int64_t>(blockIdx.x) * kWarps + lane)
                     : "memory");
    }
  }
}

int main() {
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::printf("needs 2 GPUs\n");
    return 2;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t kMaxBytes = 16ll << 20, kFlushBytes = 256ll << 20;
  void *src[2], *dst[2], *flush[2];
  uint64_t* words[2];
  cudaStream_t stream[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaMalloc(&src[d], kMaxBytes));
    CHECK(cudaMalloc(&dst[d], kMaxBytes));
    CHECK(cudaMalloc(&flush[d], kFlushBytes));
    CHECK(cudaMalloc(&words[d], sms * kWarps * 8));
    CHECK(cudaMemset(src[d], 1, kMaxBytes));
    CHECK(cudaStreamCreateWithFlags(&stream[d], cudaStreamNonBlocking));
  }
  std::printf("%d SMs x %d warps per GPU; both GPUs write into each other at once; L2 flushed before each run\n",
              sms, kWarps);
  std::printf("%-14s %-7s %10s %12s %12s %10s\n", "mode", "target", "MB/GPU", "median us", "p90 us", "GB/s");
  const int kReps = 30;
  for (int64_t total : {3670016ll, 7340032ll}) {  // 3.5 MiB (fp32 partials), 7 MiB (bf16 rows) per GPU
    const int64_t units_per_warp = total / 16 / (static_cast<int64_t>(sms) * kWarps);
    for (int remote = 1; remote >= 0; --remote) {
      for (int mode = 0; mode < kNumModes; ++mode) {
        std::vector<float> times[2];
        for (int rep = 0; rep < kReps; ++rep) {
          cudaEvent_t start[2], stop[2];
          for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            CHECK(cudaEventCreate(&start[d]));
            CHECK(cudaEventCreate(&stop[d]));
            CHECK(cudaMemsetAsync(flush[d], rep, kFlushBytes, stream[d]));
            CHECK(cudaStreamSynchronize(stream[d]));
          }
          for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            int4* target = static_cast<int4*>(remote ? dst[1 - d] : dst[d]);
            uint64_t* word = remote ? words[1 - d] : words[d];
            CHECK(cudaEventRecord(start[d], stream[d]));
            publish_kernel<<<sms, kThreads, 0, stream[d]>>>(target, static_cast<const int4*>(src[d]), units_per_warp,
                                                           word, mode);
            CHECK(cudaEventRecord(stop[d], stream[d]));
          }
          for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            CHECK(cudaEventSynchronize(stop[d]));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, start[d], stop[d]));
            if (rep > 2) times[d].push_back(ms * 1e3f);
            CHECK(cudaEventDestroy(start[d]));
            CHECK(cudaEventDestroy(stop[d]));
          }
        }
        for (int d = 0; d < 1; ++d) {
          std::sort(times[d].begin(), times[d].end());
          const float median = times[d][times[d].size() / 2], p90 = times[d][times[d].size() * 9 / 10];
          const double bytes = 16.0 * units_per_warp * sms * kWarps;
          std::printf("%-14s %-7s %10.2f %12.1f %12.1f %10.1f\n", kModeNames[mode], remote ? "peer" : "local",
                      bytes / 1e6, median, p90, bytes / (median * 1e3));
        }
      }
    }
  }
  return 0;
}
