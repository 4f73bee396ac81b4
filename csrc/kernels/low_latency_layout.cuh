// Low-latency mode: how the symmetric (NVSHMEM) buffer is carved, the signal-word protocol, and
// the Args struct + launcher of each kernel family. The single source of truth for the size hint
// (ep_plugin/tuning.py mirrors `LowLatencyLayout::total_bytes`; a test keeps both equal).
//
// Buffer of num_rdma_bytes, identical on every PE (symmetric):
//
//   [ signal header: kHeaderBytes                                                      ]
//   [ round 0: at kHeaderBytes                    | round 1: at kHeaderBytes + stride   ]
//   stride = round_stride(num_rdma_bytes): the two rounds never overlap, whatever the sizes of a call.
//
// Signal header, per round r (fixed offsets, independent of the call's sizes, all zero at rest):
//   dispatch_signals[kMaxExperts]  u64, index local_expert * R + src_rank: written by src_rank
//   combine_signals[kMaxExperts]   u64, index expert_rank * E_local + local_expert (= global expert)
//   RoundState                     local bookkeeping of this PE (never written by a peer)
//
// One round (sizes for T_max tokens, hidden H, R ranks, E experts, E_local = E / R):
//   dispatch_recv  during a dispatch: [R][T_max] token payloads, one per (source rank, token) that
//                  selected any expert here (a token crosses the link once per destination rank,
//                  however many of its experts live there), then the index [E_local][R][T_max] int32:
//                  t * kMaxTopk + k of the message in each region slot (local expert, source, slot).
//                  After the dispatch the combine reuses the area as its send staging / zero-copy
//                  buffer, a dense [E_local][R * T_max][H] bf16 tensor. Size: the larger use.
//   combine_recv   [T_max][kMaxTopk] rows of 2H bytes: the expert output for (token, top-k slot)
//   dispatch_send  [T_max] token payloads (cast once; NVLink peers copy from here), then
//                  [T_max][kMaxTopk] int32 index entries staged for peers reached over the network
//                  (a put needs its source in symmetric memory)
//   route_table    [R][T_max] RouteRecord: with expert-side sums (topk_weights given to the dispatch),
//                  what the combine needs of each (source rank, token) received here: the mask of its
//                  top-k columns whose experts live here, their weights and their rows in recv_x.
//                  Written by the dispatch's receive, read by the combine's send (never by a peer).
//                  Then the pair list: [R * T_max] int32 src * T_max + token, one per pair received,
//                  RoundState::listed_pairs of them (appended by the dispatch's receive).
//
// Expert-side sums (the dispatch was given topk_weights; every peer reachable by NVLink): a token's
// payload also carries its top-k ids and weights (the route, kRouteBytes). The combine then sums, on
// the expert side, each token's rows of the experts there (fp32, k order) and sends one partial per
// (token, rank) into combine_recv, viewed as [T_max][R] rows of 4H bytes: fp32, or with bf16 partials
// (announced in the dispatch's count words, see RouteMode) bf16 in the row's first 2H bytes when it
// goes to a peer. The token side adds the partials in rank order. Top-8 of 256 experts on 2 ranks:
// 128 tokens move 3.7 MB (fp32) or 1.8 MB (bf16) instead of 7.3 MB.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../common/status.h"

