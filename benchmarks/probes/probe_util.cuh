// What the standalone probes share (they are compiled on their own, outside the library).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

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
