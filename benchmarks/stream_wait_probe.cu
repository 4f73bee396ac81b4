// How soon a copy starts after the word it waits for is written: the copy-engine combine's sender
// waits for the owner's release of its staging area, then copies. Compared here:
//   kernel       a one-thread kernel polls the word (and writes two words), then the copy (the default)
//   stream       cuStreamWaitValue64 on the word, then the copy
//   batch        cuStreamBatchMemOp: the wait and two 64-bit writes in one call, then the copy
//   event        the copy waits for an event recorded after the writer kernel (stream order, no word)
// A writer kernel on another stream sleeps `delay` us, stamps %globaltimer and writes the word; an
// observer kernel stamps the moment the copy's first and last 16 bytes land. Prints, per variant, the
// median / min / max over the rounds of: word written -> first bytes landed, and the copy's own time.
// With --peer and two GPUs, the word is written from GPU 1 (as an owner would) and the copy goes from
// GPU 0 to GPU 1; otherwise everything is on GPU 0.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stream_wait_probe benchmarks/stream_wait_probe.cu
//   /tmp/stream_wait_probe [--peer] [--mb 56] [--rounds 50] [--delay-us 100]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../csrc/common/ptx.cuh"
#include "probe_check.h"

namespace {

using ep_plugin::global_timer_ns;
using ep_plugin::ld_acquire_sys;
using ep_plugin::st_release_sys;

// Every spin gives up after this long, so that a probe that goes wrong ends instead of hanging.
constexpr uint64_t kGiveUpNs = 2000000000ull;

// Sleeps `delay_ns`, then stamps the time and writes `value` to `word`.
__global__ void write_word_later(uint64_t* word, uint64_t value, uint64_t delay_ns, uint64_t* stamp) {
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < delay_ns) {
  }
  *stamp = global_timer_ns();
  __threadfence_system();
  st_release_sys(word, value);
}

// The sender's wait as the combine's staging_wait_kernel makes it: poll, then two release writes.
__global__ void wait_then_write(const uint64_t* word, uint64_t target, uint64_t* then_0, uint64_t* then_1) {
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys(word) < target && global_timer_ns() - start < kGiveUpNs) {
  }
  st_release_sys(then_0, target);
  st_release_sys(then_1, target);
}

// Stamps when the first and the last unit of `dst` stop reading `poison`.
__global__ void watch_landing(const volatile int4* first, const volatile int4* last, int poison, uint64_t* stamps) {
  const uint64_t start = global_timer_ns();
  while (first->x == poison && global_timer_ns() - start < kGiveUpNs) {
  }
  stamps[0] = global_timer_ns();
  while (last->x == poison && global_timer_ns() - start < kGiveUpNs) {
  }
  stamps[1] = global_timer_ns();
}

// Driver functions through the runtime's entry points (no link against libcuda).
using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
using DeviceGetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

template <typename F>
F driver_function(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "driver function %s not found\n", name);
    std::exit(1);
  }
  return reinterpret_cast<F>(fn);
}

struct Options {
  bool peer = false;
  size_t bytes = 56ull << 20;
  int rounds = 50;
  double delay_us = 100;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--peer") o.peer = true;
    else if (arg == "--mb") o.bytes = static_cast<size_t>(std::atof(next()) * (1 << 20)) / 16 * 16;
    else if (arg == "--rounds") o.rounds = std::atoi(next());
    else if (arg == "--delay-us") o.delay_us = std::atof(next());
    else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      std::exit(2);
    }
  }
  return o;
}

struct Stats {
  double median, min, max;
};

Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

enum class Variant { kKernel, kStream, kBatch, kEvent };
const char* name_of(Variant v) {
  switch (v) {
    case Variant::kKernel: return "kernel";
    case Variant::kStream: return "stream";
    case Variant::kBatch: return "batch";
    default: return "event";
  }
}

struct DriverOps {
  WaitValue64 wait_value_64;
  BatchMemOp batch_mem_op;
};