namespace ep_plugin::low_latency {

constexpr int kMaxTopk = 32;          // top-k slots per token in combine_recv (= ep_plugin.tuning.MAX_TOPK)
constexpr int kMaxExperts = 65536;    // signal words reserved per round and kind
constexpr int kMaxRanks = 1024;       // PEs of one low-latency group (shared-memory tables)
constexpr int kMaxTokens = 65536;     // T_max: a source index t * kMaxTopk + k must fit kSourceRowBits
constexpr int kSourceRowBits = 21;    // recv_src_info = src_rank << 21 | (t * kMaxTopk + k)
constexpr int kFp8BlockSize = 128;    // channels per FP8 scale
constexpr int kThreads = 512;         // threads of every low-latency kernel block
constexpr int kWarps = kThreads / 32;
constexpr int64_t kAreaAlign = 128;
constexpr int kRouteBytes = 2 * kMaxTopk * 4;  // a payload's route: int32 expert ids, then float weights
constexpr int kMaxExpertSumRanks = kMaxTopk / 2;  // [T_max][R] fp32 partials fit combine_recv

enum Phase : int { kPhaseSend = 1, kPhaseRecv = 2 };

// Local bookkeeping of one round; lives in the header so that it is zero at start.
struct RoundState {
  uint32_t combine_blocks_done;  // combine receive blocks that have read every signal they need
  int32_t error_claim;           // round 0's: the first device error of this PE claims it
  // Expert-side sums: the dispatch's receive appends to the pair list, counting on num_pairs; its
  // last block publishes the count in listed_pairs (what the combine reads) and resets the rest, so a
  // dispatch that no combine follows leaves nothing behind.
  uint32_t num_pairs;
  uint32_t listed_pairs;
  uint32_t dispatch_blocks_done;
  uint32_t reserved[27];
};
static_assert(sizeof(RoundState) == 128, "RoundState must stay 128 bytes");

__host__ __device__ constexpr int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

constexpr int64_t kSignalWordsPerRound = 2LL * kMaxExperts;
constexpr int64_t kRoundHeaderBytes = align_up(kSignalWordsPerRound * 8 + sizeof(RoundState), 4096);
constexpr int64_t kHeaderBytes = 2 * kRoundHeaderBytes;

// ---- signal words ------------------------------------------------------------------------------
// One u64 per (receiver, expert, sender) and round: every message adds 1 (bits 0..31, arrivals);
// the sender adds kFinishBit | count << 32 once, when it knows how many messages it sends. The
// additions commute, so the word is complete exactly when the finish bit is set and the arrivals
// equal the announced count. The receiver resets the word to 0 once it has consumed the round.
constexpr uint64_t kFinishBit = 1ull << 63;
// Dispatch words only: set in a count announcement when the sender's payloads carry routes, and when
// its combine will send bf16 partials. Every rank must agree (the receiver checks), since the
// combine's protocol follows from them.
constexpr uint64_t kRouteBit = 1ull << 62;
constexpr uint64_t kBf16PartialsBit = 1ull << 61;
// Dispatch words only: bits [kLayoutTagShift, 61) carry a tag of the sender's layout (LowLatencyLayout::tag).
// The receiver compares it with its own before it reads a message: ranks whose calls are out of step get
// an error that says so, instead of rows read from where another layout put them. Counts keep kCountBits.
constexpr int kCountBits = 17;
constexpr int kLayoutTagShift = 32 + kCountBits;
constexpr uint32_t kLayoutTagMask = (1u << (61 - kLayoutTagShift)) - 1;  // 12 bits
static_assert(kMaxTokens < (1 << kCountBits), "a count (at most T_max, or a combine's pieces) must fit kCountBits");

// How a rank's combine works after a dispatch, as announced in the dispatch's count words.
enum RouteMode : int {
  kTokenSideSums = 0,       // no route: rows go back per (token, expert), summed on the token side
  kFp32Partials = 1,        // routes; expert-side sums sent as fp32 partials
  kBf16Partials = 2,        // routes; partials that cross to a peer rounded to bf16
};
__host__ __device__ constexpr int route_mode(bool route, bool bf16_partials) {
  return route ? (bf16_partials ? kBf16Partials : kFp32Partials) : kTokenSideSums;
}

__host__ __device__ constexpr uint64_t count_signal(uint32_t count, int mode = kTokenSideSums,
                                                    uint32_t layout_tag = 0) {
  return kFinishBit | (mode != kTokenSideSums ? kRouteBit : 0) | (mode == kBf16Partials ? kBf16PartialsBit : 0) |
         (static_cast<uint64_t>(layout_tag & kLayoutTagMask) << kLayoutTagShift) | (static_cast<uint64_t>(count) << 32);
}
__host__ __device__ constexpr uint32_t signal_expected(uint64_t word) {
  return static_cast<uint32_t>(word >> 32) & ((1u << kCountBits) - 1);
}
__host__ __device__ constexpr uint32_t signal_layout_tag(uint64_t word) {
  return static_cast<uint32_t>(word >> kLayoutTagShift) & kLayoutTagMask;
}
__host__ __device__ constexpr int signal_route_mode(uint64_t word) {
  return route_mode((word & kRouteBit) != 0, (word & kBf16PartialsBit) != 0);
}

// What the combine's send needs of one (source rank, token) with expert-side sums.
struct RouteRecord {
  uint32_t local_mask;       // bit k: column k's expert lives on this rank
  uint32_t reserved[3];
  float weights[kMaxTopk];   // the token's top-k weights (all columns)
  int32_t rows[kMaxTopk];    // column k's row in recv_x (local expert * R * T_max + slot), where local
};
static_assert(sizeof(RouteRecord) % 16 == 0, "RouteRecord must keep 16-byte alignment");
__host__ __device__ constexpr uint32_t signal_arrived(uint64_t word) { return static_cast<uint32_t>(word); }
__host__ __device__ constexpr bool signal_complete(uint64_t word) {
  return (word & kFinishBit) != 0 && signal_expected(word) == signal_arrived(word);
}

// ---- the buffer --------------------------------------------------------------------------------
// Bytes between the starts of round 0 and round 1 in a buffer of `num_bytes`.
__host__ __device__ inline int64_t round_stride(int64_t num_bytes) {
  const int64_t data = num_bytes > kHeaderBytes ? num_bytes - kHeaderBytes : 0;
  return data / 2 / kAreaAlign * kAreaAlign;
}

struct LowLatencyLayout {
  int num_max_tokens;  // T_max
  int hidden;          // H (bf16 elements per token)
  int num_ranks;       // R
  int num_experts;     // E (divisible by R)

