// Bytes an SM moves per second, by how it moves them: 16-byte register loads/stores by threads and
// depth, and bulk (TMA) copies through shared memory by pipeline shape; locally, into the peer, and
// into the peer plus a local copy (a dispatch's rows at 2 ranks). Both GPUs run each case at once;
// on a machine of one GPU only `sum` runs, its tables of local rows.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I csrc -o /tmp/sm_rate benchmarks/probes/sm_rate.cu && /tmp/sm_rate [engine|hybrid|sum|landing]
//
// Prints GB/s per GPU (bytes written; read-only: bytes read) and per SM, median of 5 rounds. The last
// rows move the rows into the peer by copy engine instead, beside SMs copying the own rows: one copy
// into the peer, the whole path through a staging area (engine_staged_row), the whole path straight
// into the peer's output in runs of tokens (engine_direct_row), and that path for the longest runs of
// a random 2-rank routing beside SMs copying the other rows (engine_hybrid_row; `hybrid`: these rows
// only); ", batch": the engine's copies in one cudaMemcpyBatchAsync call. `sum` times a 2-rank
// combine's sum (in fp32 or bf16 pairs, or the staged row added onto the own row by bf16x2 reductions in L2;
// with L2 as the last round left it or flushed; with the combine's per-token steps added one by one; alone,
// and beside both GPUs' engines copying); `landing` prints when each row of one engine copy lands in the
// peer, watched by one thread per row spinning or pausing 1 us between reads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "probe_util.cuh"

namespace {

using namespace ep_plugin;

constexpr int kRowBytes = 14336;  // 7168 bf16 values
constexpr int kRows = 4096;

enum Mode { kCopy, kReadOnly, kWriteOnly };

// Warp w takes rows w, w + W, ...; a lane moves kUnroll 16-byte units per step, loads before stores,
// to dst0 and (if set) dst1.
template <int kUnroll, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, 1)
    register_rows(int4* dst0, int4* dst1, const int4* src, int mode, int4* sink) {
  constexpr int kUnits = kRowBytes / 16;
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  int4 acc = make_int4(0, 0, 0, 0);
  for (int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < kRows; row += warps) {
    const size_t first = static_cast<size_t>(row) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        v[u] = i < kUnits && mode != kWriteOnly ? __ldg(src + first + i) : make_int4(row, i, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
        if (mode == kReadOnly) {
          acc.x ^= v[u].x, acc.y ^= v[u].y;
          continue;
        }
        __stcg(dst0 + first + i, v[u]);
        if (dst1 != nullptr) __stcg(dst1 + first + i, v[u]);
      }
    }
  }
  if (acc.x == 0x7fffffff && acc.y == 0x7fffffff) *sink = acc;  // keeps the read-only loads
}

// Each warp streams its rows through `stages` pieces of `piece` bytes of shared memory, loads
// `stages - 2` pieces ahead (lane 0), lane 0 stores to dst0 and lane 1 to dst1 (if set); read-only:
// no stores. The library's pipeline (bulk_rows.cuh) is 16 warps, 4 stages of 3584 bytes.
__global__ void __launch_bounds__(1024, 1) bulk_rows(uint8_t* dst0, uint8_t* dst1, const uint8_t* src, int mode,
                                                    int stages, int piece) {
  extern __shared__ __align__(128) uint8_t shared[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, block_warps = blockDim.x >> 5;
  uint8_t* buf = shared + static_cast<size_t>(warp) * stages * piece;
  uint64_t* bars = reinterpret_cast<uint64_t*>(shared + static_cast<size_t>(block_warps) * stages * piece) + warp * stages;
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&bars[s], 1);
    fence_mbarrier_init();
  }
  __syncwarp();
  const int pieces = kRowBytes / piece;
  const int warps = gridDim.x * block_warps;
  const int first_row = blockIdx.x * block_warps + warp;
  const int my_rows = first_row < kRows ? (kRows - 1 - first_row) / warps + 1 : 0;
  const int items = my_rows * pieces;
  auto offset_of = [&](int item) {
    return static_cast<size_t>(first_row + (item / pieces) * warps) * kRowBytes + (item % pieces) * piece;
  };
  int issued = 0;
  for (int item = 0; item < items; ++item) {
    const int last = min(item + stages - 2, items - 1);
    if (issued <= last) {
      bulk_wait_read<1>();
      __syncwarp();
      if (lane == 0)
        for (int i = issued; i <= last; ++i) {
          mbarrier_arrive_expect_bytes(&bars[i % stages], piece);
          bulk_load(buf + (i % stages) * piece, src + offset_of(i), piece, &bars[i % stages]);
        }
      issued = last + 1;
    }
    const int stage = item % stages;
    while (!mbarrier_try_wait(&bars[stage], (item / stages) & 1)) {
    }
    if (mode != kReadOnly) {
      uint8_t* dst = lane == 0 ? dst0 : lane == 1 ? dst1 : nullptr;
      if (dst != nullptr) bulk_store(dst + offset_of(item), buf + stage * piece, piece);
    }
    bulk_commit_group();
  }
  bulk_wait_all();
}

