// Link ceilings by who moves the bytes (copy engine push/pull, SM stores/loads), both directions at once, 2 GPUs.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/link_probe benchmarks/probes/link_probe.cu && /tmp/link_probe [MB] [rows|roles]
//
// Prints GB/s per direction (median of 10 rounds after 2 warm-up rounds; a round's time is the slower GPU's).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_util.cuh"

namespace {

constexpr int kUnroll = 4;

// Every thread moves kUnroll 16-byte units per step, all loads before the stores.
__global__ void copy_units(int4* dst, const int4* src, size_t num_units) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x * kUnroll;
  for (size_t base = (static_cast<size_t>(blockIdx.x) * blockDim.x) * kUnroll + threadIdx.x; base < num_units;
       base += stride) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * blockDim.x < num_units) v[u] = __ldcg(src + base + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * blockDim.x < num_units) __stcg(dst + base + u * blockDim.x, v[u]);
  }
}

// Rows as the intranode dispatch's senders move them: each warp takes whole rows (every
// total-warps-th), loads kRowUnroll units per lane, then stores them to the peer and, if `local` is
// set, to a second local buffer (the rank's own copy).
constexpr int kRowUnroll = 8;
__global__ void __launch_bounds__(512, 1) copy_rows(int4* remote, int4* local, const int4* src, int num_rows,
                                                    int row_units) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < num_rows; row += warps) {
    const size_t first = static_cast<size_t>(row) * row_units;
    for (int base = 0; base < row_units; base += 32 * kRowUnroll) {
      int4 v[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u)
        if (base + u * 32 + lane < row_units) v[u] = __ldg(src + first + base + u * 32 + lane);
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        if (base + u * 32 + lane >= row_units) continue;
        __stcg(remote + first + base + u * 32 + lane, v[u]);
        if (local != nullptr) __stcg(local + first + base + u * 32 + lane, v[u]);
      }
    }
  }
}

// The same rows through the bulk-copy (TMA) unit: lane 0 of each warp loads a row into the warp's
// shared-memory buffer, then stores it to the peer (and the local buffer) with bulk copies; the
// buffer is reused once the stores have read it, while their writes may still be in flight.
__global__ void __launch_bounds__(512, 1) bulk_copy_rows(char* remote, char* local, const char* src, int num_rows,
                                                         int row_bytes) {
  extern __shared__ __align__(128) char buffers[];
  __shared__ __align__(8) unsigned long long barriers[16];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) != 0) return;
  char* buffer = buffers + static_cast<size_t>(warp) * row_bytes;
  const unsigned buffer_addr = static_cast<unsigned>(__cvta_generic_to_shared(buffer));
  const unsigned barrier_addr = static_cast<unsigned>(__cvta_generic_to_shared(&barriers[warp]));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(barrier_addr));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  unsigned phase = 0;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int row = blockIdx.x * (blockDim.x >> 5) + warp; row < num_rows; row += warps) {
    const size_t offset = static_cast<size_t>(row) * row_bytes;
    // The previous row's stores must have read the buffer before it is loaded again.
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier_addr), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(buffer_addr), "l"(src + offset), "r"(row_bytes), "r"(barrier_addr) : "memory");
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(barrier_addr), "r"(phase) : "memory");
    phase ^= 1;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(remote + offset), "r"(buffer_addr), "r"(row_bytes) : "memory");
    if (local != nullptr)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(local + offset), "r"(buffer_addr), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Local traffic on other SMs beside the rows into the peer: 0 = copy (read and write), 1 = read only,
// 2 = write only, over `num_units` 16-byte units of `a` (and `b`).
__global__ void local_traffic(int4* a, const int4* b, size_t num_units, int mode) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  int4 sink = make_int4(0, 0, 0, 0);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_units; i += stride) {
    if (mode == 2) {
      __stcg(a + i, make_int4(static_cast<int>(i), 0, 0, 0));
    } else {
      const int4 v = __ldcg(b + i);
      if (mode == 0) __stcg(a + i, v);
      else sink.x ^= v.x, sink.y ^= v.y;
    }
  }
  if (sink.x == 0x7fffffff && sink.y == 0x7fffffff) a[0] = sink;  // keeps the read-only loads
}