  __host__ __device__ int num_local_experts() const { return num_experts / num_ranks; }
  __host__ __device__ int num_slots() const { return num_ranks * num_max_tokens; }  // per local expert
  __host__ __device__ int num_scales() const { return (hidden + kFp8BlockSize - 1) / kFp8BlockSize; }
  __host__ __device__ int num_ue8m0_words() const { return (num_scales() + 3) / 4; }
  __host__ __device__ int64_t row_bytes() const { return 2LL * hidden; }  // bf16 token
  // FP8 payload: H bytes, then the float scales at fp8_scales_offset(). With expert-side sums the
  // route follows at route_offset().
  __host__ __device__ int64_t fp8_scales_offset() const { return align_up(hidden, 16); }
  __host__ __device__ int64_t payload_bytes() const {
    const int64_t bf16 = align_up(row_bytes(), 16);
    const int64_t fp8 = fp8_scales_offset() + align_up(4LL * num_scales(), 16);
    return (bf16 > fp8 ? bf16 : fp8) + kRouteBytes;
  }
  // The bf16 row, or the FP8 row and its scales.
  __host__ __device__ int64_t row_payload_bytes(bool use_fp8) const {
    return use_fp8 ? fp8_scales_offset() + align_up(4LL * num_scales(), 16) : row_bytes();
  }
  __host__ __device__ int64_t route_offset(bool use_fp8) const { return row_payload_bytes(use_fp8); }
  // Payload bytes a message carries: the row (and scales), then the route if there is one.
  __host__ __device__ int64_t used_payload_bytes(bool use_fp8, bool route) const {
    return row_payload_bytes(use_fp8) + (route ? kRouteBytes : 0);
  }

  // A 12-bit tag of what a dispatch's messages depend on: T_max, hidden, experts, FP8 or bf16 payloads
  // (FNV-1a, folded). Two layouts share a tag with probability 1/4096.
  __host__ __device__ constexpr uint32_t tag(bool use_fp8) const {
    uint32_t h = 2166136261u;
    h = (h ^ static_cast<uint32_t>(num_max_tokens)) * 16777619u;
    h = (h ^ static_cast<uint32_t>(hidden)) * 16777619u;
    h = (h ^ static_cast<uint32_t>(num_experts)) * 16777619u;
    h = (h ^ (use_fp8 ? 1u : 0u)) * 16777619u;
    return (h ^ (h >> 12) ^ (h >> 24)) & kLayoutTagMask;
  }

