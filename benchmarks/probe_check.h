// Error checks shared by the standalone probes in benchmarks/ (each builds with one nvcc command).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// Exits with the file, line and CUDA runtime error when `call` fails.
#define CHECK(call)                                                                               \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));          \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// The same for a driver API call (CUresult).
#define CHECK_CU(call)                                                                            \
  do {                                                                                            \
    CUresult res_ = (call);                                                                       \
    if (res_ != CUDA_SUCCESS) {                                                                   \
      std::fprintf(stderr, "%s:%d: CUresult %d\n", __FILE__, __LINE__, static_cast<int>(res_));  \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)