// Queues on `sender` the wait of variant `v` for *word >= target (kEvent: nothing; its copy is queued
// behind the writer instead).
void queue_wait(Variant v, const DriverOps& ops, cudaStream_t sender, uint64_t* word, uint64_t target,
                uint64_t* then_words) {
  switch (v) {
    case Variant::kKernel:
      wait_then_write<<<1, 1, 0, sender>>>(word, target, then_words, then_words + 1);
      break;
    case Variant::kStream:
      CHECK_CU(ops.wait_value_64(reinterpret_cast<CUstream>(sender), reinterpret_cast<CUdeviceptr>(word), target,
                                 CU_STREAM_WAIT_VALUE_GEQ));
      break;
    case Variant::kBatch: {
      CUstreamBatchMemOpParams params[3] = {};
      params[0].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      params[0].waitValue.address = reinterpret_cast<CUdeviceptr>(word);
      params[0].waitValue.value64 = target;
      params[0].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      for (int i = 1; i < 3; ++i) {
        params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        params[i].writeValue.address = reinterpret_cast<CUdeviceptr>(then_words + i - 1);
        params[i].writeValue.value64 = target;
      }
      CHECK_CU(ops.batch_mem_op(reinterpret_cast<CUstream>(sender), 3, params, 0));
      break;
    }
    case Variant::kEvent:
      break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const Options o = parse(argc, argv);
  int num_gpus = 0;
  CHECK(cudaGetDeviceCount(&num_gpus));
  const bool peer = o.peer && num_gpus >= 2;
  if (o.peer && !peer) std::printf("--peer: only one GPU, everything on GPU 0\n");
  const int src_gpu = 0, dst_gpu = peer ? 1 : 0, writer_gpu = dst_gpu;
  if (peer) {
    CHECK(cudaSetDevice(0));
    CHECK(cudaDeviceEnablePeerAccess(1, 0));
    CHECK(cudaSetDevice(1));
    CHECK(cudaDeviceEnablePeerAccess(0, 0));
  }
  CHECK(cudaSetDevice(src_gpu));
  CHECK(cudaFree(nullptr));  // the runtime initialises the driver
  const DriverOps ops{driver_function<WaitValue64>("cuStreamWaitValue64"),
                      driver_function<BatchMemOp>("cuStreamBatchMemOp")};
  int has_64 = 0;
  CHECK_CU(driver_function<DeviceGetAttribute>("cuDeviceGetAttribute")(
      &has_64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, static_cast<CUdevice>(src_gpu)));

  // The word and the announcement words live on the sender's GPU (the owner writes the word there);
  // stamps in mapped host memory.
  uint64_t *word, *then_words;
  CHECK(cudaMalloc(&word, 8));
  CHECK(cudaMalloc(&then_words, 16));
  int4* src;
  CHECK(cudaMalloc(&src, o.bytes));
  CHECK(cudaMemset(src, 0x11, o.bytes));
  CHECK(cudaSetDevice(dst_gpu));
  int4* dst;
  CHECK(cudaMalloc(&dst, o.bytes));
  uint64_t* stamps;  // [0] word written, [1] first landed, [2] last landed
  CHECK(cudaHostAlloc(&stamps, 3 * sizeof(uint64_t), cudaHostAllocMapped | cudaHostAllocPortable));

  cudaStream_t writer, observer, sender;
  CHECK(cudaSetDevice(writer_gpu));
  CHECK(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking));
  CHECK(cudaSetDevice(dst_gpu));
  CHECK(cudaStreamCreateWithFlags(&observer, cudaStreamNonBlocking));
  CHECK(cudaSetDevice(src_gpu));
  CHECK(cudaStreamCreateWithFlags(&sender, cudaStreamNonBlocking));
  cudaEvent_t written;
  CHECK(cudaSetDevice(writer_gpu));
  CHECK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));

  // NOTE: each kernel is loaded before any of them spins: a kernel's first launch loads it (lazy
  // loading), and the load waits for the kernels running, which would wait for it.
  cudaFuncAttributes attributes;
  for (int gpu : {src_gpu, dst_gpu}) {
    CHECK(cudaSetDevice(gpu));
    CHECK(cudaFuncGetAttributes(&attributes, write_word_later));
    CHECK(cudaFuncGetAttributes(&attributes, wait_then_write));
    CHECK(cudaFuncGetAttributes(&attributes, watch_landing));
  }
  const int poison = 0x7f7f7f7f;
  const int4* last = dst + (o.bytes / 16 - 1);
  std::printf("stream_wait_probe: %s, copy of %.1f MB, %d rounds, writer delay %.0f us, 64-bit stream memops: %s\n",
              peer ? "GPU 0 -> GPU 1 (word written from GPU 1)" : "one GPU", o.bytes / 1048576.0, o.rounds,
              o.delay_us, has_64 ? "yes" : "no");
  std::printf("%-8s %28s %28s\n", "variant", "written->first landed us", "copy us (first->last)");
  uint64_t epoch = 0;
  for (Variant v : {Variant::kKernel, Variant::kStream, Variant::kBatch, Variant::kEvent}) {
    if ((v == Variant::kStream || v == Variant::kBatch) && !has_64) continue;
    std::vector<double> start_latency, copy_time;
    for (int round = -3; round < o.rounds; ++round) {  // 3 warm-up rounds
      ++epoch;
      CHECK(cudaSetDevice(dst_gpu));
      CHECK(cudaMemsetAsync(dst, 0x7f, o.bytes, observer));
      CHECK(cudaStreamSynchronize(observer));
      std::memset(stamps, 0, 3 * sizeof(uint64_t));
      // The observer and the sender's wait go first, so both are in place before the word is written.
      watch_landing<<<1, 1, 0, observer>>>(dst, last, poison, stamps + 1);
      CHECK(cudaSetDevice(src_gpu));
      queue_wait(v, ops, sender, word, epoch, then_words);
      if (v != Variant::kEvent) CHECK(cudaMemcpyAsync(dst, src, o.bytes, cudaMemcpyDeviceToDevice, sender));
      CHECK(cudaSetDevice(writer_gpu));
      write_word_later<<<1, 1, 0, writer>>>(word, epoch, static_cast<uint64_t>(o.delay_us * 1000), stamps);
      if (v == Variant::kEvent) {
        CHECK(cudaEventRecord(written, writer));
        CHECK(cudaSetDevice(src_gpu));
        CHECK(cudaStreamWaitEvent(sender, written, 0));
        CHECK(cudaMemcpyAsync(dst, src, o.bytes, cudaMemcpyDeviceToDevice, sender));
      }
      CHECK(cudaStreamSynchronize(writer));
      CHECK(cudaStreamSynchronize(sender));
      CHECK(cudaStreamSynchronize(observer));
      if (round < 0) continue;
      start_latency.push_back((static_cast<double>(stamps[1]) - static_cast<double>(stamps[0])) / 1e3);
      copy_time.push_back((static_cast<double>(stamps[2]) - static_cast<double>(stamps[1])) / 1e3);
    }
    const Stats s = stats_of(start_latency), c = stats_of(copy_time);
    std::printf("%-8s %10.1f / %6.1f / %6.1f %10.1f / %6.1f / %6.1f\n", name_of(v), s.median, s.min, s.max, c.median,
                c.min, c.max);
  }
  std::printf("(median / min / max)\n");
  return 0;
}