// A 2-rank combine's sum: out = a + b row by row (bf16, summed in fp32 or, kBf16x2, in bf16 pairs as the
// copy-engine combine does), a lane holding kUnroll units of both rows in flight; b is local or the
// peer's rows read across NVLink.
// kAdd: out += b instead (the own row already in `out`): a 16-byte bf16x2 reduction that L2 applies.
__device__ __forceinline__ void red_add_bf16x8(int4* to, int4 v) {
  asm volatile("red.relaxed.gpu.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(to), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

template <int kUnroll, int kMaxThreads, bool kBf16x2 = false, bool kAdd = false>
__global__ void __launch_bounds__(kMaxThreads, 1) reduce_rows(int4* out, const int4* a, const int4* b) {
  constexpr int kUnits = kRowBytes / 16;
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < kRows; row += warps) {
    const size_t first = static_cast<size_t>(row) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * kUnroll) {
      int4 x[kUnroll], y[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
        if constexpr (!kAdd) x[u] = ld_nc_v4(a + first + i);
        y[u] = ld_nc_v4(b + first + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
        if constexpr (kAdd) {
          red_add_bf16x8(out + first + i, y[u]);
          continue;
        }
        if constexpr (kBf16x2) {
          st_na_v4(out + first + i, sum_bf16x8(x[u], y[u]));
          continue;
        }
        float acc[8] = {};
        add_bf16x8(acc, x[u]);
        add_bf16x8(acc, y[u]);
        st_na_v4(out + first + i, to_bf16x8(acc));
      }
    }
  }
}

// The copy-engine combine's per-token path added to the bf16x2 sum step by step (kSteps of them, each
// with all before it): 1, rows addressed through per-token positions loaded a token ahead; 2, the staged
// row read through L2 only and checked for unlanded (0xffffffff) words; 3, the top-k weights of both
// copies loaded before the rows and summed after them; 4, an L2 prefetch of both rows at the token's start.
constexpr int kStepTopk = 8;

struct StepInputs {
  const int* own_pos;      // token t's own row in `a`
  const int* staged_pos;   // its staged row in `b`
  const float* own_weights;
  const float* staged_weights;
  float* out_weights;
};

// Step 2's parts (kCheck): 0, as above; 1, read through L2 only, unchecked; 2, read as read-only input
// (no L1 allocation) and checked.
template <int kSteps, int kCheck = 0>
__global__ void __launch_bounds__(512, 1) reduce_steps(int4* out, const int4* a, const int4* b, StepInputs in) {
  constexpr int kUnits = kRowBytes / 16;
  constexpr int kUnroll = 8;
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  const int first_token = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int own_ahead = 0, staged_ahead = 0;
  if constexpr (kSteps >= 1) {
    if (first_token < kRows) own_ahead = in.own_pos[first_token], staged_ahead = in.staged_pos[first_token];
  }
  for (int t = first_token; t < kRows; t += warps) {
    int own_row = t, staged_row = t;
    if constexpr (kSteps >= 1) {
      own_row = own_ahead, staged_row = staged_ahead;
      if (t + warps < kRows) own_ahead = in.own_pos[t + warps], staged_ahead = in.staged_pos[t + warps];
    }
    const int4* x = a + static_cast<size_t>(own_row) * kUnits;
    const int4* y = b + static_cast<size_t>(staged_row) * kUnits;
    if constexpr (kSteps >= 4) {
      if (lane < 2) prefetch_to_l2(lane == 0 ? static_cast<const void*>(x) : static_cast<const void*>(y), kRowBytes);
    }
    float own_weight = 0.f, staged_weight = 0.f;
    if constexpr (kSteps >= 3) {
      if (lane < kStepTopk) {
        own_weight = in.own_weights[static_cast<size_t>(own_row) * kStepTopk + lane];
        staged_weight = ld_cg_f32(in.staged_weights + static_cast<size_t>(staged_row) * kStepTopk + lane);
      }
    }
    int4* to = out + static_cast<size_t>(t) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * kUnroll) {
      int4 u0[kUnroll], u1[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < kUnits) u0[u] = ld_nc_v4(x + i);
      }
      bool unlanded = false;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
        if constexpr (kSteps >= 2) {
          u1[u] = kCheck == 2 ? ld_nc_v4(y + i) : ld_cg_v4(y + i);
          if (kCheck != 1) unlanded = unlanded || u1[u].x == -1 || u1[u].y == -1 || u1[u].z == -1 || u1[u].w == -1;
        } else {
          u1[u] = ld_nc_v4(y + i);
        }
      }
      if constexpr (kSteps >= 2) {
        if (__any_sync(0xffffffffu, unlanded)) __trap();  // nothing here is unlanded
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < kUnits) st_na_v4(to + i, sum_bf16x8(u0[u], u1[u]));
      }
    }
    if constexpr (kSteps >= 3) {
      if (lane < kStepTopk) in.out_weights[static_cast<size_t>(t) * kStepTopk + lane] = own_weight + staged_weight;
    }
  }
}