  // Areas of one round: size formulas.
  // token_recv = R * T_max * payload_bytes; recv_index = E_local * R * T_max * 4
  __host__ __device__ int64_t token_recv_bytes() const {
    return align_up(static_cast<int64_t>(num_ranks) * num_max_tokens * payload_bytes(), kAreaAlign);
  }
  __host__ __device__ int64_t recv_index_bytes() const {
    return align_up(static_cast<int64_t>(num_experts) * num_max_tokens * 4, kAreaAlign);
  }
  // combine staging = E_local * R * T_max * 2H
  __host__ __device__ int64_t combine_staging_bytes() const {
    return align_up(static_cast<int64_t>(num_experts) * num_max_tokens * row_bytes(), kAreaAlign);
  }
  __host__ __device__ int64_t dispatch_recv_bytes() const {
    const int64_t dispatch = token_recv_bytes() + recv_index_bytes();
    return dispatch > combine_staging_bytes() ? dispatch : combine_staging_bytes();
  }
  // combine_recv = T_max * kMaxTopk * 2H
  __host__ __device__ int64_t combine_recv_bytes() const {
    return align_up(static_cast<int64_t>(num_max_tokens) * kMaxTopk * row_bytes(), kAreaAlign);
  }
  // dispatch_send = T_max * payload_bytes (token payloads) + T_max * kMaxTopk * 4 (staged index entries)
  __host__ __device__ int64_t token_payloads_bytes() const {
    return align_up(static_cast<int64_t>(num_max_tokens) * payload_bytes(), kAreaAlign);
  }
  __host__ __device__ int64_t dispatch_send_bytes() const {
    return token_payloads_bytes() + align_up(static_cast<int64_t>(num_max_tokens) * kMaxTopk * 4, kAreaAlign);
  }
  // route_table = R * T_max * sizeof(RouteRecord)
  __host__ __device__ int64_t route_records_bytes() const {
    return align_up(static_cast<int64_t>(num_ranks) * num_max_tokens * static_cast<int64_t>(sizeof(RouteRecord)),
                    kAreaAlign);
  }
  // route_table = the records, then the pair list (R * T_max int32)
  __host__ __device__ int64_t route_table_bytes() const {
    return route_records_bytes() + align_up(static_cast<int64_t>(num_ranks) * num_max_tokens * 4, kAreaAlign);
  }
  __host__ __device__ int64_t round_bytes() const {
    return dispatch_recv_bytes() + combine_recv_bytes() + dispatch_send_bytes() + route_table_bytes();
  }
  // Whether this layout admits expert-side sums (besides every peer being reachable by NVLink): the
  // fp32 partials [T_max][R][H] fit combine_recv, one word per (token, rank) fits the header, and a
  // RouteRecord's int32 rows reach every row of recv_x.
  __host__ __device__ bool admits_expert_sums() const {
    return num_ranks <= kMaxExpertSumRanks && static_cast<int64_t>(num_max_tokens) * num_ranks <= kMaxExperts &&
           static_cast<int64_t>(num_experts) * num_max_tokens <= INT32_MAX;
  }
  // Bytes a buffer needs (Buffer.get_low_latency_rdma_size_hint).
  __host__ __device__ int64_t total_bytes() const { return kHeaderBytes + 2 * round_bytes(); }

  // Offsets inside a round.
  __host__ __device__ int64_t dispatch_recv_offset() const { return 0; }
  __host__ __device__ int64_t combine_recv_offset() const { return dispatch_recv_bytes(); }
  __host__ __device__ int64_t token_payloads_offset() const { return combine_recv_offset() + combine_recv_bytes(); }
  __host__ __device__ int64_t staged_index_offset() const { return token_payloads_offset() + token_payloads_bytes(); }
  __host__ __device__ int64_t route_table_offset() const { return token_payloads_offset() + dispatch_send_bytes(); }
  __host__ __device__ int64_t pair_list_offset() const { return route_table_offset() + route_records_bytes(); }

