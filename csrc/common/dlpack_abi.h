// The DLPack exchange structs (the unversioned ABI that torch.from_dlpack takes as a "dltensor" capsule),
// declared from the DLPack specification: enough to hand out uint8 tensors over memory we own.
#pragma once

#include <cstdint>

namespace ep_plugin::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2 };
enum TypeCode : uint8_t { kUInt = 1 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

}  // namespace ep_plugin::dlpack