// A dispatch's rows by list: item i < n_remote copies row remote_rows[i] of src into row remote_to[i] of
// dst_remote; the next kRows items copy every row into `own` (warp w takes items w, w + W, ...).
__global__ void __launch_bounds__(512, 1) listed_rows(int4* dst_remote, int4* own, const int4* src,
                                                      const int* remote_rows, const int* remote_to, int n_remote) {
  constexpr int kUnits = kRowBytes / 16;
  constexpr int kUnroll = 8;
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); item < n_remote + kRows; item += warps) {
    const bool remote = item < n_remote;
    const int4* from = src + static_cast<size_t>(remote ? remote_rows[item] : item - n_remote) * kUnits;
    int4* to = remote ? dst_remote + static_cast<size_t>(remote_to[item]) * kUnits
                      : own + static_cast<size_t>(item - n_remote) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 + lane < kUnits) v[u] = ld_nc_v4(from + base + u * 32 + lane);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 + lane < kUnits) __stcg(to + base + u * 32 + lane, v[u]);
    }
  }
}

struct Gpu {
  int id;
  uint8_t *src, *own, *inbox, *out, *spare;
  uint8_t* flush;  // written before a round that must find nothing of its inputs in L2
  int4* sink;
  uint64_t* landed;  // pieces of the peer's rows landed in `inbox` (engine_staged_row)
  // engine_direct_row: the peer's stream has reached the round (this GPU's copies may write its `out`);
  // the peer's rows have landed in this GPU's `out`.
  uint64_t *go, *arrived;
  uint64_t rounds = 0;
  cudaStream_t stream, copy, local;  // the SMs' work; the copy engine's into the peer; its local copies
  cudaEvent_t start, end, copied, placed;
};
std::vector<Gpu> gpus;  // two; one where only `sum`'s tables of local rows run (a machine of one GPU)

constexpr size_t kFlushBytes = 256u << 20;  // several times L2

// Median seconds of a round in which both GPUs run `launch(g)` at once (the slower GPU's time);
// `flush_l2`: L2 is overwritten before each round (as `ep-plugin bench` does before each call).
template <typename Launch>
double seconds(Launch launch, bool flush_l2 = false) {
  auto begin_round = [flush_l2](Gpu& g) {
    if (flush_l2) CHECK(cudaMemsetAsync(g.flush, 0, kFlushBytes, g.stream));
    spin<<<1, 1, 0, g.stream>>>(4'000'000);
    CHECK(cudaEventRecord(g.start, g.stream));
  };
  return 1e-3 * median_round_ms(gpus, 5, begin_round, [&](Gpu& g) {
    launch(g);
    CHECK(cudaEventRecord(g.end, g.stream));
  });
}

// Where a case writes: 0 local, 1 the peer, 2 the peer and a local copy; read-only and write-only are local.
struct Case {
  const char* name;
  Mode mode;
  int targets;
};
const Case kCases[] = {{"local copy", kCopy, 0},  {"read only", kReadOnly, 0},         {"write only", kWriteOnly, 0},
                       {"into peer", kCopy, 1}, {"peer + local copy", kCopy, 2}};

void destinations(Gpu& g, const Case& c, uint8_t*& dst0, uint8_t*& dst1) {
  dst0 = c.targets == 0 ? g.own : gpus[1 - g.id].inbox;
  dst1 = c.targets == 2 ? g.own : nullptr;
}

template <typename Launch>
void table_row(const char* mover, const Case& c, Launch launch) {
  std::printf("%-28s %-18s", mover, c.name);
  const double bytes = static_cast<double>(kRows) * kRowBytes * (c.targets == 2 ? 2 : 1);
  for (int sms : {1, 2, 4, 8, 16}) {
    const double gbps = bytes / seconds([&](Gpu& g) { launch(g, sms); }) / 1e9;
    std::printf("  %2d SMs %6.1f (%5.1f/SM)", sms, gbps, gbps / sms);
  }
  std::printf("\n");
  std::fflush(stdout);
}

template <int kUnroll, int kThreads>
void register_table() {
  const int threads = kThreads;
  char mover[64];
  std::snprintf(mover, sizeof(mover), "registers %4d thr x %2d", threads, kUnroll);
  for (const Case& c : kCases)
    table_row(mover, c, [&](Gpu& g, int sms) {
      uint8_t *dst0, *dst1;
      destinations(g, c, dst0, dst1);
      register_rows<kUnroll, kThreads><<<sms, threads, 0, g.stream>>>(
          reinterpret_cast<int4*>(dst0), reinterpret_cast<int4*>(dst1), reinterpret_cast<const int4*>(g.src), c.mode,
          g.sink);
    });
}