  // Payload of token `token` from `src_rank` inside dispatch_recv.
  __host__ __device__ int64_t token_recv_offset(int src_rank, int token) const {
    return dispatch_recv_offset() + (static_cast<int64_t>(src_rank) * num_max_tokens + token) * payload_bytes();
  }
  // Index entry of (local expert, source rank, slot) inside dispatch_recv.
  __host__ __device__ int64_t recv_index_offset(int local_expert, int src_rank, int slot) const {
    return dispatch_recv_offset() + token_recv_bytes() +
           ((static_cast<int64_t>(local_expert) * num_ranks + src_rank) * num_max_tokens + slot) * 4;
  }
};

// Every round's pieces, as local symmetric addresses (valid as `dest` of NVSHMEM calls).
struct RoundPointers {
  uint64_t* dispatch_signals;  // [kMaxExperts]
  uint64_t* combine_signals;   // [kMaxExperts]
  RoundState* state;
  uint8_t* data;               // start of the round's areas
};

__host__ __device__ inline RoundPointers round_pointers(void* buffer, int64_t num_bytes, int parity) {
  uint8_t* base = static_cast<uint8_t*>(buffer);
  uint8_t* header = base + parity * kRoundHeaderBytes;
  RoundPointers p;
  p.dispatch_signals = reinterpret_cast<uint64_t*>(header);
  p.combine_signals = reinterpret_cast<uint64_t*>(header) + kMaxExperts;
  p.state = reinterpret_cast<RoundState*>(header + kSignalWordsPerRound * 8);
  p.data = base + kHeaderBytes + parity * round_stride(num_bytes);
  return p;
}

// ---- kernel families ---------------------------------------------------------------------------
// Fields marked (runtime) are filled by LowLatencyRuntime; the rest by the caller.
struct DispatchArgs {
  LowLatencyLayout layout;
  RoundPointers round;              // (runtime) this call's round
  int rank;                         // (runtime)
  int num_blocks;                   // (runtime) <= SMs: the fused send + receive needs every block resident
  int phases;                       // kPhaseSend | kPhaseRecv
  DeviceStatus* status;             // (runtime)
  int* error_claim;                 // (runtime)
  uint64_t timeout_ns;              // (runtime)
  // Send.
  const void* x;                    // [T, H] bf16
  const int64_t* topk_idx;          // [T, K]
  int num_tokens, num_topk;
  bool use_fp8, round_scale, use_ue8m0;
  // Receive.
  void* recv_x;                     // [E_local, R * T_max, H] bf16, or fp8 bytes
  void* recv_scales;                // fp8: float [E_local, S, R * T_max] or int32 [E_local, W, R * T_max]
  int32_t* recv_count;              // [E_local]
  int32_t* recv_src_info;           // [E_local, R * T_max]: src_rank << 21 | (t * kMaxTopk + k)
  int64_t* recv_layout;             // [E_local, R]: first slot << 32 | count, per source rank
  int32_t* cumulative_stats;        // [E_local] or nullptr
  // Expert-side sums: each payload carries its route (ids, these weights), and the combine will send
  // bf16 partials to peers (else fp32). Every rank must agree on both.
  bool carry_route;
  bool bf16_partials;
  const float* topk_weights;        // [T, K] (with carry_route)
  // Shrink mode: [R] int32, 1 where this rank skips a rank (see "shrink mode" below); nullptr otherwise.
  int* rank_mask;
};
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);

