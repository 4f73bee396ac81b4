// What the standalone probes share (they are compiled on their own, outside the library).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

// Exits with the file, line and CUDA error when `call` fails.
#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// Holds a GPU for `cycles` while the host queues a round behind it.
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Median milliseconds of `rounds` rounds (after 2 warm-up rounds) of the slower GPU. Each round
// waits for every GPU to idle; `begin_round(g)` then queues a `spin` and records g.start on every GPU,
// so that the GPUs start together once the host has queued all of it, and `queue_round(g)` queues GPU
// g's work and records g.end.
template <typename Gpus, typename BeginRound, typename QueueRound>
double median_round_ms(Gpus& gpus, int rounds, BeginRound begin_round, QueueRound queue_round) {
  std::vector<double> times;
  for (int round = 0; round < rounds + 2; ++round) {
    for (auto& g : gpus) {
      CHECK(cudaSetDevice(g.id));
      CHECK(cudaDeviceSynchronize());
    }
    for (auto& g : gpus) {
      CHECK(cudaSetDevice(g.id));
      begin_round(g);
    }
    for (auto& g : gpus) {
      CHECK(cudaSetDevice(g.id));
      queue_round(g);
      CHECK(cudaGetLastError());
    }
    double slowest = 0;
    for (auto& g : gpus) {
      CHECK(cudaSetDevice(g.id));
      CHECK(cudaEventSynchronize(g.end));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, g.start, g.end));
      slowest = std::max(slowest, static_cast<double>(ms));
    }
    if (round >= 2) times.push_back(slowest);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}
