// A combine's bytes pulled by their owner instead of pushed by their senders: each GPU reads its peers'
// rows for it over NVLink and sums them with its own copy, against the same bytes stored into the owners
// by SMs (the direct dispatch's way) and against a copy engine copying them within the GPU (what a pull
// combine would do first: user memory is not mapped into the peers).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I csrc -o /tmp/pull_rate benchmarks/probes/pull_rate.cu && /tmp/pull_rate [2|4]
//
// EP4's bytes (4096 x 7168 bf16, top-8 of 256): 3 blocks of 3701 rows of 14336 B per GPU, 159.2 MB, each
// block for one other GPU (at 2 GPUs all three for the one peer). Every GPU runs each case at once; prints
// the median of 10 rounds of the slowest GPU and the bytes from peers per second.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/bf16.cuh"
#include "probe_util.cuh"

namespace {

constexpr int kRowBytes = 14336;
constexpr int kUnits = kRowBytes / 16;
constexpr int kRows = 3701;  // rows per (sender, owner) block
constexpr int kBlocks = 3;   // blocks a GPU sends, and pulls
constexpr int kThreads = 512;
constexpr size_t kBlockBytes = static_cast<size_t>(kRows) * kRowBytes;

struct Gpu {
  int id;
  char* rows;   // [kBlocks][kRows]: this GPU's rows for the other GPUs
  char* own;    // [kRows]: its own copies
  char* out;    // [kRows]: the sums
  char* inbox;  // [kBlocks][kRows]: where pushed rows land
  char* local;  // [kBlocks][kRows]: the copy engine's destination
  cudaStream_t main, copy;
  cudaEvent_t start, end;
};

int num_gpus = 4;
std::vector<Gpu> gpus;

// Sender and block of the k-th row stream that GPU `owner` pulls (k < kBlocks).
int sender_of(int owner, int k) { return num_gpus == 2 ? 1 - owner : (owner + 1 + k) % num_gpus; }
int block_for(int owner, int sender, int k) {
  return num_gpus == 2 ? k : ((owner - sender - 1) % num_gpus + num_gpus) % num_gpus;
}

struct Sources {
  const int4* block[kBlocks];
};

Sources sources_of(int owner) {
  Sources s;
  for (int k = 0; k < kBlocks; ++k) {
    const int sender = sender_of(owner, k);
    s.block[k] = reinterpret_cast<const int4*>(gpus[sender].rows + block_for(owner, sender, k) * kBlockBytes);
  }
  return s;
}

// A warp per row: a lane loads kUnroll units of each peer's copy and of the own copy, then sums and stores.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads, 1) pull_by_loads(Sources s, const int4* own, int4* out) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < kRows; t += warps) {
    const size_t first = static_cast<size_t>(t) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * kUnroll) {
      int4 v[kBlocks + 1][kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
#pragma unroll
        for (int k = 0; k < kBlocks; ++k) v[k][u] = __ldcg(s.block[k] + first + i);
        v[kBlocks][u] = __ldg(own + first + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int k = 0; k <= kBlocks; ++k) ep_plugin::add_bf16x8(acc, v[k][u]);
        out[first + i] = ep_plugin::to_bf16x8(acc);
      }
    }
  }
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void wait_phase(uint32_t barrier, uint32_t phase) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(barrier), "r"(phase) : "memory");
}

