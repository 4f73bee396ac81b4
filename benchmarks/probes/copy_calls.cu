// The host's time to ask one GPU's copy engines for N copies within its memory, by how it asks: the own
// rows of a cached dispatch at 2 ranks go by engine in one copy per run of tokens, and at 8 SMs the
// host's time per copy limits how many runs the engine can take (csrc/runtime.cu, engine_copy_budget;
// docs/design.md, "What 8 SMs can move"). Ways: N cudaMemcpyAsync; one cudaMemcpyBatchAsync of N; a
// CUDA graph of N memcpy nodes launched as it is (a call with the same tensors as the last), and with
// its N nodes' addresses set first (a call whose tensors moved); beside them, one kernel launch and
// one event record + stream wait. Runs of 1.8 MB (an FP8 run) and 3.7 MB (BF16).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/copy_calls benchmarks/probes/copy_calls.cu && /tmp/copy_calls
//
// Prints the median host time per round (the stream idle before each round) and the GPU's time of the
// round's copies, median of 200 rounds.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "probe_util.cuh"

namespace {

constexpr int kRounds = 200;

__global__ void empty_kernel() {}

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

// The copies of a round: run i of `bytes` from src + i * bytes into dst + i * bytes (two address sets,
// so that a round can use other addresses than the last).
std::vector<Copy> round_copies(uint8_t* dst, const uint8_t* src, int n, size_t bytes) {
  std::vector<Copy> copies;
  for (int i = 0; i < n; ++i) copies.push_back({dst + i * bytes, src + i * bytes, bytes});
  return copies;
}

// Median host microseconds of queueing a round, and median GPU microseconds from the round's first to
// its last queued work (events around it).
void time_round(const char* name, int n, size_t bytes, cudaStream_t stream, const std::function<void(int)>& queue) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  std::vector<double> host, gpu;
  for (int round = 0; round < kRounds + 5; ++round) {
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaEventRecord(start, stream));
    const auto t0 = std::chrono::steady_clock::now();
    queue(round);
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    if (round < 5) continue;
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    gpu.push_back(ms * 1e3);
  }
  std::sort(host.begin(), host.end());
  std::sort(gpu.begin(), gpu.end());
  std::printf("%-44s %2d x %4.1f MB   host %7.1f us (%5.1f per copy, p90 %7.1f)   GPU %7.1f us\n", name, n,
              bytes / 1e6, host[host.size() / 2], host[host.size() / 2] / std::max(1, n), host[host.size() * 9 / 10],
              gpu[gpu.size() / 2]);
  std::fflush(stdout);
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
}

void copies_table(int n, size_t bytes, cudaStream_t stream) {
  uint8_t *src, *dst;
  CHECK(cudaMalloc(&src, 2 * n * bytes));
  CHECK(cudaMalloc(&dst, 2 * n * bytes));
  CHECK(cudaMemset(src, 1, 2 * n * bytes));
  const std::vector<Copy> sets[2] = {round_copies(dst, src, n, bytes),
                                     round_copies(dst + n * bytes, src + n * bytes, n, bytes)};

  time_round("cudaMemcpyAsync each", n, bytes, stream, [&](int round) {
    for (const Copy& c : sets[round & 1]) CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream));
  });

  time_round("cudaMemcpyBatchAsync of all", n, bytes, stream, [&](int round) {
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    for (const Copy& c : sets[round & 1]) dsts.push_back(c.dst), srcs.push_back(c.src), sizes.push_back(c.bytes);
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attributes, &first, 1, stream));
  });

  // One graph of n memcpy nodes without edges (the copies may run at once; on a stream they run in turn).
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  std::vector<cudaGraphNode_t> nodes(n);
  for (int i = 0; i < n; ++i)
    CHECK(cudaGraphAddMemcpyNode1D(&nodes[i], graph, nullptr, 0, sets[0][i].dst, sets[0][i].src, bytes,
                                   cudaMemcpyDeviceToDevice));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  time_round("graph of memcpy nodes, launched", n, bytes, stream, [&](int) { CHECK(cudaGraphLaunch(exec, stream)); });
  time_round("graph of memcpy nodes, addresses set, launched", n, bytes, stream, [&](int round) {
    const std::vector<Copy>& set = sets[round & 1];
    for (int i = 0; i < n; ++i)
      CHECK(cudaGraphExecMemcpyNodeSetParams1D(exec, nodes[i], set[i].dst, set[i].src, set[i].bytes,
                                               cudaMemcpyDeviceToDevice));
    CHECK(cudaGraphLaunch(exec, stream));
  });
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
}

}  // namespace

int main() {
  cudaStream_t stream, other;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: the host's time to queue a round, median of %d rounds\n", prop.name, kRounds);
  time_round("one empty kernel launch", 1, 0, stream, [&](int) { empty_kernel<<<1, 32, 0, stream>>>(); });
  cudaEvent_t fork;
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  time_round("event record + stream wait", 1, 0, stream, [&](int) {
    CHECK(cudaEventRecord(fork, stream));
    CHECK(cudaStreamWaitEvent(other, fork, 0));
  });
  for (const size_t bytes : {size_t{1835008}, size_t{3670016}})
    for (const int n : {5, 16}) copies_table(n, bytes, stream);
  return 0;
}