struct Gpu {
  int id;
  char* mine;   // this GPU's source bytes
  char* inbox;  // where the peer's bytes land on this GPU
  char* own;    // a second local destination (a dispatch's own copy)
  char* unpacked;  // a third: where a receiver would unpack the inbox
  cudaStream_t main, copy, sm, extra;
  cudaEvent_t start, end;
};

Gpu gpus[2];
size_t total_bytes;
constexpr int kRowBytes = 14336;  // dispatch-shaped rows: 7168 bf16 values
int num_rows;                     // rows in the round's bytes

// One experiment: `issue(g)` queues GPU g's share of the round on its streams; GB/s per direction.
template <typename Issue>
double measure(Issue issue) {
  auto begin_round = [](Gpu& g) {
    spin<<<1, 1, 0, g.main>>>(20'000'000);
    CHECK(cudaEventRecord(g.start, g.main));
    for (cudaStream_t s : {g.copy, g.sm, g.extra}) CHECK(cudaStreamWaitEvent(s, g.start, 0));
  };
  const double median_ms = median_round_ms(gpus, 10, begin_round, [&](Gpu& g) {
    issue(g);
    for (cudaStream_t s : {g.copy, g.sm, g.extra}) {
      cudaEvent_t joined;
      CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));
      CHECK(cudaEventRecord(joined, s));
      CHECK(cudaStreamWaitEvent(g.main, joined, 0));
      CHECK(cudaEventDestroy(joined));
    }
    CHECK(cudaEventRecord(g.end, g.main));
  });
  return static_cast<double>(total_bytes) / (median_ms * 1e-3) / 1e9;
}

Gpu& peer_of(const Gpu& g) { return gpus[1 - g.id]; }

// copy_rows on `stream`: `sms` SMs move the round's rows from `src` to `remote` (and `local`).
void rows(cudaStream_t stream, int sms, char* remote, char* local, const char* src) {
  copy_rows<<<sms, 512, 0, stream>>>(reinterpret_cast<int4*>(remote), reinterpret_cast<int4*>(local),
                                     reinterpret_cast<const int4*>(src), num_rows, kRowBytes / 16);
  CHECK(cudaGetLastError());
}

// Copy-engine pieces of `piece` bytes over [first, last) of the round's bytes, pushed or pulled.
void engine_copies(Gpu& g, size_t first, size_t last, size_t piece, bool pull) {
  for (size_t offset = first; offset < last; offset += piece) {
    const size_t n = std::min(piece, last - offset);
    if (pull) CHECK(cudaMemcpyAsync(g.inbox + offset, peer_of(g).mine + offset, n, cudaMemcpyDeviceToDevice, g.copy));
    else CHECK(cudaMemcpyAsync(peer_of(g).inbox + offset, g.mine + offset, n, cudaMemcpyDeviceToDevice, g.copy));
  }
}

// `shift`: bytes the destination sits past a 128-byte line (a multiple of 16).
void sm_copy(Gpu& g, size_t first, size_t last, int sms, bool pull, size_t shift = 0) {
  if (last <= first) return;
  if (shift > 0) last -= 128;  // the inbox has no room past its end
  int4* dst = reinterpret_cast<int4*>((pull ? g.inbox : peer_of(g).inbox) + first + shift);
  const int4* src = reinterpret_cast<const int4*>((pull ? peer_of(g).mine : g.mine) + first);
  copy_units<<<sms, 1024, 0, g.sm>>>(dst, src, (last - first) / 16);
  CHECK(cudaGetLastError());
}

}  // namespace

