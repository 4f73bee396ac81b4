// Memory-model primitives used by the kernels. Peer buffers are mapped over NVLink, so flags use
// system scope; bulk data uses 16-byte vector accesses.
#pragma once

#include <cstdint>

namespace ep_plugin {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Adds to a word that a peer polls (local or a peer's mapping). The release form first makes every
// store this thread has observed visible at system scope.
__device__ __forceinline__ void red_add_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// Read-only input that no one writes during the kernel (user tensors): skip L1 allocation.
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ int2 ld_nc_v2(const int2* ptr) {
  int2 v;
  asm("ld.global.nc.L1::no_allocate.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}

// Ring-buffer data written by a peer during this kernel: read through L2 only (never a stale L1 line).
__device__ __forceinline__ int4 ld_cg_v4(const int4* ptr) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

__device__ __forceinline__ int2 ld_cg_v2(const int2* ptr) {
  int2 v;
  asm volatile("ld.global.cg.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int ld_cg_s32(const int* ptr) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ float ld_cg_f32(const float* ptr) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr) : "memory");
  return v;
}

// Streaming store (local or peer memory): no L1 allocation.
__device__ __forceinline__ void st_na_v4(int4* ptr, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }

template <typename T>
__device__ __forceinline__ T shfl(T value, int src_lane) {
  return __shfl_sync(0xffffffffu, value, src_lane);
}

__device__ __forceinline__ void* shfl_ptr(void* ptr, int src_lane) {
  return reinterpret_cast<void*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(ptr), src_lane));
}
__device__ __forceinline__ const void* shfl_ptr(const void* ptr, int src_lane) {
  return shfl_ptr(const_cast<void*>(ptr), src_lane);
}

// Programmatic dependent launch (sm_90 on): launch_dependents lets the next kernel of the stream, if it
// was launched with cudaLaunchAttributeProgrammaticStreamSerialization, start once every block of this
// one has called it or ended; that kernel's wait_for_prerequisites then waits until this one has ended
// and its writes are visible. Both are no-ops without such a launch, and before sm_90.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Bulk (TMA) copies between global and shared memory (sm_90 and newer). A bulk load completes on an
// mbarrier (the issuer announces its bytes first); bulk stores complete per thread in bulk groups.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define EP_PLUGIN_HAS_BULK_COPIES 1
__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}

// Makes initialised mbarriers visible to the bulk-copy unit.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(shared_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void bulk_load(void* shared_dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(shared_dst)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// To local memory or a peer's mapping.
__device__ __forceinline__ void bulk_store(void* dst, const void* shared_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(shared_address(shared_src)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Until at most kPending of this thread's newest groups still read their shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until every store of this thread's groups is complete (before a release that publishes them).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's generic-proxy accesses before its later bulk copies.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }
#endif

// Asks L2 for `bytes` at `at` (a hint: no data comes back, nothing waits; nothing before sm_90). A warp
// reads a row in several batches of loads; with the row on its way to L2, every batch after the first
// finds it there.
__device__ __forceinline__ void prefetch_to_l2(const void* at, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(bytes) : "memory");
#endif
}

}  // namespace ep_plugin
