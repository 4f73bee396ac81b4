// How a reader of a staging area (the copy-engine combine) tells landed bytes from the rest.
//
// A staging area is filled with 0xff bytes before a copy engine writes into it (the host refills it
// after each use), so a 32-bit word that still reads kUnlandedWord has not landed. A real word of that
// value (a NaN pattern) only makes the reader wait for its source's landed word, which is final.
// NOTE: relies on aligned 32-bit words landing whole; a unit's four words may land at different times.
#pragma once

#include "../common/copy.cuh"

namespace ep_plugin::intranode {

constexpr int kUnlandedWord = -1;

__device__ __forceinline__ bool has_unlanded_word(const int4& v) {
  return (v.x == kUnlandedWord) | (v.y == kUnlandedWord) | (v.z == kUnlandedWord) | (v.w == kUnlandedWord);
}
__device__ __forceinline__ bool has_unlanded_word(float v) { return __float_as_int(v) == kUnlandedWord; }

// Staged bytes are read through L2 only: a re-read must never hit a stale L1 line.
__device__ __forceinline__ int4 load_staged(const int4* at) { return load_unit<Load::kL2Only>(at); }
__device__ __forceinline__ float load_staged(const float* at) { return load_f32<Load::kL2Only>(at); }

}  // namespace ep_plugin::intranode
