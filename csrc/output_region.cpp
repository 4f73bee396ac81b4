#include "output_region.h"

#include "common/exception.cuh"
#include "common/text.h"

namespace ep_plugin {

ReleaseEvent::ReleaseEvent(int device, cudaStream_t stream) {
  // NOTE: a tensor may die on any thread (the event must be made on the stream's device), and inside
  // torch's storage destructor, where nothing may throw: on a CUDA error (the runtime unloading at exit)
  // the block is released without an event.
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || (current != device && cudaSetDevice(device) != cudaSuccess)) {
    (void)cudaGetLastError();
    return;
  }
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    event = nullptr;
  } else if (cudaEventRecord(event, stream) != cudaSuccess) {
    (void)cudaEventDestroy(event);
    event = nullptr;
  }
  if (current != device) (void)cudaSetDevice(current);
  (void)cudaGetLastError();
}

ReleaseEvent::~ReleaseEvent() {
  if (event != nullptr) (void)cudaEventDestroy(event);  // at process exit the context may be gone
}

OutputRegionAllocator::OutputRegionAllocator(uintptr_t address, int64_t size, int device)
    : address_(address), device_(device), ranges_(size) {
  EP_CHECK_ARG(address % kRegionAlignment == 0, "the output region must be " << kRegionAlignment << "-byte aligned");
  EP_CHECK_ARG(size >= 0, "the output region's size must be >= 0, got " << size);
}

std::optional<std::vector<OutputRegionAllocator::Tensor>> OutputRegionAllocator::allocate(
    const std::vector<std::vector<int64_t>>& byte_shapes, uintptr_t stream) {
  EP_CHECK_ARG(!byte_shapes.empty(), "an output block needs at least one tensor");
  std::vector<int64_t> starts;
  int64_t nbytes = 0;
  for (const auto& shape : byte_shapes) {
    int64_t bytes = 1;
    for (int64_t extent : shape) {
      EP_CHECK_ARG(extent >= 0, "output shapes must not be negative");
      bytes *= extent;
    }
    starts.push_back(nbytes);
    nbytes += region_bytes_for(bytes);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = ranges_.allocate(nbytes);
  if (!found) return std::nullopt;
  if (device_ >= 0) {
    for (const auto& [other, pending] : found->pending)
      if (other != stream && pending.marker && pending.marker->event != nullptr)
        CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), pending.marker->event, 0));
  }
  blocks_[found->offset] = Block{nbytes, static_cast<int>(byte_shapes.size()), stream};
  std::vector<Tensor> tensors;
  for (size_t i = 0; i < byte_shapes.size(); ++i)
    tensors.push_back(Tensor{reinterpret_cast<void*>(address_ + found->offset + starts[i]), byte_shapes[i]});
  return tensors;
}

void OutputRegionAllocator::release_tensor(int64_t block_offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(block_offset);
  if (it == blocks_.end() || --it->second.tensors_alive > 0) return;
  const Block block = it->second;
  blocks_.erase(it);
  // NOTE: the event marks the work queued on the allocation stream so far, which includes every use of
  // the tensors on it; a user of another stream must have recorded that stream's work (as with torch).
  std::shared_ptr<ReleaseEvent> event;
  if (device_ >= 0) event = std::make_shared<ReleaseEvent>(device_, reinterpret_cast<cudaStream_t>(block.stream));
  ranges_.release(block_offset, block.nbytes, block.stream, std::move(event));
}

std::string OutputRegionAllocator::describe() {
  std::lock_guard<std::mutex> lock(mutex_);
  Text out;
  out << ranges_.free_bytes() << " of " << ranges_.size() << " bytes free, the largest free block "
      << ranges_.largest_free() << " bytes";
  return out.str();
}

int64_t OutputRegionAllocator::largest_free() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ranges_.largest_free();
}

}  // namespace ep_plugin
