// Shared by the pybind11 faces (python_api.cpp, python_api_nvshmem.cpp): tensors cross as device
// addresses (ints); each is checked for presence and alignment, naming the argument.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "exception.cuh"

namespace ep_plugin {

template <typename T>
T* pointer(uintptr_t address, const char* name, bool required = true, int alignment = alignof(T)) {
  EP_CHECK_ARG(!required || address != 0, name << " is required (got a null address)");
  EP_CHECK_ARG(address % alignment == 0, name << " must be " << alignment << "-byte aligned");
  return reinterpret_cast<T*>(address);
}

inline cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace ep_plugin
