// Eight bf16 values packed in one 16-byte vector, accumulated in fp32.
#pragma once

#include <cuda_bf16.h>

namespace ep_plugin {

// acc[0..7] += the eight bf16 values of `packed` (exact: bf16 -> fp32 loses nothing).
__device__ __forceinline__ void add_bf16x8(float* acc, const int4& packed) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// Eight fp32 values rounded to nearest-even bf16, packed.
__device__ __forceinline__ int4 to_bf16x8(const float* acc) {
  int4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return packed;
}

// The sum of two packed rows, each pair of values rounded once to nearest-even bf16 (HADD2.BF16). Equal to
// their fp32 sum rounded to bf16: the exact sum of two bf16 values needs more than fp32's 24 bits only where
// one is under 2^-15 of the other, far below half a bf16 unit of the larger, so both round to the larger.
__device__ __forceinline__ int4 sum_bf16x8(const int4& a, const int4& b) {
  int4 sum;
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&sum);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __hadd2(x[i], y[i]);
  return sum;
}

}  // namespace ep_plugin
