// The output region's allocator: dispatch outputs that peers write directly (buffer.dispatch_output_bytes).
//
// The region is the end of this rank's NVLink buffer. A direct dispatch allocates its outputs here and
// hands them to torch as DLPack tensors whose deleter returns the block, so a block is free again when
// the last tensor on it dies. Like torch's caching allocator, a freed block is reused at once on the
// stream it was allocated on, and on another stream only after that stream waits for the first one's
// work: an event recorded on the first stream when the other allocates, which covers all that was
// queued at the free. A free makes no CUDA call (it may run inside any tensor's destructor, on any thread).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ep_plugin {

constexpr int64_t kRegionAlignment = 256;

inline int64_t region_bytes_for(int64_t nbytes) {
  const int64_t aligned = (nbytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
  return aligned < kRegionAlignment ? kRegionAlignment : aligned;
}

// First-fit aligned byte ranges of [0, size) with coalescing frees. Each free range remembers, per
// stream, the latest release's marker: what an allocation on another stream must wait for. No CUDA.
template <typename Marker>
class RegionRanges {
 public:
  struct Pending {
    uint64_t order;  // releases are numbered; per stream the later one covers the earlier
    Marker marker;
  };
  using PendingByStream = std::map<uintptr_t, Pending>;
  struct Allocation {
    int64_t offset;
    PendingByStream pending;  // of the free range the block came from
  };

  explicit RegionRanges(int64_t size) : size_(size) {
    if (size > 0) free_.emplace(0, FreeRange{size, {}});
  }

  std::optional<Allocation> allocate(int64_t nbytes) {
    const int64_t need = region_bytes_for(nbytes);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second.size < need) continue;
      Allocation found{it->first, it->second.pending};
      if (it->second.size > need) free_.emplace(it->first + need, FreeRange{it->second.size - need, it->second.pending});
      free_.erase(it);
      return found;
    }
    return std::nullopt;
  }

  // Frees the block allocated at `offset` with `nbytes`; `marker` is what users of other streams wait for.
  void release(int64_t offset, int64_t nbytes, uintptr_t stream, Marker marker) {
    FreeRange range{region_bytes_for(nbytes), {{stream, Pending{++releases_, std::move(marker)}}}};
    auto next = free_.lower_bound(offset);
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size == offset) {
        offset = prev->first;
        range = FreeRange{prev->second.size + range.size, merged(prev->second.pending, range.pending)};
        free_.erase(prev);
      }
    }
    if (next != free_.end() && offset + range.size == next->first) {
      range = FreeRange{range.size + next->second.size, merged(range.pending, next->second.pending)};
      free_.erase(next);
    }
    free_.emplace(offset, std::move(range));
  }

  int64_t size() const { return size_; }
  int64_t free_bytes() const {
    int64_t total = 0;
    for (const auto& [offset, range] : free_) total += range.size;
    return total;
  }
  int64_t largest_free() const {
    int64_t largest = 0;
    for (const auto& [offset, range] : free_) largest = range.size > largest ? range.size : largest;
    return largest;
  }

 private:
  struct FreeRange {
    int64_t size;
    PendingByStream pending;
  };
  static PendingByStream merged(PendingByStream a, const PendingByStream& b) {
    for (const auto& [stream, entry] : b) {
      auto it = a.find(stream);
      if (it == a.end() || entry.order > it->second.order) a.insert_or_assign(stream, entry);
    }
    return a;
  }

  int64_t size_;
  uint64_t releases_ = 0;
  std::map<int64_t, FreeRange> free_;  // by offset
};

// The region at `address` (`size` bytes) of CUDA device `device`, or of host memory with device -1
// (tests: no streams waited for, CPU tensors).
class OutputRegionAllocator {
 public:
  struct Tensor {
    void* data;
    std::vector<int64_t> shape;  // uint8 elements
  };

  OutputRegionAllocator(uintptr_t address, int64_t size, int device);

  // One block for tensors of `byte_shapes` (uint8 shapes; each starts 256-byte aligned), or nothing
  // when no free range holds it. The block returns when release_tensor has been called for each of them.
  // On `stream`, which first waits for the block's releases on other streams.
  std::optional<std::vector<Tensor>> allocate(const std::vector<std::vector<int64_t>>& byte_shapes,
                                              uintptr_t stream);
  // One tensor of the block at `block_offset` is gone (the DLPack deleter).
  void release_tensor(int64_t block_offset);

  uintptr_t address() const { return address_; }
  int device() const { return device_; }
  std::string describe();
  int64_t largest_free();

 private:
  struct Block {
    int64_t nbytes;
    int tensors_alive;
    uintptr_t stream;
  };

  uintptr_t address_;
  int device_;
  std::mutex mutex_;
  RegionRanges<bool> ranges_;  // a release's marker says only that it happened: its stream is the key
  std::map<int64_t, Block> blocks_;  // by offset
};

}  // namespace ep_plugin