// Bulk (TMA) loads: lane 0 of each warp loads the peers' copies of a kPiece-byte piece of its row into
// shared memory, kStages pieces ahead; the warp sums each piece with the own copy's units and stores.
template <int kPiece, int kStages>
__global__ void __launch_bounds__(kThreads, 1) pull_by_bulk_loads(Sources s, const int4* own, int4* out) {
  static_assert(kRowBytes % kPiece == 0 && kPiece % 512 == 0, "a piece is whole units of every lane");
  constexpr int kPieces = kRowBytes / kPiece;
  constexpr int kLaneUnits = kPiece / 16 / 32;
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t barriers[kThreads / 32][kStages];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  char* stages = smem + warp * kStages * kBlocks * kPiece;
  if (lane == 0)
    for (int st = 0; st < kStages; ++st)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&barriers[warp][st])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  const int warps = gridDim.x * (blockDim.x >> 5);
  const int first_row = blockIdx.x * (blockDim.x >> 5) + warp;
  const int jobs = first_row < kRows ? ((kRows - 1 - first_row) / warps + 1) * kPieces : 0;
  auto offset_of = [&](int job) {
    return static_cast<size_t>(first_row + (job / kPieces) * warps) * kRowBytes + (job % kPieces) * kPiece;
  };
  auto issue = [&](int job) {
    const uint32_t barrier = smem_address(&barriers[warp][job % kStages]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(kBlocks * kPiece)
                 : "memory");
    for (int k = 0; k < kBlocks; ++k)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem_address(stages + ((job % kStages) * kBlocks + k) * kPiece)),
                   "l"(reinterpret_cast<const char*>(s.block[k]) + offset_of(job)), "r"(kPiece), "r"(barrier)
                   : "memory");
  };
  if (lane == 0)
    for (int job = 0; job < kStages && job < jobs; ++job) issue(job);
  for (int job = 0; job < jobs; ++job) {
    const size_t unit = offset_of(job) / 16;
    int4 mine[kLaneUnits];
#pragma unroll
    for (int u = 0; u < kLaneUnits; ++u) mine[u] = __ldg(own + unit + u * 32 + lane);
    wait_phase(smem_address(&barriers[warp][job % kStages]), (job / kStages) & 1);
    const int4* staged = reinterpret_cast<const int4*>(stages + (job % kStages) * kBlocks * kPiece);
#pragma unroll
    for (int u = 0; u < kLaneUnits; ++u) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      ep_plugin::add_bf16x8(acc, mine[u]);
#pragma unroll
      for (int k = 0; k < kBlocks; ++k) ep_plugin::add_bf16x8(acc, staged[k * (kPiece / 16) + u * 32 + lane]);
      out[unit + u * 32 + lane] = ep_plugin::to_bf16x8(acc);
    }
    // NOTE: every lane has read the stage before lane 0 loads the next piece into it.
    __syncwarp();
    if (lane == 0 && job + kStages < jobs) issue(job + kStages);
  }
}

// The reference: each GPU's SMs store its blocks into their owners' inboxes, a warp per row, 8 units in
// flight per lane.
__global__ void __launch_bounds__(kThreads, 1) push_by_stores(const int4* rows, Sources inboxes) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < kBlocks * kRows; r += warps) {
    const int k = r % kBlocks, t = r / kBlocks;
    const int4* from = rows + (static_cast<size_t>(k) * kRows + t) * kUnits;
    int4* to = const_cast<int4*>(inboxes.block[k]) + static_cast<size_t>(t) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * 8) {
      int4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (base + u * 32 + lane < kUnits) v[u] = __ldg(from + base + u * 32 + lane);
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (base + u * 32 + lane < kUnits) to[base + u * 32 + lane] = v[u];
    }
  }
}

// Where GPU `sender`'s block k lands on its owner.
Sources inboxes_of(int sender) {
  Sources s;
  for (int k = 0; k < kBlocks; ++k) {
    const int owner = num_gpus == 2 ? 1 - sender : (sender + 1 + k) % num_gpus;
    // The owner's k-th stream (sender_of(owner, k')) with block k: its inbox slot k'.
    int slot = 0;
    while (sender_of(owner, slot) != sender || block_for(owner, sender, slot) != k) ++slot;
    s.block[k] = reinterpret_cast<const int4*>(gpus[owner].inbox + slot * kBlockBytes);
  }
  return s;
}

