// The copy-engine combine's reduction alone, every staged row already landed, so that it times the owner's
// sum and nothing of the copies beside it: rank 0's kernel of R ranks (2 unless given), its peers never
// run, their words in rank 0's header set as their kernels and copies would leave them.
// - staged (default): staged_reduce_kernel on one GPU, every "rank's" buffer in its memory (at 8 SMs the sum,
//   not the copy, bounds the EP2 combine: docs/design.md, "What 8 SMs can move").
// - pulled: pulled_reduce_kernel (pull_rows, 3-4 ranks) on two GPUs at once, each the owner of its own
//   combine whose senders' regions lie on the other GPU: R - 1 blocks pulled over NVLink per GPU, an EP-R
//   owner's bytes through one GPU's links (docs/design.md, "Pulled by the owners").
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I csrc -I /usr/local/cuda/include/cccl -o /tmp/staged_reduce \
//     benchmarks/probes/staged_reduce.cu && /tmp/staged_reduce [ranks] [pulled]
//
// 4096 tokens x 7168 bf16, top-8 of 256 experts (256 / R per rank), random routing; L2 flushed before each
// round as `ep-plugin bench` does. Checks the outputs (rows and summed weights) against the host's sum
// first, then prints the median of 9 rounds (the slower GPU's) by SM count beside the bytes it moves.
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

// Token t's row in each rank's block for rank 0 (-1: no copy there); block 0 is rank 0's own.
struct Routing {
  int num_ranks = 2;
  std::vector<int32_t> send_pos;  // [T, R]
  std::vector<int> rows;          // [R]: rows of each block
};

