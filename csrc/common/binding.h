// Shared by the pybind11 faces (python_api.cpp, python_api_nvshmem.cpp) and the runtimes that
// validate what they receive: tensors cross as device addresses (ints); each is checked for presence
// and alignment, naming the argument.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "exception.cuh"

namespace ep_plugin {

template <typename T>
constexpr int natural_alignment() {
  if constexpr (std::is_void_v<std::remove_cv_t<T>>) return 1;
  else return alignof(T);
}

// Throws, naming the argument, unless `address` is present (when required) and aligned.
inline void check_address(uintptr_t address, const char* name, bool required, int alignment) {
  EP_CHECK_ARG(!required || address != 0, name << " is required (got a null address)");
  EP_CHECK_ARG(address % alignment == 0, name << " must be " << alignment << "-byte aligned");
}

template <typename T>
void check_pointer(T* address, const char* name, bool required = true, int alignment = natural_alignment<T>()) {
  check_address(reinterpret_cast<uintptr_t>(address), name, required, alignment);
}

template <typename T>
T* pointer(uintptr_t address, const char* name, bool required = true, int alignment = natural_alignment<T>()) {
  check_address(address, name, required, alignment);
  return reinterpret_cast<T*>(address);
}

inline cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace ep_plugin