struct CombineArgs {
  LowLatencyLayout layout;
  RoundPointers round;              // (runtime) the round of the matching dispatch
  int rank;                         // (runtime)
  int num_blocks;                   // (runtime)
  int phases;
  DeviceStatus* status;             // (runtime)
  int* error_claim;                 // (runtime)
  uint64_t timeout_ns;              // (runtime)
  // Send (the expert side).
  const void* x;                    // [E_local, R * T_max, H] bf16: expert outputs in dispatch's slots
  bool x_is_staging;                // zero_copy: x is this round's dispatch_recv area itself
  const int32_t* recv_src_info;     // from the dispatch
  const int64_t* recv_layout;       // from the dispatch
  // Receive (the token side).
  const int64_t* topk_idx;          // [T, K]: ids of the dispatch; -1 masks an entry
  const float* topk_weights;        // [T, K]
  int num_tokens, num_topk;
  void* out;                        // [T, H] bf16
  // The matching dispatch carried routes: the expert side sums each token's rows with the weights it
  // received (topk_weights above is then unused) and sends one partial per (token, rank): fp32, or
  // with bf16_partials rounded to bf16 when it goes to a peer (a rank's own partial stays fp32).
  bool expert_sums;
  bool bf16_partials;
  int* rank_mask;                   // shrink mode: as in DispatchArgs (the same tensor), or nullptr
};
void launch_combine(const CombineArgs& args, cudaStream_t stream);

// Blocks of each kernel that one SM holds at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor):
// the runtime launches one block per SM and a fused launch needs all of them resident together.
int dispatch_blocks_per_sm();
int combine_blocks_per_sm();

}  // namespace ep_plugin::low_latency

// ---- device helpers shared by low_latency_dispatch.cu and low_latency_combine.cu ----------------
// Only NVSHMEM's standard device API: nvshmem_ptr for peers that NVLink reaches (direct stores),
// put-with-signal and signal operations for every other transport.
#if defined(__CUDACC__)
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../common/copy.cuh"
#include "../common/device_status.cuh"
#include "../common/ptx.cuh"