// Median microseconds of `issue(g)` run by every GPU at once (the slowest GPU's time per round).
template <typename Issue>
double measure_us(Issue issue) {
  auto begin_round = [](Gpu& g) {
    spin<<<1, 1, 0, g.main>>>(20'000'000);
    CHECK(cudaEventRecord(g.start, g.main));
    CHECK(cudaStreamWaitEvent(g.copy, g.start, 0));
  };
  return 1e3 * median_round_ms(gpus, 10, begin_round, [&](Gpu& g) {
           issue(g);
           cudaEvent_t copied;
           CHECK(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
           CHECK(cudaEventRecord(copied, g.copy));
           CHECK(cudaStreamWaitEvent(g.main, copied, 0));
           CHECK(cudaEventDestroy(copied));
           CHECK(cudaEventRecord(g.end, g.main));
         });
}

void report(const char* what, int sms, double us) {
  std::printf("%-52s %2d SMs  %7.1f us  %6.1f GB/s\n", what, sms, us, kBlocks * kBlockBytes / (us * 1e3));
}

void set_up(Gpu& g, int id) {
  g.id = id;
  CHECK(cudaSetDevice(id));
  for (int p = 0; p < num_gpus; ++p)
    if (p != id) CHECK(cudaDeviceEnablePeerAccess(p, 0));
  CHECK(cudaMalloc(&g.rows, kBlocks * kBlockBytes));
  CHECK(cudaMalloc(&g.inbox, kBlocks * kBlockBytes));
  CHECK(cudaMalloc(&g.local, kBlocks * kBlockBytes));
  CHECK(cudaMalloc(&g.own, kBlockBytes));
  CHECK(cudaMalloc(&g.out, kBlockBytes));
  CHECK(cudaMemset(g.rows, 0x3c, kBlocks * kBlockBytes));  // bf16 1.15
  CHECK(cudaMemset(g.own, 0x3c, kBlockBytes));
  CHECK(cudaStreamCreateWithFlags(&g.main, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&g.copy, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&g.start));
  CHECK(cudaEventCreate(&g.end));
}

template <typename Kernel>
void allow_shared_memory(Kernel kernel, int bytes) {
  for (Gpu& g : gpus) {
    CHECK(cudaSetDevice(g.id));
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  }
}

// One pull kernel at `sms` SMs, optionally beside the copy engine copying 159 MB within each GPU.
template <typename Kernel>
double pull(Kernel kernel, int sms, int smem, bool beside_copy) {
  return measure_us([&](Gpu& g) {
    if (beside_copy)
      CHECK(cudaMemcpyAsync(g.local, g.inbox, kBlocks * kBlockBytes, cudaMemcpyDeviceToDevice, g.copy));
    kernel<<<sms, kThreads, smem, g.main>>>(sources_of(g.id), reinterpret_cast<const int4*>(g.own),
                                             reinterpret_cast<int4*>(g.out));
    CHECK(cudaGetLastError());
  });
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  num_gpus = argc > 1 ? std::atoi(argv[1]) : 4;
  if (num_gpus != 2 && num_gpus != 4) {
    std::fprintf(stderr, "usage: pull_rate [2|4]\n");
    return 2;
  }
  gpus.resize(num_gpus);
  for (int id = 0; id < num_gpus; ++id) set_up(gpus[id], id);
  std::printf("%d GPUs; per GPU %d blocks of %d rows of %d B from peers (%.1f MB), GB/s of those bytes\n", num_gpus,
              kBlocks, kRows, kRowBytes, kBlocks * kBlockBytes / 1e6);
  report("copy engine, the bytes within the GPU", 0, measure_us([](Gpu& g) {
           CHECK(cudaMemcpyAsync(g.local, g.rows, kBlocks * kBlockBytes, cudaMemcpyDeviceToDevice, g.copy));
         }));
  constexpr int kSmallStages = 16 * 4 * kBlocks * 1024, kLargeStages = 16 * 2 * kBlocks * 2048;
  allow_shared_memory(pull_by_bulk_loads<1024, 4>, kSmallStages);
  allow_shared_memory(pull_by_bulk_loads<2048, 2>, kLargeStages);
  for (int sms : {8, 16, 24, 32}) {
    report("push: SM stores into the owners", sms, measure_us([&](Gpu& g) {
             push_by_stores<<<sms, kThreads, 0, g.main>>>(reinterpret_cast<const int4*>(g.rows), inboxes_of(g.id));
             CHECK(cudaGetLastError());
           }));
    report("pull: loads (4 units per lane per copy), sum, store", sms, pull(pull_by_loads<4>, sms, 0, false));
    report("pull: bulk loads of 1 KB, 4 stages, sum, store", sms,
           pull(pull_by_bulk_loads<1024, 4>, sms, kSmallStages, false));
    report("pull: bulk loads of 2 KB, 2 stages, sum, store", sms,
           pull(pull_by_bulk_loads<2048, 2>, sms, kLargeStages, false));
  }
  report("pull by loads beside a copy engine's 159 MB", 24, pull(pull_by_loads<4>, 24, 0, true));
  report("pull by 2 KB bulk loads beside a copy engine's 159 MB", 24,
         pull(pull_by_bulk_loads<2048, 2>, 24, kLargeStages, true));
  return 0;
}