void bulk_table(int warps, int stages, int piece) {
  const int smem = warps * stages * (piece + 8);
  char mover[64];
  std::snprintf(mover, sizeof(mover), "bulk %2d warps x %d x %5d B", warps, stages, piece);
  for (Gpu& g : gpus) {
    CHECK(cudaSetDevice(g.id));
    CHECK(cudaFuncSetAttribute(bulk_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  for (const Case& c : kCases) {
    if (c.mode == kWriteOnly) continue;
    table_row(mover, c, [&](Gpu& g, int sms) {
      uint8_t *dst0, *dst1;
      destinations(g, c, dst0, dst1);
      bulk_rows<<<sms, warps * 32, smem, g.stream>>>(dst0, dst1, g.src, c.mode, stages, piece);
    });
  }
}

// The copy engine moves the rows into the peer (one copy, pushed by this GPU's engine or pulled by the
// peer's) while `sms` SMs copy the own rows locally: a 2-rank dispatch in which no SM writes into the peer.
void engine_and_sms_row(bool pull) {
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  std::printf("%-28s %-18s", pull ? "engine pull + registers" : "engine push + registers", "peer + local copy");
  for (int sms : {1, 2, 4, 8, 16}) {
    const double round = seconds([&](Gpu& g) {
      const Gpu& peer = gpus[1 - g.id];
      CHECK(cudaStreamWaitEvent(g.copy, g.start, 0));
      if (pull) CHECK(cudaMemcpyAsync(g.inbox, peer.src, bytes, cudaMemcpyDeviceToDevice, g.copy));
      else CHECK(cudaMemcpyAsync(peer.inbox, g.src, bytes, cudaMemcpyDeviceToDevice, g.copy));
      register_rows<8, 512><<<sms, 512, 0, g.stream>>>(reinterpret_cast<int4*>(g.own), nullptr,
                                                       reinterpret_cast<const int4*>(g.src), kCopy, g.sink);
      CHECK(cudaEventRecord(g.copied, g.copy));
      CHECK(cudaStreamWaitEvent(g.stream, g.copied, 0));
    });
    std::printf("  %2d SMs %6.1f (%5.1f us)", sms, 2.0 * bytes / round / 1e9, round * 1e6);
  }
  std::printf("\n");
  std::fflush(stdout);
}

__global__ void signal_word(uint64_t* word, uint64_t value) { st_release_sys(word, value); }
__global__ void wait_for_word(const uint64_t* word, uint64_t value) {
  while (ld_acquire_sys(word) < value) {
  }
}

// The 2-rank dispatch through staging, whole: this GPU's engine pushes its rows into the peer's staging
// area (`inbox`, a fixed place the sender knows) in `pieces` copies, raising the peer's landed count
// after each (a one-thread kernel on the copy stream); the peer's engine copies each landed piece into
// its output, behind a one-thread wait, as a receiver whose output addresses only its own host knows
// would; `sms` SMs copy the own rows meanwhile.
void engine_staged_row(int pieces) {
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  const size_t piece = bytes / pieces;
  char mover[64];
  std::snprintf(mover, sizeof(mover), "engine staged, %2d pieces", pieces);
  std::printf("%-28s %-18s", mover, "peer + local copy");
  for (int sms : {1, 2, 4, 8, 16}) {
    const double round = seconds([&](Gpu& g) {
      const Gpu& peer = gpus[1 - g.id];
      // Both GPUs count their rounds alike: the values of this round are first + 1 .. first + pieces.
      const uint64_t first = g.rounds++ * pieces;
      CHECK(cudaStreamWaitEvent(g.copy, g.start, 0));
      CHECK(cudaStreamWaitEvent(g.local, g.start, 0));
      for (int k = 0; k < pieces; ++k) {
        CHECK(cudaMemcpyAsync(peer.inbox + k * piece, g.src + k * piece, piece, cudaMemcpyDeviceToDevice, g.copy));
        signal_word<<<1, 1, 0, g.copy>>>(peer.landed, first + k + 1);
      }
      register_rows<8, 512><<<sms, 512, 0, g.stream>>>(reinterpret_cast<int4*>(g.own), nullptr,
                                                       reinterpret_cast<const int4*>(g.src), kCopy, g.sink);
      for (int k = 0; k < pieces; ++k) {
        wait_for_word<<<1, 1, 0, g.local>>>(g.landed, first + k + 1);
        CHECK(cudaMemcpyAsync(g.out + k * piece, g.inbox + k * piece, piece, cudaMemcpyDeviceToDevice, g.local));
      }
      CHECK(cudaEventRecord(g.copied, g.copy));
      CHECK(cudaEventRecord(g.placed, g.local));
      CHECK(cudaStreamWaitEvent(g.stream, g.copied, 0));
      CHECK(cudaStreamWaitEvent(g.stream, g.placed, 0));
    });
    std::printf("  %2d SMs %6.1f (%5.1f us)", sms, 2.0 * bytes / round / 1e9, round * 1e6);
  }
  std::printf("\n");
  std::fflush(stdout);
}

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

// The copies on `stream`: one cudaMemcpyAsync each, or all in one cudaMemcpyBatchAsync.
void engine_copies(const std::vector<Copy>& copies, bool batched, cudaStream_t stream) {
  if (!batched) {
    for (const Copy& c : copies) CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (const Copy& c : copies) dsts.push_back(c.dst), srcs.push_back(c.src), sizes.push_back(c.bytes);
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first = 0;
  CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attributes, &first, 1, stream));
}

// The engine's copies straight into the peer's output, stream-ordered with the peer: a one-thread wait
// on the copy stream for the peer's go (its stream has reached the dispatch, so its output may be
// written), the copies, a one-thread signal that the peer's stream waits for. Returns the round's value
// for end_direct_copies.
uint64_t queue_direct_copies(Gpu& g, const std::vector<Copy>& copies, bool batched) {
  const Gpu& peer = gpus[1 - g.id];
  // Both GPUs count their rounds alike; the count only grows, so a round never sees an earlier one's word.
  const uint64_t value = ++g.rounds;
  signal_word<<<1, 1, 0, g.stream>>>(peer.go, value);
  CHECK(cudaStreamWaitEvent(g.copy, g.start, 0));
  wait_for_word<<<1, 1, 0, g.copy>>>(g.go, value);
  engine_copies(copies, batched, g.copy);
  signal_word<<<1, 1, 0, g.copy>>>(peer.arrived, value);
  return value;
}

// This GPU's stream waits for the peer's copies into it (and for its own copy stream).
void end_direct_copies(Gpu& g, uint64_t value) {
  wait_for_word<<<1, 1, 0, g.stream>>>(g.arrived, value);
  CHECK(cudaEventRecord(g.copied, g.copy));
  CHECK(cudaStreamWaitEvent(g.stream, g.copied, 0));
}

// The 2-rank dispatch straight into the peer's output, whole: the own rows by `sms` SMs; the rows into
// the peer by this GPU's engine in `runs` copies of consecutive tokens (a token between runs stays
// home, as tokens routed elsewhere do), ordered with the peer as queue_direct_copies says.
void engine_direct_row(int runs, bool batched) {
  const int rows_per_run = kRows / runs;
  std::printf("%-28s %-18s",
              (std::string("engine direct, ") + std::to_string(runs) + (batched ? " runs, batch" : " runs")).c_str(),
              "peer + local copy");
  for (int sms : {1, 2, 4, 8, 16}) {
    const double round = seconds([&](Gpu& g) {
      const Gpu& peer = gpus[1 - g.id];
      std::vector<Copy> copies;
      int64_t to = 0;
      for (int k = 0; k < runs; ++k) {
        const int64_t first = static_cast<int64_t>(k) * rows_per_run + (k > 0 ? 1 : 0);
        const int64_t rows = static_cast<int64_t>(k + 1) * rows_per_run - first;
        copies.push_back({peer.out + to * kRowBytes, g.src + first * kRowBytes, static_cast<size_t>(rows) * kRowBytes});
        to += rows;
      }
      const uint64_t value = queue_direct_copies(g, copies, batched);
      register_rows<8, 512><<<sms, 512, 0, g.stream>>>(reinterpret_cast<int4*>(g.own), nullptr,
                                                       reinterpret_cast<const int4*>(g.src), kCopy, g.sink);
      end_direct_copies(g, value);
    });
    std::printf("  %2d SMs %6.1f (%5.1f us)", sms, 2.0 * kRows * kRowBytes / round / 1e9, round * 1e6);
  }
  std::printf("\n");
  std::fflush(stdout);
}

// Runs of consecutive tokens routed to the peer at 2 ranks, top-8 of 256 experts (a token stays home
// with probability C(128,8)/C(256,8), about 0.0035): (first token, rows), longest first.
std::vector<std::pair<int, int>> routed_runs() {
  double stay = 1;
  for (int i = 0; i < 8; ++i) stay *= (128.0 - i) / (256.0 - i);
  uint64_t state = 12345;
  std::vector<std::pair<int, int>> runs;
  for (int t = 0; t < kRows; ++t) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const bool routed = static_cast<double>(state >> 11) / 9007199254740992.0 >= stay;
    if (!routed) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == t) ++runs.back().second;
    else runs.push_back({t, 1});
  }
  std::sort(runs.begin(), runs.end(), [](auto& a, auto& b) { return a.second > b.second; });
  return runs;
}

