// The copy-engine combine's reduction (staged_reduce_kernel, 2 ranks) alone, on one GPU: rank 0's
// kernel with every staged row already landed, so that it times the owner's sum and nothing of the
// copy beside it (at 8 SMs the sum, not the copy, bounds the EP2 combine: docs/design.md, "What 8
// SMs can move"). Both "ranks'" buffers are in this GPU's memory; rank 1 is never run, its words in
// rank 0's header are set as its kernel and copies would leave them.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I csrc -I /usr/local/cuda/include/cccl -o /tmp/staged_reduce \
//     benchmarks/probes/staged_reduce.cu && /tmp/staged_reduce
//
// 4096 tokens x 7168 bf16, top-8 of 256 experts (128 per rank), random routing; L2 flushed before each
// round as `ep-plugin bench` does. Checks the outputs (rows and summed weights) against the host's sum
// first, then prints the median of 9 rounds by SM count beside the bytes it moves.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/intranode_staged_combine.cu"
#include "probe_util.cuh"

namespace {

using namespace ep_plugin;
using namespace ep_plugin::intranode;

constexpr int kTokens = 4096;
constexpr int kHidden = 7168;
constexpr int kTopk = 8;
constexpr int kExperts = 256;
constexpr uint32_t kEpoch = 1;
constexpr size_t kFlushBytes = 256u << 20;

uint16_t to_bf16(float f) {  // round to nearest even (no NaNs here)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Token t's row in rank 0's own block and in rank 1's block for rank 0 (-1: no copy there).
struct Routing {
  std::vector<int32_t> send_pos;  // [T, 2]
  int own_rows = 0, staged_rows = 0;
};

Routing random_routing(std::mt19937& rng) {
  Routing r;
  r.send_pos.assign(2 * kTokens, -1);
  std::vector<int> experts(kExperts);
  for (int e = 0; e < kExperts; ++e) experts[e] = e;
  for (int t = 0; t < kTokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    bool on[2] = {false, false};
    for (int k = 0; k < kTopk; ++k) on[experts[k] / (kExperts / 2)] = true;
    if (on[0]) r.send_pos[2 * t] = r.own_rows++;
    if (on[1]) r.send_pos[2 * t + 1] = r.staged_rows++;
  }
  return r;
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* d;
  CHECK(cudaMalloc(&d, std::max<size_t>(1, host.size()) * sizeof(T)));
  CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<uint16_t> random_rows(std::mt19937& rng, int rows) {
  std::uniform_real_distribution<float> value(-2.f, 2.f);
  std::vector<uint16_t> out(static_cast<size_t>(rows) * kHidden);
  for (auto& v : out) v = to_bf16(value(rng));
  return out;
}

}  // namespace

int main() {
  std::mt19937 rng(2026);
  const Routing routing = random_routing(rng);
  // Rank 0's combine input: its own rows, then the rows it received from rank 1 (which go back by copy).
  const int back_rows = routing.staged_rows;  // a balanced routing: as many as it gets
  const int x_rows = routing.own_rows + back_rows;
  const std::vector<uint16_t> x = random_rows(rng, x_rows);
  const std::vector<uint16_t> staged = random_rows(rng, routing.staged_rows);
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  std::vector<float> x_weights(static_cast<size_t>(x_rows) * kTopk), staged_weights(routing.staged_rows * kTopk);
  for (auto& w : x_weights) w = weight(rng);
  for (auto& w : staged_weights) w = weight(rng);

  // Both ranks' buffers: a header, then a staging area of 8 slots of 512 rows per peer (4096 rows, `auto`).
  const int64_t row_bytes = 2LL * kHidden;
  const int64_t per_peer = 8LL * kStagingRowsPerPiece * (row_bytes + kMaxTopk * 4);
  const StagingLayout layout = StagingLayout::fit(2, kHeaderBytes, per_peer, row_bytes);
  void* buffers[2];
  for (auto& b : buffers) {
    CHECK(cudaMalloc(&b, kHeaderBytes + per_peer));
    CHECK(cudaMemset(b, 0, kHeaderBytes));
  }
  uint8_t* region = static_cast<uint8_t*>(buffers[0]) + layout.region_offset(0, 1);
  CHECK(cudaMemcpy(region, staged.data(), staged.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(region + layout.weights_offset(0, kTopk), staged_weights.data(), staged_weights.size() * 4,
                   cudaMemcpyHostToDevice));
  static Header words{};
  words.staged_rows[1] = staged_word(kEpoch, routing.staged_rows);
  words.staged_base[1] = staged_word(kEpoch, 0);
  words.staged_landed[1] = staged_word(kEpoch, routing.staged_rows);
  words.staged_weights_landed[1] = staged_word(kEpoch, 1);
  CHECK(cudaMemcpy(buffers[0], &words, sizeof(words), cudaMemcpyHostToDevice));

  StagedReduceArgs a{};
  a.peer_buffers = device_copy(std::vector<void*>{buffers[0], buffers[1]});
  a.rank = 0;
  a.num_ranks = 2;
  a.staging_offset = kHeaderBytes;
  a.staging_bytes = per_peer;
  a.epoch = kEpoch;
  a.num_tokens = kTokens;
  a.hidden = kHidden;
  a.num_topk = kTopk;
  a.x = device_copy(x);
  a.topk_weights = device_copy(x_weights);
  a.send_pos = device_copy(routing.send_pos);
  uint16_t* combined;
  CHECK(cudaMalloc(&combined, static_cast<size_t>(kTokens) * row_bytes));
  a.combined_x = combined;
  CHECK(cudaMalloc(&a.combined_topk_weights, kTokens * kTopk * sizeof(float)));
  a.send_first[0] = 0, a.send_rows[0] = routing.own_rows;
  a.send_first[1] = routing.own_rows, a.send_rows[1] = back_rows;
  CHECK(cudaMalloc(&a.status, sizeof(DeviceStatus)));
  CHECK(cudaMemset(a.status, 0, sizeof(DeviceStatus)));
  a.timeout_ns = 10'000'000'000ull;

  // Outputs poisoned, one run at 24 SMs, checked: two copies sum in bf16x2 (the exact sum rounded once).
  CHECK(cudaMemset(combined, 0xee, static_cast<size_t>(kTokens) * row_bytes));
  launch_staged_reduce(a, 24, nullptr);
  CHECK(cudaDeviceSynchronize());
  DeviceStatus status;
  CHECK(cudaMemcpy(&status, a.status, sizeof(status), cudaMemcpyDeviceToHost));
  if (status.error_code != kErrNone) {
    std::printf("staged_reduce: the kernel reported error %d (wait kind %d)\n", status.error_code,
                status.error_wait_kind);
    return 1;
  }
  std::vector<uint16_t> out(static_cast<size_t>(kTokens) * kHidden);
  std::vector<float> out_weights(kTokens * kTopk);
  CHECK(cudaMemcpy(out.data(), combined, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(out_weights.data(), a.combined_topk_weights, out_weights.size() * 4, cudaMemcpyDeviceToHost));
  long long wrong = 0;
  for (int t = 0; t < kTokens; ++t) {
    const int own = routing.send_pos[2 * t], stage = routing.send_pos[2 * t + 1];
    for (int h = 0; h < kHidden; ++h) {
      double sum = 0;
      if (own >= 0) sum += from_bf16(x[static_cast<size_t>(own) * kHidden + h]);
      if (stage >= 0) sum += from_bf16(staged[static_cast<size_t>(stage) * kHidden + h]);
      wrong += out[static_cast<size_t>(t) * kHidden + h] != to_bf16(static_cast<float>(sum));
    }
    for (int k = 0; k < kTopk; ++k) {
      float sum = 0.f;
      if (own >= 0) sum += x_weights[own * kTopk + k];
      if (stage >= 0) sum += staged_weights[stage * kTopk + k];
      wrong += out_weights[t * kTopk + k] != sum;
    }
  }
  std::printf("staged_reduce: %d tokens x %d, own rows %d, staged rows %d; check: %lld wrong values\n", kTokens,
              kHidden, routing.own_rows, routing.staged_rows, wrong);
  if (wrong != 0) return 1;

  struct One {
    int id = 0;
    cudaStream_t stream;
    cudaEvent_t start, end;
  } gpu[1];
  CHECK(cudaStreamCreateWithFlags(&gpu[0].stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&gpu[0].start));
  CHECK(cudaEventCreate(&gpu[0].end));
  void* flush;
  CHECK(cudaMalloc(&flush, kFlushBytes));
  // Bytes of HBM traffic: both copies read, one row written.
  const double bytes = static_cast<double>(routing.own_rows + routing.staged_rows + kTokens) * row_bytes;
  StagedReduceArgs without_weights = a;
  without_weights.topk_weights = nullptr;
  without_weights.combined_topk_weights = nullptr;
  for (int sms : {8, 16, 24}) {
    for (const bool weights : {true, false}) {
      const double ms = median_round_ms(gpu, 9, [&](One& g) {
        CHECK(cudaMemsetAsync(flush, 0, kFlushBytes, g.stream));
        spin<<<1, 1, 0, g.stream>>>(4'000'000);
        CHECK(cudaEventRecord(g.start, g.stream));
      }, [&](One& g) {
        launch_staged_reduce(weights ? a : without_weights, sms, g.stream);
        CHECK(cudaEventRecord(g.end, g.stream));
      });
      std::printf("staged_reduce %2d SMs, %-15s %7.1f us  %6.1f GB/s of traffic (%5.1f per SM)\n", sms,
                  weights ? "top-k weights" : "no weights", ms * 1e3, bytes / ms / 1e6, bytes / ms / 1e6 / sms);
    }
  }
  return 0;
}