int main(int argc, char** argv) {
  total_bytes = static_cast<size_t>((argc > 1 ? std::atof(argv[1]) : 58.7) * 1e6) / 4096 * 4096;
  for (int id = 0; id < 2; ++id) {
    Gpu& g = gpus[id];
    g.id = id;
    CHECK(cudaSetDevice(id));
    CHECK(cudaDeviceEnablePeerAccess(1 - id, 0));
    CHECK(cudaMalloc(&g.mine, total_bytes));
    CHECK(cudaMalloc(&g.inbox, total_bytes));
    CHECK(cudaMalloc(&g.own, total_bytes));
    CHECK(cudaMalloc(&g.unpacked, total_bytes));
    CHECK(cudaMemset(g.mine, id + 1, total_bytes));
    CHECK(cudaStreamCreateWithFlags(&g.main, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&g.copy, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&g.sm, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&g.extra, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&g.start));
    CHECK(cudaEventCreate(&g.end));
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s x2, %.1f MB per direction per round, both directions at once\n", prop.name,
              total_bytes / 1e6);

  // `link_probe MB rows`: only the dispatch-shaped rows below.
  // `link_probe MB roles`: only the local copies and the dispatch split into roles (the last lines).
  const bool roles_only = argc > 2 && std::string(argv[2]) == "roles";
  const bool rows_only = roles_only || (argc > 2 && std::string(argv[2]) == "rows");
  const double sizes_mb[] = {3.7, 7.3, 14.7, 29.4, 58.7};
  for (bool pull : {false, true}) {
    if (rows_only) break;
    std::printf("copy engine %s:", pull ? "pull" : "push");
    for (double mb : sizes_mb) {
      const size_t piece = static_cast<size_t>(mb * 1e6) / 16 * 16;
      std::printf("  %.1f MB pieces %.1f GB/s", mb,
                  measure([&](Gpu& g) { engine_copies(g, 0, total_bytes, piece, pull); }));
    }
    std::printf("\n");
  }
  for (bool pull : {false, true}) {
    if (rows_only) break;
    std::printf("SMs %s:", pull ? "loading from the peer" : "storing into the peer");
    for (int sms : {4, 8, 16, 24, 32}) std::printf("  %d SMs %.1f GB/s", sms, measure([&](Gpu& g) {
                                                     sm_copy(g, 0, total_bytes, sms, pull);
                                                   }));
    std::printf("\n");
  }
  // Dispatch-shaped: 14336-byte rows, 512 threads per SM, to the peer and (dual) a local copy.
  num_rows = static_cast<int>(total_bytes / kRowBytes);
  const int bulk_smem = 16 * kRowBytes;
  for (Gpu& g : gpus) {  // a function attribute is set per device
    CHECK(cudaSetDevice(g.id));
    CHECK(cudaFuncSetAttribute(bulk_copy_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, bulk_smem));
  }
  if (!roles_only) {
    for (int dual = 0; dual < 2; ++dual) {
      for (int bulk = 0; bulk < 2; ++bulk) {
        std::printf("rows of %d B %s, %s:", kRowBytes, bulk ? "by bulk copies (TMA)" : "by 16-byte stores",
                    dual ? "to the peer and a local copy" : "to the peer only");
        for (int sms : {8, 12, 16, 24})
          std::printf("  %d SMs %.1f GB/s", sms, measure([&](Gpu& g) {
                        char* local = dual ? g.own : nullptr;
                        if (!bulk) return rows(g.sm, sms, peer_of(g).inbox, local, g.mine);
                        bulk_copy_rows<<<sms, 512, bulk_smem, g.sm>>>(peer_of(g).inbox, local, g.mine, num_rows, kRowBytes);
                        CHECK(cudaGetLastError());
                      }));
        std::printf("\n");
      }
    }
    // The local copy by the copy engine instead, beside the SMs' rows into the peer.
    std::printf("rows of %d B by 16-byte stores to the peer, the local copy by the copy engine:", kRowBytes);
    for (int sms : {8, 12, 16, 24})
      std::printf("  %d SMs %.1f GB/s", sms, measure([&](Gpu& g) {
                    CHECK(cudaMemcpyAsync(g.own, g.mine, static_cast<size_t>(num_rows) * kRowBytes,
                                          cudaMemcpyDeviceToDevice, g.copy));
                    rows(g.sm, sms, peer_of(g).inbox, nullptr, g.mine);
                  }));
    std::printf("\n");
    // Where the local writes collide with the link: 12 SMs send rows into the peer while 12 other SMs
    // copy, only read or only write the same number of bytes locally (a separate stream).
    const char* traffic_names[] = {"copy", "read", "write"};
    for (int mode = 0; mode < 3; ++mode)
      std::printf("rows into the peer by 12 SMs, 12 other SMs %s the same bytes locally: %.1f GB/s\n",
                  traffic_names[mode], measure([&](Gpu& g) {
                    local_traffic<<<12, 1024, 0, g.copy>>>(reinterpret_cast<int4*>(g.own),
                                                           reinterpret_cast<const int4*>(g.mine), total_bytes / 16, mode);
                    rows(g.sm, 12, peer_of(g).inbox, nullptr, g.mine);
                  }));
  }
  // How fast SMs copy rows locally (x to the own copy), alone on the GPU.
  std::printf("rows of %d B copied locally only, GB/s copied:", kRowBytes);
  for (int sms : {2, 4, 8, 12})
    std::printf("  %d SMs %.1f GB/s", sms, measure([&](Gpu& g) { rows(g.sm, sms, g.own, nullptr, g.mine); }));
  std::printf("\n");
  // A dispatch split into three roles on separate SMs: S SMs send rows into the peer, O SMs copy the
  // own rows locally, U SMs unpack the inbox (which the peer is filling) into a third buffer.
  const int splits[][3] = {{8, 8, 8}, {10, 7, 7}, {12, 6, 6}, {8, 4, 12}, {8, 12, 4}};
  for (const auto& split : splits)
    std::printf("rows into the peer by %d SMs, own rows by %d, unpack by %d: %.1f GB/s\n", split[0], split[1], split[2],
                measure([&](Gpu& g) {
                  rows(g.sm, split[0], peer_of(g).inbox, nullptr, g.mine);
                  rows(g.copy, split[1], g.own, nullptr, g.mine);
                  rows(g.extra, split[2], g.unpacked, nullptr, g.inbox);
                }));
  // Today's dispatch for comparison: S SMs send rows into the peer and write the own copy, U unpack.
  for (int sms : {8, 12})
    std::printf("rows into the peer and the own copy by %d SMs, unpack by %d: %.1f GB/s\n", sms, sms,
                measure([&](Gpu& g) {
                  rows(g.sm, sms, peer_of(g).inbox, g.own, g.mine);
                  rows(g.extra, sms, g.unpacked, nullptr, g.inbox);
                }));
  if (rows_only) return 0;
  std::printf("SMs storing into the peer, 16 B past the lines:");
  for (int sms : {8, 16, 24}) std::printf("  %d SMs %.1f GB/s", sms, measure([&](Gpu& g) {
                                            sm_copy(g, 0, total_bytes, sms, false, 16);
                                          }));
  std::printf("\n");
  // Shared: the engine pulls the first `share` of the bytes in 14.7 MB pieces, SMs pull the rest.
  for (int sms : {8, 16}) {
    std::printf("engine pull + %d SMs pulling:", sms);
    for (double share : {0.6, 0.7, 0.8, 0.9}) {
      const size_t split = static_cast<size_t>(total_bytes * share) / 4096 * 4096;
      std::printf("  engine %.0f%% %.1f GB/s", share * 100, measure([&](Gpu& g) {
                    engine_copies(g, 0, split, 14'700'000, true);
                    sm_copy(g, split, total_bytes, sms, true);
                  }));
    }
    std::printf("\n");
  }
  std::printf("engine push + %d SMs storing:", 16);
  for (double share : {0.7, 0.8}) {
    const size_t split = static_cast<size_t>(total_bytes * share) / 4096 * 4096;
    std::printf("  engine %.0f%% %.1f GB/s", share * 100, measure([&](Gpu& g) {
                  engine_copies(g, 0, split, 14'700'000, false);
                  sm_copy(g, split, total_bytes, 16, false);
                }));
  }
  std::printf("\n");
  return 0;
}