// The 2-rank dispatch split: this GPU's engine copies the `engine_runs` longest runs straight into the
// peer's output (queue_direct_copies), and `sms` SMs copy
// the other routed rows into the peer and every own row locally. engine_runs 0: SMs move everything.
void engine_hybrid_row(int engine_runs, bool batched) {
  const auto runs = routed_runs();
  int routed = 0;
  for (auto& r : runs) routed += r.second;
  // Where each routed token lands in the peer's output: its rank among the routed tokens.
  std::vector<int> slot(kRows, -1);
  {
    std::vector<std::pair<int, int>> by_token(runs.begin(), runs.end());
    std::sort(by_token.begin(), by_token.end());
    int next = 0;
    for (auto& r : by_token)
      for (int i = 0; i < r.second; ++i) slot[r.first + i] = next++;
  }
  const int k = std::min<int>(engine_runs, static_cast<int>(runs.size()));
  std::vector<int> remote_rows, remote_to;
  int engine_rows = 0;
  for (size_t j = 0; j < runs.size(); ++j) {
    if (static_cast<int>(j) < k) {
      engine_rows += runs[j].second;
      continue;
    }
    for (int i = 0; i < runs[j].second; ++i) {
      remote_rows.push_back(runs[j].first + i);
      remote_to.push_back(slot[runs[j].first + i]);
    }
  }
  int* lists[2][2];
  const int n_remote = static_cast<int>(remote_rows.size());
  for (Gpu& g : gpus) {
    CHECK(cudaSetDevice(g.id));
    for (int l = 0; l < 2; ++l) {
      CHECK(cudaMalloc(&lists[g.id][l], std::max(1, n_remote) * sizeof(int)));
      CHECK(cudaMemcpy(lists[g.id][l], (l == 0 ? remote_rows : remote_to).data(), n_remote * sizeof(int),
                       cudaMemcpyHostToDevice));
    }
  }
  char mover[64];
  std::snprintf(mover, sizeof(mover), "hybrid, engine %d of %d%s", k, static_cast<int>(runs.size()),
                batched ? ", batch" : "");
  std::printf("%-28s %4.1f%% of %d rows   ", mover, 100.0 * engine_rows / routed, routed);
  for (int sms : {4, 8, 16, 24}) {
    const double round = seconds([&](Gpu& g) {
      const Gpu& peer = gpus[1 - g.id];
      std::vector<Copy> copies;
      for (int j = 0; j < k; ++j)
        copies.push_back({peer.out + static_cast<size_t>(slot[runs[j].first]) * kRowBytes,
                          g.src + static_cast<size_t>(runs[j].first) * kRowBytes,
                          static_cast<size_t>(runs[j].second) * kRowBytes});
      const uint64_t value = k > 0 ? queue_direct_copies(g, copies, batched) : 0;
      listed_rows<<<sms, 512, 0, g.stream>>>(reinterpret_cast<int4*>(peer.out), reinterpret_cast<int4*>(g.own),
                                             reinterpret_cast<const int4*>(g.src), lists[g.id][0], lists[g.id][1],
                                             n_remote);
      if (k > 0) end_direct_copies(g, value);
    });
    std::printf("  %2d SMs %5.1f us", sms, round * 1e6);
  }
  std::printf("\n");
  std::fflush(stdout);
  for (Gpu& g : gpus) {
    CHECK(cudaSetDevice(g.id));
    for (int l = 0; l < 2; ++l) CHECK(cudaFree(lists[g.id][l]));
  }
}