Routing random_routing(std::mt19937& rng, int num_ranks) {
  Routing r;
  r.num_ranks = num_ranks;
  r.send_pos.assign(static_cast<size_t>(num_ranks) * kTokens, -1);
  r.rows.assign(num_ranks, 0);
  std::vector<int> experts(kExperts);
  for (int e = 0; e < kExperts; ++e) experts[e] = e;
  for (int t = 0; t < kTokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::vector<bool> on(num_ranks, false);
    for (int k = 0; k < kTopk; ++k) on[experts[k] / (kExperts / num_ranks)] = true;
    for (int q = 0; q < num_ranks; ++q)
      if (on[q]) r.send_pos[static_cast<size_t>(t) * num_ranks + q] = r.rows[q]++;
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

// One owner: rank 0 of a combine on GPU `id`.
struct Owner {
  int id = 0;
  cudaStream_t stream;
  cudaEvent_t start, end;
  StagedReduceArgs args{};
  void* flush = nullptr;
};

// Rank 0's combine input and the rows its peers staged for it.
struct Inputs {
  std::vector<uint16_t> x;
  std::vector<float> x_weights;
  std::vector<std::vector<uint16_t>> staged;
  std::vector<std::vector<float>> staged_weights;
};

Inputs random_inputs(std::mt19937& rng, const Routing& routing) {
  const int R = routing.num_ranks;
  // Rank 0's combine input: its own rows, then the rows it received from each peer (which go back by
  // copy); a balanced routing: as many from each peer as rank 0 gets from it.
  int x_rows = 0;
  for (int q = 0; q < R; ++q) x_rows += routing.rows[q];
  Inputs in;
  in.x = random_rows(rng, x_rows);
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  in.x_weights.resize(static_cast<size_t>(x_rows) * kTopk);
  for (auto& w : in.x_weights) w = weight(rng);
  in.staged.resize(R);
  in.staged_weights.resize(R);
  for (int q = 1; q < R; ++q) {
    in.staged[q] = random_rows(rng, routing.rows[q]);
    in.staged_weights[q].resize(static_cast<size_t>(routing.rows[q]) * kTopk);
    for (auto& w : in.staged_weights[q]) w = weight(rng);
  }
  return in;
}

// Owner `id`'s buffers (its own on GPU id; pulled: the peers' on the other GPU), the staged rows in their
// regions and rank 0's header as the peers' kernels and copies would leave it: every row and weight landed.
Owner set_up_owner(int id, const Routing& routing, const Inputs& in, const StagingLayout& layout,
                   int64_t staging_bytes, bool pulled) {
  const int R = routing.num_ranks;
  Owner o;
  o.id = id;
  std::vector<void*> buffers(R);
  for (int q = 0; q < R; ++q) {
    CHECK(cudaSetDevice(q == 0 || !pulled ? id : 1 - id));
    CHECK(cudaMalloc(&buffers[q], kHeaderBytes + staging_bytes));
    CHECK(cudaMemset(buffers[q], 0, kHeaderBytes));
  }
  CHECK(cudaSetDevice(id));
  Header words{};
  for (int q = 1; q < R; ++q) {
    uint8_t* region = static_cast<uint8_t*>(buffers[layout.region_home(0, q, pulled)]) +
                      layout.staged_region_offset(0, q, pulled);
    CHECK(cudaMemcpy(region, in.staged[q].data(), in.staged[q].size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(region + layout.weights_offset(0, kTopk), in.staged_weights[q].data(),
                     in.staged_weights[q].size() * 4, cudaMemcpyHostToDevice));
    words.staged_rows[q] = staged_word(kEpoch, routing.rows[q]);
    words.staged_base[q] = staged_word(kEpoch, 0);
    words.staged_landed[q] = staged_word(kEpoch, routing.rows[q]);
    words.staged_weights_landed[q] = staged_word(kEpoch, 1);
  }
  CHECK(cudaMemcpy(buffers[0], &words, sizeof(words), cudaMemcpyHostToDevice));
  StagedReduceArgs& a = o.args;
  a.peer_buffers = device_copy(buffers);
  a.rank = 0;
  a.num_ranks = R;
  a.staging_offset = kHeaderBytes;
  a.staging_bytes = staging_bytes;
  a.epoch = kEpoch;
  a.pull_rows = pulled;
  a.num_tokens = kTokens;
  a.hidden = kHidden;
  a.num_topk = kTopk;
  a.x = device_copy(in.x);
  a.topk_weights = device_copy(in.x_weights);
  a.send_pos = device_copy(routing.send_pos);
  CHECK(cudaMalloc(&a.combined_x, static_cast<size_t>(kTokens) * 2 * kHidden));
  CHECK(cudaMalloc(&a.combined_topk_weights, kTokens * kTopk * sizeof(float)));
  for (int q = 0, first = 0; q < R; first += routing.rows[q], ++q) a.send_first[q] = first, a.send_rows[q] = routing.rows[q];
  CHECK(cudaMalloc(&a.status, sizeof(DeviceStatus)));
  CHECK(cudaMemset(a.status, 0, sizeof(DeviceStatus)));
  a.timeout_ns = 10'000'000'000ull;
  CHECK(cudaStreamCreateWithFlags(&o.stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&o.start));
  CHECK(cudaEventCreate(&o.end));
  CHECK(cudaMalloc(&o.flush, kFlushBytes));
  return o;
}

// Wrong values of owner o's outputs (poisoned, one run at 24 SMs) against the copies summed in fp32 in rank
// order and rounded once (two copies: their bf16x2 sum is that too); -1 if the kernel reported an error.
long long check_owner(Owner& o, const Routing& routing, const Inputs& in) {
  const int R = routing.num_ranks;
  CHECK(cudaSetDevice(o.id));
  CHECK(cudaMemset(o.args.combined_x, 0xee, static_cast<size_t>(kTokens) * 2 * kHidden));
  launch_staged_reduce(o.args, 24, o.stream);
  CHECK(cudaDeviceSynchronize());
  DeviceStatus status;
  CHECK(cudaMemcpy(&status, o.args.status, sizeof(status), cudaMemcpyDeviceToHost));
  if (status.error_code != kErrNone) {
    std::printf("staged_reduce: GPU %d: the kernel reported error %d (wait kind %d)\n", o.id, status.error_code,
                status.error_wait_kind);
    return -1;
  }
  std::vector<uint16_t> out(static_cast<size_t>(kTokens) * kHidden);
  std::vector<float> out_weights(kTokens * kTopk);
  CHECK(cudaMemcpy(out.data(), o.args.combined_x, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(out_weights.data(), o.args.combined_topk_weights, out_weights.size() * 4, cudaMemcpyDeviceToHost));
  long long wrong = 0;
  for (int t = 0; t < kTokens; ++t) {
    const int32_t* pos = &routing.send_pos[static_cast<size_t>(t) * R];
    for (int h = 0; h < kHidden; ++h) {
      float sum = 0.f;
      for (int q = 0; q < R; ++q)
        if (pos[q] >= 0) sum += from_bf16((q == 0 ? in.x : in.staged[q])[static_cast<size_t>(pos[q]) * kHidden + h]);
      wrong += out[static_cast<size_t>(t) * kHidden + h] != to_bf16(sum);
    }
    for (int k = 0; k < kTopk; ++k) {
      float sum = 0.f;
      for (int q = 0; q < R; ++q)
        if (pos[q] >= 0) sum += (q == 0 ? in.x_weights : in.staged_weights[q])[static_cast<size_t>(pos[q]) * kTopk + k];
      wrong += out_weights[t * kTopk + k] != sum;
    }
  }
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const int R = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool pulled = argc > 2 && std::strcmp(argv[2], "pulled") == 0;
  const int max_ranks = pulled ? kMaxPulledRanks : kMaxNvlPeers;
  if (R < 2 || R > max_ranks || kExperts % R != 0 || (argc > 2 && !pulled)) {
    std::printf("usage: staged_reduce [ranks: 2 to %d, dividing %d experts] [pulled: at most %d ranks, 2 GPUs]\n",
                kMaxNvlPeers, kExperts, kMaxPulledRanks);
    return 2;
  }
  std::mt19937 rng(2026);
  const Routing routing = random_routing(rng, R);
  const Inputs in = random_inputs(rng, routing);
  // Every rank's buffer: a header, then a staging area of 8 slots of 512 rows per peer (4096 rows, `auto`).
  const int64_t row_bytes = 2LL * kHidden;
  const int64_t per_peer = 8LL * kStagingRowsPerPiece * (row_bytes + kMaxTopk * 4);
  const int64_t staging_bytes = per_peer * (R - 1);
  const StagingLayout layout = StagingLayout::fit(R, kHeaderBytes, staging_bytes, row_bytes);
  if (pulled)
    for (int id = 0; id < 2; ++id) {
      CHECK(cudaSetDevice(id));
      CHECK(cudaDeviceEnablePeerAccess(1 - id, 0));
    }
  std::vector<Owner> owners;
  for (int id = 0; id < (pulled ? 2 : 1); ++id) owners.push_back(set_up_owner(id, routing, in, layout, staging_bytes, pulled));
  long long copies = 0, pulled_rows = 0;
  for (int t = 0; t < kTokens; ++t)
    for (int q = 0; q < R; ++q) copies += routing.send_pos[static_cast<size_t>(t) * R + q] >= 0;
  for (int q = 1; q < R; ++q) pulled_rows += routing.rows[q];
  for (Owner& o : owners) {
    const long long wrong = check_owner(o, routing, in);
    std::printf("staged_reduce: %d ranks%s, GPU %d, %d tokens x %d, %lld copies (own %d); check: %lld wrong values\n", R,
                pulled ? " pulled" : "", o.id, kTokens, kHidden, copies, routing.rows[0], wrong);
    if (wrong != 0) return 1;
  }

  // Bytes of HBM traffic: every copy read, one row written; pulled: the bytes read across NVLink.
  const double bytes = pulled ? static_cast<double>(pulled_rows) * row_bytes : static_cast<double>(copies + kTokens) * row_bytes;
  for (int sms : {8, 16, 24, 32}) {
    for (const bool weights : {true, false}) {
      const double ms = median_round_ms(owners, 9, [&](Owner& o) {
        CHECK(cudaMemsetAsync(o.flush, 0, kFlushBytes, o.stream));
        spin<<<1, 1, 0, o.stream>>>(4'000'000);
        CHECK(cudaEventRecord(o.start, o.stream));
      }, [&](Owner& o) {
        StagedReduceArgs a = o.args;
        if (!weights) a.topk_weights = nullptr, a.combined_topk_weights = nullptr;
        launch_staged_reduce(a, sms, o.stream);
        CHECK(cudaEventRecord(o.end, o.stream));
      });
      std::printf("staged_reduce %d ranks%s %2d SMs, %-15s %7.1f us  %6.1f GB/s %s (%5.1f per SM)\n", R,
                  pulled ? " pulled" : "", sms, weights ? "top-k weights" : "no weights", ms * 1e3, bytes / ms / 1e6,
                  pulled ? "over NVLink" : "of traffic", bytes / ms / 1e6 / sms);
    }
  }
  return 0;
}
