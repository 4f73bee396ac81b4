#include "output_region.h"

#include "common/exception.cuh"
#include "common/text.h"

namespace ep_plugin {

namespace {

// `stream` waits for the work queued so far on `other`, both streams of `device`.
void wait_for_stream(int device, cudaStream_t stream, cudaStream_t other) {
  int current = 0;
  CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) CUDA_CHECK(cudaSetDevice(device));  // the event must be made on the streams' device
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, other);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(stream, event, 0) : recorded;
  (void)cudaEventDestroy(event);  // released once the wait no longer needs it
  if (current != device) CUDA_CHECK(cudaSetDevice(current));
  CUDA_CHECK(waited);
}

}  // namespace

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
    // NOTE: what `other` queued since its release is waited for too: more than needed, never less. A
    // stream that allocated here must live until its blocks are reused elsewhere (torch's streams live
    // for the process).
    for (const auto& [other, pending] : found->pending)
      if (other != stream) wait_for_stream(device_, reinterpret_cast<cudaStream_t>(stream),
                                           reinterpret_cast<cudaStream_t>(other));
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
  // NOTE: the allocation stream's work includes every use of the tensors on it; a user of another stream
  // must have recorded that stream's work (as with torch). Another stream that takes the block later
  // waits for the allocation stream then (allocate).
  ranges_.release(block_offset, block.nbytes, block.stream, true);
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