void hybrid_rows() {
  for (int engine_runs : {0, 1, 2, 4, 8, 1000}) engine_hybrid_row(engine_runs, false);
  for (int engine_runs : {8, 1000}) engine_hybrid_row(engine_runs, true);
}

// The sum's rate: GB/s of output rows (each reads two rows and writes one); `flush_l2`: with L2 overwritten
// before each round, so that both rows come from HBM.
template <int kUnroll, int kThreads, bool kBf16x2 = false, bool kAdd = false>
void reduce_table(bool flush_l2 = false) {
  char mover[64];
  std::snprintf(mover, sizeof(mover), "sum%s registers %4d x %2d%s", kAdd ? " red.add" : kBf16x2 ? " bf16x2" : "",
                kThreads, kUnroll, flush_l2 ? ", L2 flushed" : "");
  for (bool remote : {false, true}) {
    if (remote && gpus.size() < 2) continue;
    std::printf("%-40s %-18s", mover, remote ? "own + peer's row" : "two local rows");
    for (int sms : {1, 2, 4, 8, 16}) {
      const double round = seconds([&](Gpu& g) {
        const uint8_t* b = remote ? gpus[1 - g.id].src : g.inbox;
        reduce_rows<kUnroll, kThreads, kBf16x2, kAdd><<<sms, kThreads, 0, g.stream>>>(
            reinterpret_cast<int4*>(g.out), reinterpret_cast<const int4*>(g.src), reinterpret_cast<const int4*>(b));
      }, flush_l2);
      std::printf("  %2d SMs %6.1f (%5.1f us)", sms, static_cast<double>(kRows) * kRowBytes / round / 1e9, round * 1e6);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
}

// The combine's per-token path, step by step (reduce_steps), two local rows, L2 flushed before each round.
template <int kSteps, int kCheck = 0>
void reduce_steps_row(const StepInputs (&inputs)[2]) {
  static const char* const kNames[] = {"bf16x2 sum", "+ positions", "+ landed check", "+ weights", "+ L2 prefetch"};
  static const char* const kChecks[] = {"", " (L2 only, unchecked)", " (read-only, checked)"};
  std::printf("%-40s %-18s%s", "sum steps 512 x 8, L2 flushed", kNames[kSteps], kChecks[kCheck]);
  for (int sms : {8, 16, 24}) {
    const double round = seconds([&](Gpu& g) {
      reduce_steps<kSteps, kCheck><<<sms, 512, 0, g.stream>>>(reinterpret_cast<int4*>(g.out),
                                                              reinterpret_cast<const int4*>(g.src),
                                                              reinterpret_cast<const int4*>(g.inbox), inputs[g.id]);
    }, true);
    std::printf("  %2d SMs %6.1f (%5.1f us)", sms, static_cast<double>(kRows) * kRowBytes / round / 1e9, round * 1e6);
  }
  std::printf("\n");
  std::fflush(stdout);
}

void reduce_steps_table() {
  StepInputs inputs[2];
  std::vector<int> identity(kRows);
  for (int t = 0; t < kRows; ++t) identity[t] = t;
  for (Gpu& g : gpus) {
    CHECK(cudaSetDevice(g.id));
    int* pos;
    float* weights;
    CHECK(cudaMalloc(&pos, kRows * sizeof(int)));
    CHECK(cudaMemcpy(pos, identity.data(), kRows * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&weights, 3 * kRows * kStepTopk * sizeof(float)));
    CHECK(cudaMemset(weights, 0, 3 * kRows * kStepTopk * sizeof(float)));
    CHECK(cudaMemset(g.inbox, 0, static_cast<size_t>(kRows) * kRowBytes));  // no unlanded word
    inputs[g.id] = StepInputs{pos, pos, weights, weights + kRows * kStepTopk, weights + 2 * kRows * kStepTopk};
  }
  reduce_steps_row<0>(inputs);
  reduce_steps_row<1>(inputs);
  reduce_steps_row<2>(inputs);
  reduce_steps_row<2, 1>(inputs);
  reduce_steps_row<2, 2>(inputs);
  reduce_steps_row<3>(inputs);
  reduce_steps_row<4>(inputs);
  for (Gpu& g : gpus) {
    CHECK(cudaSetDevice(g.id));
    CHECK(cudaFree(const_cast<int*>(inputs[g.id].own_pos)));
    CHECK(cudaFree(const_cast<float*>(inputs[g.id].own_weights)));
  }
}

// The sum while this GPU's engine pushes its rows into the peer and the peer's engine pushes its rows
// into this GPU (a 2-rank copy-engine combine's traffic): the sum reads the landing rows (`inbox`,
// unsynchronized: a timing only) or rows no engine writes (`spare`).
template <int kUnroll, int kThreads>
void reduce_beside_engine_table() {
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  char mover[64];
  std::snprintf(mover, sizeof(mover), "sum+engine %4d x %2d", kThreads, kUnroll);
  for (bool landing : {false, true}) {
    std::printf("%-28s %-18s", mover, landing ? "own + landing rows" : "own + spare rows");
    for (int sms : {4, 8, 16}) {
      const double round = seconds([&](Gpu& g) {
        CHECK(cudaStreamWaitEvent(g.copy, g.start, 0));
        CHECK(cudaMemcpyAsync(gpus[1 - g.id].inbox, g.src, bytes, cudaMemcpyDeviceToDevice, g.copy));
        reduce_rows<kUnroll, kThreads><<<sms, kThreads, 0, g.stream>>>(
            reinterpret_cast<int4*>(g.out), reinterpret_cast<const int4*>(g.own),
            reinterpret_cast<const int4*>(landing ? g.inbox : g.spare));
        CHECK(cudaEventRecord(g.copied, g.copy));
        CHECK(cudaStreamWaitEvent(g.stream, g.copied, 0));
      });
      std::printf("  %2d SMs %6.1f (%5.1f us)", sms, static_cast<double>(kRows) * kRowBytes / round / 1e9, round * 1e6);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
}

// One thread per row watches its first and last 16 bytes (filled with 0xff beforehand) and records
// when each stops being 0xff, pausing `pause_ns` between polls.
__global__ void watch_landing(const int4* rows, uint64_t* first_at, uint64_t* last_at, int pause_ns) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= kRows) return;
  constexpr int kUnits = kRowBytes / 16;
  const int4* first = rows + static_cast<size_t>(row) * kUnits;
  const int4* last = first + kUnits - 1;
  uint64_t t_first = 0, t_last = 0;
  const uint64_t begin = global_timer_ns();
  while (t_last == 0 || t_first == 0) {
    const uint64_t now = global_timer_ns();
    if (now - begin > 20'000'000) break;
    if (t_first == 0 && ld_cg_v4(first).x != -1) t_first = now;
    if (t_last == 0 && ld_cg_v4(last).w != -1) t_last = now;
    if (pause_ns > 0) __nanosleep(pause_ns);
  }
  first_at[row] = t_first;
  last_at[row] = t_last;
}

// The order in which one 58.7 MB engine copy lands its rows in the peer: per bucket of 256 rows, the
// earliest and latest landing of the rows' first and last 16 bytes, in us after the first row landed
// (buckets of 16 rows for the first 512).
void landing_order(int pause_ns) {
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  Gpu& sender = gpus[0];
  Gpu& receiver = gpus[1];
  uint64_t *first_at, *last_at;
  CHECK(cudaSetDevice(receiver.id));
  CHECK(cudaMalloc(&first_at, kRows * sizeof(uint64_t)));
  CHECK(cudaMalloc(&last_at, kRows * sizeof(uint64_t)));
  CHECK(cudaMemset(receiver.inbox, 0xff, bytes));
  CHECK(cudaDeviceSynchronize());
  watch_landing<<<kRows / 128, 128, 0, receiver.stream>>>(reinterpret_cast<const int4*>(receiver.inbox), first_at,
                                                         last_at, pause_ns);
  CHECK(cudaSetDevice(sender.id));
  spin<<<1, 1, 0, sender.stream>>>(2'000'000);
  CHECK(cudaMemcpyAsync(receiver.inbox, sender.src, bytes, cudaMemcpyDeviceToDevice, sender.stream));
  CHECK(cudaStreamSynchronize(sender.stream));
  CHECK(cudaSetDevice(receiver.id));
  CHECK(cudaStreamSynchronize(receiver.stream));
  std::vector<uint64_t> first(kRows), last(kRows);
  CHECK(cudaMemcpy(first.data(), first_at, kRows * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(last.data(), last_at, kRows * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(first_at));
  CHECK(cudaFree(last_at));
  uint64_t origin = ~0ull;
  for (int r = 0; r < kRows; ++r)
    if (first[r] != 0) origin = std::min(origin, first[r]);
  std::printf("engine copy landing order (us after the first landed unit; watchers pause %d ns between polls): "
              "first unit min-max, last unit min-max\n", pause_ns);
  auto bucket_width = [](int row) { return row < 512 ? 16 : 256; };
  for (int b = 0; b < kRows; b += bucket_width(b)) {
    double f0 = 1e30, f1 = 0, l0 = 1e30, l1 = 0;
    const int width = bucket_width(b);
    for (int r = b; r < b + width; ++r) {
      const double f = first[r] ? (first[r] - origin) / 1e3 : -1, l = last[r] ? (last[r] - origin) / 1e3 : -1;
      f0 = std::min(f0, f), f1 = std::max(f1, f), l0 = std::min(l0, l), l1 = std::max(l1, l);
    }
    std::printf("  rows %4d-%4d  first %7.1f-%7.1f  last %7.1f-%7.1f\n", b, b + width - 1, f0, f1, l0, l1);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc < 2 ? "" : argv[1];
  int devices = 0;
  CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2 && only != "sum") {
    std::fprintf(stderr, "sm_rate %s needs two GPUs (found %d); `sm_rate sum` runs its local tables on one\n",
                 only.c_str(), devices);
    return 2;
  }
  gpus.resize(std::min(devices, 2));
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  for (int id = 0; id < static_cast<int>(gpus.size()); ++id) {
    Gpu& g = gpus[id];
    g.id = id;
    CHECK(cudaSetDevice(id));
    if (gpus.size() == 2) CHECK(cudaDeviceEnablePeerAccess(1 - id, 0));
    CHECK(cudaMalloc(&g.src, bytes));
    CHECK(cudaMalloc(&g.own, bytes));
    CHECK(cudaMalloc(&g.inbox, bytes));
    CHECK(cudaMalloc(&g.out, bytes));
    CHECK(cudaMalloc(&g.spare, bytes));
    CHECK(cudaMalloc(&g.flush, kFlushBytes));
    CHECK(cudaMalloc(&g.landed, sizeof(uint64_t)));
    CHECK(cudaMemset(g.landed, 0, sizeof(uint64_t)));
    CHECK(cudaMalloc(&g.go, 2 * sizeof(uint64_t)));
    CHECK(cudaMemset(g.go, 0, 2 * sizeof(uint64_t)));
    g.arrived = g.go + 1;
    CHECK(cudaMalloc(&g.sink, sizeof(int4)));
    CHECK(cudaMemset(g.src, id + 1, bytes));
    CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&g.copy, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&g.local, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&g.start));
    CHECK(cudaEventCreate(&g.end));
    CHECK(cudaEventCreateWithFlags(&g.copied, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&g.placed, cudaEventDisableTiming));
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s x%zu, %d rows of %d B per GPU, every GPU at once; GB/s per GPU (per SM)\n", prop.name, gpus.size(),
              kRows, kRowBytes);
  if (only == "hybrid") {
    hybrid_rows();
    return 0;
  }
  if (only == "landing") {
    landing_order(0);
    landing_order(1000);
    return 0;
  }
  // `sm_rate sum`: only the 2-rank combine's sum.
  if (only.empty() || only == "sum") {
    reduce_table<4, 512>();
    reduce_table<8, 512>();
    reduce_table<4, 1024>();
    reduce_table<8, 1024>();
    reduce_table<8, 512>(true);
    reduce_table<8, 512, true>();
    reduce_table<8, 512, true>(true);
    reduce_table<8, 512, true, true>(true);
    reduce_steps_table();
    if (gpus.size() < 2) return 0;
    reduce_beside_engine_table<8, 512>();
    reduce_beside_engine_table<8, 1024>();
    if (only == "sum") return 0;
  }
  // `sm_rate engine`: only the rows whose bytes into the peer go by copy engine.
  if (only.empty()) {
    register_table<8, 512>();
    register_table<8, 1024>();
    register_table<16, 512>();
    bulk_table(16, 4, 3584);
    bulk_table(8, 4, 7168);
    bulk_table(4, 4, 14336);
    bulk_table(32, 3, 2048);
    bulk_table(8, 3, 7168);
  }
  engine_and_sms_row(false);
  engine_and_sms_row(true);
  for (int pieces : {1, 4, 8, 16}) engine_staged_row(pieces);
  for (int runs : {1, 16, 64}) engine_direct_row(runs, false);
  for (int runs : {16, 64}) engine_direct_row(runs, true);
  hybrid_rows();
  return 0;
}
