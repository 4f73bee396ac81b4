// Host-side checks that survive release builds: every failure throws with file:line.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "text.h"

namespace ep_plugin {

// Bad arguments (reported to Python as ValueError).
class InvalidArgument : public std::invalid_argument {
 public:
  explicit InvalidArgument(const std::string& message) : std::invalid_argument(message) {}
};

// A peer did not answer in time (reported to Python as TimeoutError).
class TimeoutError : public std::runtime_error {
 public:
  explicit TimeoutError(const std::string& message) : std::runtime_error(message) {}
};

// Anything else that went wrong (reported to Python as RuntimeError).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

inline std::string where(const char* file, int line) {
  Text out;
  out << file << ":" << line;
  return out.str();
}

}  // namespace ep_plugin

#define EP_HOST_ASSERT(cond, message)                                                                \
  do {                                                                                               \
    if (!(cond)) {                                                                                   \
      ep_plugin::Text ep_out_;                                                                       \
      ep_out_ << message << " [" #cond " failed at " << ep_plugin::where(__FILE__, __LINE__) << "]"; \
      throw ep_plugin::Error(ep_out_.str());                                                         \
    }                                                                                                \
  } while (0)

#define EP_CHECK_ARG(cond, message)                    \
  do {                                                 \
    if (!(cond)) {                                     \
      ep_plugin::Text ep_out_;                         \
      ep_out_ << message;                              \
      throw ep_plugin::InvalidArgument(ep_out_.str()); \
    }                                                  \
  } while (0)

#define CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                    \
    cudaError_t ep_err_ = (expr);                                                                         \
    if (ep_err_ != cudaSuccess) {                                                                         \
      ep_plugin::Text ep_out_;                                                                            \
      ep_out_ << #expr << " failed: " << cudaGetErrorName(ep_err_) << " (" << cudaGetErrorString(ep_err_) \
              << ") at " << ep_plugin::where(__FILE__, __LINE__);                                         \
      throw ep_plugin::Error(ep_out_.str());                                                              \
    }                                                                                                     \
  } while (0)