namespace ep_plugin::low_latency {

__device__ __forceinline__ void st_volatile_u64(uint64_t* ptr, uint64_t value) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ int2 ld_cg_v2(const int2* ptr) {
  int2 v;
  asm volatile("ld.global.cg.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr) : "memory");
  return v;
}

// Spins (one thread) until `word` is complete; returns it. Through Deadline: past timeout_s it
// reports rank, peer, what it waited for (`kind`) and the site's channel (an expert, or a token for
// the expert-sums partials), and traps.
__device__ __forceinline__ uint64_t wait_signal(const uint64_t* word, const WaitSite& site, int peer,
                                                int kind = kWaitExpertMessages) {
  Deadline deadline(site);
  while (true) {
    const uint64_t value = ld_acquire_sys(word);
    if (signal_complete(value)) return value;
    const int64_t expected = (value & kFinishBit) ? static_cast<int64_t>(signal_expected(value)) : -1;
    deadline.check(kind, peer, expected, signal_arrived(value));
  }
}

// ---- shrink mode (rank masking) ----------------------------------------------------------------
// With a rank mask (`rank_mask`, [R] int32 in this rank's memory, written by the host on the stream
// between calls and by these waits), a call skips every masked rank: no message, count or row goes to
// it, no wait waits for it (its messages count as 0, its experts' outputs as zero). A wait whose peer
// does not answer within timeout_s masks the peer (atomic exchange; the first one prints it) and the
// call goes on without it, instead of trapping. Without a mask (nullptr) the kernels launch their
// instances without the masked waits (kShrink = false, below) and trap as before.
// NOTE: a masked peer's signal words are neither waited for nor reset: a peer that is still alive may
// add to them late. They are zero again only after clean_low_latency_buffer (docs/faults.md).
__device__ __forceinline__ bool is_rank_masked(const int* rank_mask, int rank) {
  return rank_mask != nullptr && *reinterpret_cast<const volatile int*>(rank_mask + rank) != 0;
}

__device__ __noinline__ inline void mask_silent_peer(const WaitSite& site, int kind, int peer, int* rank_mask) {
  if (atomicExch(rank_mask + peer, 1) == 0)
    printf("ep_plugin: rank %d masked peer %d: no answer within the timeout (op %d, wait %d, channel %d)\n",
           site.rank, peer, site.op, kind, site.channel);
}

// The shrink-mode wait (a mask given, a peer's word): the complete word, or 0 (never a complete word:
// those have kFinishBit) once `peer` is masked, before the wait or during it by another wait of this
// rank, or by this wait once timeout_s passes. Out of line: the waits without a mask stay as they were.
__device__ __noinline__ inline uint64_t wait_signal_or_mask(const uint64_t* word, const WaitSite& site, int peer,
                                                            int* rank_mask, int kind) {
  Deadline deadline(site);
  for (uint32_t spins = 0;; ++spins) {
    if (spins % kSpinsPerClaimRead == 0 && is_rank_masked(rank_mask, peer)) return 0;
    const uint64_t value = ld_acquire_sys(word);
    if (signal_complete(value)) return value;
    if (deadline.passed()) {
      mask_silent_peer(site, kind, peer, rank_mask);
      return 0;
    }
  }
}

// Spins (one thread) until `word` is complete and returns it, or, in a kernel launched with a rank mask
// (kShrink), returns 0 once `peer` is masked. Without a mask, or for this rank's own word, it is
// wait_signal (traps past the timeout). The kernels take kShrink as a template parameter: their
// instances without a mask compile exactly as without shrink mode (a call out of line would cost
// registers spilled around it in every wait loop).
template <bool kShrink>
__device__ __forceinline__ uint64_t wait_signal_unless_masked(const uint64_t* word, const WaitSite& site, int peer,
                                                              int* rank_mask, int kind = kWaitExpertMessages) {
  if constexpr (kShrink) {
    if (peer != site.rank) return wait_signal_or_mask(word, site, peer, rank_mask, kind);
  }
  return wait_signal(word, site, peer, kind);
}

// After the warp has stored a message straight into `pe`'s memory: add `value` to `signal`
// (symmetric address) there. Warp-collective.
// NOTE: the warp barrier orders every lane's stores before lane 0's release, and the release at
// system scope makes them visible to the peer before the increment: a reader that acquires the
// word and sees the increment sees the bytes.
__device__ __forceinline__ void publish_direct(uint64_t* signal, int pe, uint64_t value = 1) {
  __syncwarp();
  if (lane_id() == 0) red_add_release_sys(static_cast<uint64_t*>(nvshmem_ptr(signal, pe)), value);
  __syncwarp();
}

// Sends `bytes` from the local symmetric `src` to the symmetric `dst` on `pe` and adds 1 to
// `signal` there once the bytes are delivered (NVSHMEM's put-with-signal). Warp-collective.
// NOTE: the network reads `src` from memory: every lane's stores to it are made visible at system
// scope before the put is issued.
__device__ __forceinline__ void put_with_signal(void* dst, const void* src, int64_t bytes, uint64_t* signal, int pe) {
  __threadfence_system();
  __syncwarp();
  nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(bytes), signal, 1, NVSHMEM_SIGNAL_ADD, pe);
}

// Adds `value` (a count_signal) to `signal` (symmetric) of `pe`: announces how many messages follow.
// One thread; no ordering needed (the receiver compares the arrivals with the count), so a relaxed
// add: a release would first wait for every earlier store of the thread to reach the peer.
// NOTE: same path as the word's arrivals (publish_direct / put_with_signal). nvshmemx_signal_op
// sends an ADD through the network transport whenever the job is not NVLink-only, even to a peer
// NVLink reaches; a NIC's atomic is not atomic with the GPU's NVLink atomics on the same word.
__device__ __forceinline__ void announce_count(uint64_t* signal, uint64_t value, int pe) {
  uint64_t* peer_signal = static_cast<uint64_t*>(nvshmem_ptr(signal, pe));
  if (peer_signal != nullptr) {
    red_add_relaxed_sys(peer_signal, value);
  } else {
    nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_ADD, pe);
  }
}

}  // namespace ep_plugin::low_latency
#endif  // __CUDACC__
