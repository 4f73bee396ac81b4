// Low-latency combine: every slot that dispatch filled goes back to its source token, which sums
// its top-k rows weighted by topk_weights in fp32 and writes bf16.
//
// Send (the expert side; block b: local experts b, b + B, ...): for each source rank, announce how
// many row pieces this expert returns to it (an expert with few rows splits each into pieces so
// that all warps work); then warps send each filled slot's row of x, piece by piece, to row
// (token * kMaxTopk + k) of the source's combine_recv area; each piece adds 1 to the source's signal
// word of this expert (over NVLink: stores, then one release per block and expert; over the network:
// put-with-signal from this round's dispatch_recv area used as staging, or straight from it with
// zero_copy).
// Receive (the token side; block b: tokens b, b + B, ...): one lane per top-k entry waits until
// the word of its expert is complete, then all threads reduce the token's rows in k order. The last
// block to finish waits for every word of the round (each expert announces a count, also of 0) and
// resets them.
//
// Expert-side sums (the dispatch carried routes, see low_latency_layout.cuh): the expert side sends,
// for each (source, token) pair it received, one partial: the sum over the token's columns here, in
// k order, of weight * row, in fp32; with bf16_partials a partial that goes to a peer is rounded to
// bf16 (half the bytes again; a rank's own partial stays fp32). Every warp of the grid takes (pair,
// piece) items; each piece adds 1 to the source's word of (token, this rank), and piece 0 announces
// how many there are. The
// token side waits for the partial of every rank holding one of its experts and adds them in rank
// order. The weights are the ones the dispatch carried.
//
// Shrink mode (a rank mask, low_latency_layout.cuh): the send skips rows and counts for masked source
// ranks; the receive does not wait for a masked rank's experts (or partial) and counts them as zero.

#include <type_traits>

#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "low_latency_layout.cuh"

namespace ep_plugin::low_latency {
namespace {

// ---- send ---------------------------------------------------------------------------------------
constexpr int kMaxRowPieces = 8;

// Pieces each row of an expert with `num_rows` rows is sent in: with few rows, a row is split so
// that every warp of the block copies part of one (one warp copying a whole row pays several
// memory latencies one after another). Every piece counts as one arrival on the signal word.
__device__ __forceinline__ int row_pieces(int num_rows, int row_units) {
  const int pieces = num_rows > 0 ? kWarps / num_rows : 1;
  return max(1, min(min(pieces, kMaxRowPieces), row_units));
}

// Sends piece `piece` of `pieces` of slot `slot` of local expert `local` back to where dispatch got
// it from: to an NVLink peer, counted in pieces_to[src] for the block to publish; to a network peer,
// with a put-with-signal. Warp-collective.
__device__ void send_row_piece(const CombineArgs& a, int local, int slot, int piece, int pieces, uint32_t* pieces_to) {
  const LowLatencyLayout& layout = a.layout;
  const int64_t row_bytes = layout.row_bytes();
  const int64_t row_units = row_bytes / 16;
  const int64_t first_unit = piece * row_units / pieces, end_unit = (piece + 1) * row_units / pieces;
  const int64_t offset = first_unit * 16, bytes = (end_unit - first_unit) * 16;
  const int64_t index = static_cast<int64_t>(local) * layout.num_slots() + slot;
  const int info = a.recv_src_info[index];
  const int src = info >> kSourceRowBits;
  if (is_rank_masked(a.rank_mask, src)) return;  // shrink mode: nothing goes back to a masked rank
  const int64_t dst_row = info & ((1 << kSourceRowBits) - 1);
  const uint8_t* row = static_cast<const uint8_t*>(a.x) + index * row_bytes + offset;
  uint8_t* dst = a.round.data + layout.combine_recv_offset() + dst_row * row_bytes + offset;  // symmetric address
  uint64_t* signal = a.round.combine_signals + a.rank * layout.num_local_experts() + local;
  uint8_t* peer_dst = static_cast<uint8_t*>(nvshmem_ptr(dst, src));
  if (peer_dst != nullptr) {
    warp_copy_bytes<Load::kReadOnly>(peer_dst, row, bytes);
    if (lane_id() == 0) atomicAdd(pieces_to + src, 1u);  // published by the block (combine_send)
  } else {
    // A network peer: the put needs a symmetric source. This round's dispatch_recv area, viewed as
    // [E_local][R * T_max][H] bf16, is free once the dispatch's receive has copied it out (with
    // zero_copy, x is that area).
    uint8_t* staged = a.round.data + layout.dispatch_recv_offset() + index * row_bytes + offset;
    if (!a.x_is_staging) warp_copy_bytes<Load::kReadOnly>(staged, row, bytes);
    put_with_signal(dst, staged, bytes, signal, src);
  }
}

// NVLink peers get their arrivals once per expert: after the block's stores, one barrier, then one
// thread fences at system scope and adds each source's pieces with relaxed reds (a fence followed by
// writes in program order is a release of every store the barrier ordered before it). One release
// per warp and piece cost about 3 us more at 128 tokens (2x H200).
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ void combine_send(const CombineArgs& a) {
  __shared__ uint32_t pieces_to[kMaxRanks];
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int num_ranks = layout.num_ranks, num_local = layout.num_local_experts();
  const int row_units = static_cast<int>(layout.row_bytes() / 16);
  for (int local = blockIdx.x; local < num_local; local += a.num_blocks) {
    const int64_t* regions = a.recv_layout + static_cast<int64_t>(local) * num_ranks;
    // The sources' regions fill slots [0, total) one after another.
    const int64_t last = regions[num_ranks - 1];
    const int total = static_cast<int>(last >> 32) + static_cast<int>(last & 0xffffffff);
    const int pieces = row_pieces(total, row_units);
    if (warp == kWarps - 1) {
      for (int src = lane; src < num_ranks; src += 32)
        if (!is_rank_masked(a.rank_mask, src))
          announce_count(a.round.combine_signals + a.rank * num_local + local,
                         count_signal(static_cast<uint32_t>(regions[src] & 0xffffffff) * pieces), src);
    }
    for (int src = threadIdx.x; src < num_ranks; src += kThreads) pieces_to[src] = 0;
    __syncthreads();
    // Warps take (slot, piece) items in turn.
    for (int item = warp; item < total * pieces; item += kWarps)
      send_row_piece(a, local, item / pieces, item % pieces, pieces, pieces_to);
    __syncthreads();
    if (threadIdx.x == 0) {
      fence_sys();
      for (int src = 0; src < num_ranks; ++src)
        if (pieces_to[src] != 0)
          red_add_relaxed_sys(static_cast<uint64_t*>(nvshmem_ptr(a.round.combine_signals + a.rank * num_local + local, src)),
                              pieces_to[src]);
    }
  }
}

// ---- send, expert-side sums -----------------------------------------------------------------------
// Work items are (pair, piece): the dispatch's receive listed every (source, token) pair received
// here; each partial is cut into pieces so that every warp of the grid has about one item, whatever
// the token count (one warp per partial paid one memory latency per 32 units, one after another).
// A lane sums units of kChannels channels and stores 16 bytes per unit: quads (4 channels, fp32
// out) or, with bf16 partials, octets (8 channels, bf16 out). Each store instruction of a warp then
// writes 512 contiguous bytes into the peer: NVLink moves whole lines (a 32-byte lane stride wrote
// half lines and ran at about a third of the rate).
constexpr int kSumBatch = 8;   // columns loaded before the first is summed
constexpr int kMaxPartialPieces = 32;

// kChannels channels of a bf16 row: the load of one unit.
template <int kChannels>
struct Unit {
  static_assert(kChannels == 4 || kChannels == 8, "a unit is a quad or an octet");
  using Vec = std::conditional_t<kChannels == 4, int2, int4>;
  static constexpr int kPerStep = 16 / kChannels;  // units per lane and step: kSumBatch * 16 loads in flight
  static __device__ __forceinline__ Vec load(const Vec* ptr) {
    if constexpr (kChannels == 4) return ld_nc_v2(ptr); else return ld_nc_v4(ptr);
  }
};

__device__ __forceinline__ const RouteRecord* route_record(const CombineArgs& a, int src, int token) {
  return reinterpret_cast<const RouteRecord*>(a.round.data + a.layout.route_table_offset()) +
         static_cast<int64_t>(src) * a.layout.num_max_tokens + token;
}

// Pieces per partial: at most one item per warp of the grid (rounded down: a warp given a second item
// finishes a whole item after the others, and the token side waits for the last piece; 128 tokens on
// 2 ranks had 192 such warps and ended 5 us later), each at least one unit per lane.
__device__ __forceinline__ int partial_pieces(int num_pairs, int num_units, int num_warps) {
  const int wanted = num_pairs > 0 ? max(1, num_warps / num_pairs) : 1;
  return max(1, min(min(wanted, kMaxPartialPieces), num_units / 32));
}

// acc[q][0..kChannels) += the weighted sum, in k order, of units unit[q] (-1: none) of the rows of the
// columns in `mask`. Each product and sum rounded to fp32 (no FMA contraction), as the reference
// computes. NOTE: a batch's rows are loaded before any is summed; the sum stays in k order.
template <int kChannels>
__device__ __forceinline__ void sum_columns(const CombineArgs& a, const RouteRecord* record, uint32_t mask,
                                            const int (&unit)[Unit<kChannels>::kPerStep],
                                            float (&acc)[Unit<kChannels>::kPerStep][kChannels]) {
  using Vec = typename Unit<kChannels>::Vec;
  constexpr int kPerStep = Unit<kChannels>::kPerStep;
  const int64_t row_bytes = a.layout.row_bytes();
  while (mask != 0) {
    Vec packed[kSumBatch][kPerStep];
    float weight[kSumBatch];
    int n = 0;
#pragma unroll
    for (int j = 0; j < kSumBatch; ++j) {
      if (mask == 0) break;
      const int k = __ffs(mask) - 1;
      mask &= mask - 1;
      weight[j] = __ldg(record->weights + k);
      const Vec* row = reinterpret_cast<const Vec*>(static_cast<const uint8_t*>(a.x) + __ldg(record->rows + k) * row_bytes);
#pragma unroll
      for (int q = 0; q < kPerStep; ++q)
        if (unit[q] >= 0) packed[j][q] = Unit<kChannels>::load(row + unit[q]);
      n = j + 1;
    }
#pragma unroll
    for (int j = 0; j < kSumBatch; ++j) {
      if (j >= n) break;
#pragma unroll
      for (int q = 0; q < kPerStep; ++q) {
        if (unit[q] < 0) continue;
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[j][q]);
#pragma unroll
        for (int i = 0; i < kChannels / 2; ++i) {
          const float2 f = __bfloat1622float2(pairs[i]);
          acc[q][2 * i] = __fadd_rn(acc[q][2 * i], __fmul_rn(weight[j], f.x));
          acc[q][2 * i + 1] = __fadd_rn(acc[q][2 * i + 1], __fmul_rn(weight[j], f.y));
        }
      }
    }
  }
}

// Stores unit `unit` of a partial into `row`, a row of 4H bytes of combine_recv: a quad as fp32; an
// octet as bf16 (row viewed as bf16 [H]), or as fp32 when `keep_fp32` (a rank's own partial: it never
// crosses a link, so it keeps its precision).
__device__ __forceinline__ int4 float4_bits(const float* f) {
  return make_int4(__float_as_int(f[0]), __float_as_int(f[1]), __float_as_int(f[2]), __float_as_int(f[3]));
}

template <int kChannels>
__device__ __forceinline__ void store_unit(int4* row, int unit, const float (&acc)[kChannels], bool keep_fp32) {
  if constexpr (kChannels == 4) {
    st_na_v4(row + unit, float4_bits(acc));
  } else if (keep_fp32) {
    st_na_v4(row + 2 * unit, float4_bits(acc));
    st_na_v4(row + 2 * unit + 1, float4_bits(acc + 4));
  } else {
    st_na_v4(row + unit, to_bf16x8(acc));
  }
}

// Sends piece `piece` of `pieces` of the partial of (src, token) into row (token, this rank) of src's
// combine_recv, viewed as [T_max][R] rows of 4H bytes, and adds 1 to src's word of (token, this rank);
// piece 0 also announces the piece count. Warp-collective; src is reachable by NVLink (the runtime
// allows expert-side sums only then).
template <int kChannels>
__device__ void send_partial_piece(const CombineArgs& a, int src, int token, int piece, int pieces) {
  constexpr int kPerStep = Unit<kChannels>::kPerStep;
  const LowLatencyLayout& layout = a.layout;
  const RouteRecord* record = route_record(a, src, token);
  const uint32_t mask = __ldg(&record->local_mask);
  const int num_units = layout.hidden / kChannels;
  const int first_unit = piece * num_units / pieces, end_unit = (piece + 1) * num_units / pieces;
  const int64_t partial_row = static_cast<int64_t>(token) * layout.num_ranks + a.rank;
  uint8_t* dst = a.round.data + layout.combine_recv_offset() + partial_row * 4 * layout.hidden;  // symmetric
  int4* peer_dst = static_cast<int4*>(nvshmem_ptr(dst, src));
  const bool keep_fp32 = src == a.rank;
  for (int base = first_unit; base < end_unit; base += 32 * kPerStep) {
    int unit[kPerStep];
    float acc[kPerStep][kChannels];
#pragma unroll
    for (int q = 0; q < kPerStep; ++q) {
      const int candidate = base + q * 32 + lane_id();
      unit[q] = candidate < end_unit ? candidate : -1;
#pragma unroll
      for (int i = 0; i < kChannels; ++i) acc[q][i] = 0.0f;
    }
    sum_columns<kChannels>(a, record, mask, unit, acc);
#pragma unroll
    for (int q = 0; q < kPerStep; ++q)
      if (unit[q] >= 0) store_unit<kChannels>(peer_dst, unit[q], acc[q], keep_fp32);
  }
  publish_direct(a.round.combine_signals + partial_row, src,
                 piece == 0 ? count_signal(static_cast<uint32_t>(pieces)) + 1 : 1);
}

// Every warp of the grid takes (pair, piece) items in turn.
template <int kChannels>
__device__ void combine_send_sums(const CombineArgs& a) {
  const LowLatencyLayout& layout = a.layout;
  // Written by the dispatch's receive, an earlier kernel.
  const int num_pairs = static_cast<int>(ld_volatile_u32(&a.round.state->listed_pairs));
  const int num_warps = a.num_blocks * kWarps;
  const int pieces = partial_pieces(num_pairs, layout.hidden / kChannels, num_warps);
  const int32_t* pairs = reinterpret_cast<const int32_t*>(a.round.data + layout.pair_list_offset());
  for (int item = blockIdx.x * kWarps + threadIdx.x / 32; item < num_pairs * pieces; item += num_warps) {
    const int pair = __ldg(pairs + item / pieces);
    const int src = pair / layout.num_max_tokens;
    if (is_rank_masked(a.rank_mask, src)) continue;  // shrink mode: no partial to a masked rank
    send_partial_piece<kChannels>(a, src, pair % layout.num_max_tokens, item % pieces, pieces);
  }
}

// ---- receive ------------------------------------------------------------------------------------

constexpr int kReduceBatch = 8;  // top-k rows loaded before the first is summed

// out[token] = sum over k (in order) of weight * row, each product and sum rounded to fp32 as the
// reference computes it (no FMA contraction), then rounded to bf16.
// NOTE: the rows of a batch are loaded before any is summed (the loads are volatile, so the
// compiler keeps their order); the sum itself stays in k order.
// `skipped`: bit k set where entry k's expert is on a masked rank (shrink mode): it adds nothing.
__device__ void reduce_token(const CombineArgs& a, int token, uint32_t skipped) {
  const LowLatencyLayout& layout = a.layout;
  const int num_topk = a.num_topk, num_experts = layout.num_experts;
  const int64_t row_bytes = layout.row_bytes();
  const uint8_t* rows = a.round.data + layout.combine_recv_offset() + static_cast<int64_t>(token) * kMaxTopk * row_bytes;
  const int64_t* ids = a.topk_idx + static_cast<int64_t>(token) * num_topk;
  const float* weights = a.topk_weights + static_cast<int64_t>(token) * num_topk;
  int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.out) + token * row_bytes);
  const int num_units = static_cast<int>(row_bytes / 16);
  for (int u = threadIdx.x; u < num_units; u += kThreads) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    for (int first = 0; first < num_topk; first += kReduceBatch) {
      int4 packed[kReduceBatch];
      float weight[kReduceBatch];
      uint32_t loaded = 0;  // bit j: entry first + j is a valid expert and its row is in packed[j]
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        const int k = first + j;
        if (k >= num_topk || (skipped >> k & 1u)) continue;
        const int64_t id = __ldg(ids + k);
        if (id < 0 || id >= num_experts) continue;
        loaded |= 1u << j;
        weight[j] = __ldg(weights + k);
        packed[j] = ld_cg_v4(reinterpret_cast<const int4*>(rows + k * row_bytes) + u);
      }
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        if (!(loaded & (1u << j))) continue;
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[j]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(pairs[i]);
          acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(weight[j], f.x));
          acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(weight[j], f.y));
        }
      }
    }
    out[u] = to_bf16x8(acc);
  }
}

template <bool kShrink>
__device__ void combine_recv(const CombineArgs& a) {
  __shared__ bool is_last_block;
  // Per token, entries whose expert's rank is masked; two, so that warp 0 fills the next token's while
  // the other warps still read this one's (the barrier of every token keeps them one token apart).
  __shared__ uint32_t skipped_entries[2];
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int num_experts = layout.num_experts, num_local = layout.num_local_experts();

  for (int token = blockIdx.x, step = 0; token < a.num_tokens; token += a.num_blocks, step ^= 1) {
    if (warp == 0) {
      bool skip = false;
      if (lane < a.num_topk) {
        const int64_t id = __ldg(a.topk_idx + static_cast<int64_t>(token) * a.num_topk + lane);
        if (id >= 0 && id < num_experts) {
          const WaitSite site{a.status, a.error_claim, a.timeout_ns, kOpLowLatencyCombine, a.rank,
                              static_cast<int>(id), 0};
          skip = wait_signal_unless_masked<kShrink>(a.round.combine_signals + id, site,
                                                    static_cast<int>(id / num_local), a.rank_mask) == 0;
        }
      }
      if constexpr (kShrink) {
        const uint32_t skipped = __ballot_sync(0xffffffffu, skip);
        if (lane == 0) skipped_entries[step] = skipped;
      }
    }
    // NOTE: the waiting lanes' acquire loads, then this barrier, order the rows' bytes before the
    // reduction's loads (L2 only: ld.cg).
    __syncthreads();
    reduce_token(a, token, kShrink ? skipped_entries[step] : 0u);
  }

  // Reset this round's words once no block reads them any more. The last block to arrive waits
  // for every word first: an expert that returns nothing still announces 0, and that addition must
  // land before the reset, not after it.
  // NOTE: fences around the counter: every block's reads of the words happen before its
  // increment, and the last block's resets after it has seen every increment.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last_block = atomicAdd(&a.round.state->combine_blocks_done, 1u) == static_cast<uint32_t>(a.num_blocks - 1);
    __threadfence();
  }
  __syncthreads();
  if (!is_last_block) return;
  for (int expert = threadIdx.x; expert < num_experts; expert += kThreads) {
    const WaitSite site{a.status, a.error_claim, a.timeout_ns, kOpLowLatencyCombine, a.rank, expert, warp};
    uint64_t* word = a.round.combine_signals + expert;
    // A masked rank's words are left as they are (shrink mode: it may still add to them).
    if (wait_signal_unless_masked<kShrink>(word, site, expert / num_local, a.rank_mask) == 0) continue;
    // NOTE: the expert's rank adds to this word again only in the combine two rounds later, after
    // this rank's dispatch of that round, i.e. causally after this kernel ended.
    st_volatile_u64(word, 0);
  }
  if (threadIdx.x == 0) a.round.state->combine_blocks_done = 0;
}

// ---- receive, expert-side sums --------------------------------------------------------------------
// Block b: tokens b, b + B, ...: out[token] = the partials of the ranks holding its experts, added in
// rank order in fp32, rounded to bf16. The waiting lane resets its word (its only reader).
constexpr int kRecvBatch = 4;  // ranks' partials loaded before the first is added

// Quad `quad` of rank r's partial in `rows` (the token's [R] rows of 4H bytes): fp32, or bf16 in the
// row's first 2H bytes (a peer's partial with bf16_partials), widened into a 16-byte load result.
__device__ __forceinline__ int4 load_partial_quad(const uint8_t* rows, int hidden, int r, int quad, bool as_bf16) {
  const uint8_t* row = rows + static_cast<int64_t>(r) * 4 * hidden;
  if (!as_bf16) return ld_cg_v4(reinterpret_cast<const int4*>(row) + quad);
  const int2 packed = ld_cg_v2(reinterpret_cast<const int2*>(row) + quad);
  return make_int4(packed.x, packed.y, 0, 0);
}

// acc[0..4) += the quad loaded by load_partial_quad.
__device__ __forceinline__ void add_partial_quad(float (&acc)[4], const int4& loaded, bool as_bf16) {
  float f[4];
  if (as_bf16) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&loaded);
    const float2 low = __bfloat1622float2(pairs[0]), high = __bfloat1622float2(pairs[1]);
    f[0] = low.x, f[1] = low.y, f[2] = high.x, f[3] = high.y;
  } else {
    f[0] = __int_as_float(loaded.x), f[1] = __int_as_float(loaded.y);
    f[2] = __int_as_float(loaded.z), f[3] = __int_as_float(loaded.w);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
}

template <bool kShrink>
__device__ void combine_recv_sums(const CombineArgs& a) {
  __shared__ uint32_t token_ranks;
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int num_ranks = layout.num_ranks, num_local = layout.num_local_experts();
  const int num_quads = layout.hidden / 4;
  for (int token = blockIdx.x; token < a.num_tokens; token += a.num_blocks) {
    if (warp == 0) {
      uint32_t rank_bit = 0;
      if (lane < a.num_topk) {
        const int64_t id = __ldg(a.topk_idx + static_cast<int64_t>(token) * a.num_topk + lane);
        if (id >= 0 && id < layout.num_experts) rank_bit = 1u << (id / num_local);
      }
      const uint32_t ranks = __reduce_or_sync(0xffffffffu, rank_bit);
      bool lost = false;  // shrink mode: lane's rank is masked, its partial counts as zero
      if (lane < num_ranks && (ranks >> lane & 1u)) {
        uint64_t* word = a.round.combine_signals + static_cast<int64_t>(token) * num_ranks + lane;
        const WaitSite site{a.status, a.error_claim, a.timeout_ns, kOpLowLatencyCombine, a.rank, token, 0};
        lost = wait_signal_unless_masked<kShrink>(word, site, lane, a.rank_mask, kWaitTokenPartials) == 0;
        // NOTE: lane's rank adds to this word again only in the combine two rounds later, causally
        // after this kernel ended (as for the per-expert words). A masked rank's word stays as it is.
        if (!lost) st_volatile_u64(word, 0);
      }
      const uint32_t lost_ranks = kShrink ? __ballot_sync(0xffffffffu, lost) : 0u;
      if (lane == 0) token_ranks = ranks & ~lost_ranks;
    }
    // NOTE: the waiting lanes' acquire loads, then this barrier, order the partials' bytes before the
    // loads below (L2 only: ld.cg).
    __syncthreads();
    const uint32_t ranks = token_ranks;
    const uint8_t* rows = a.round.data + layout.combine_recv_offset() +
                          static_cast<int64_t>(token) * num_ranks * 4 * layout.hidden;
    int2* out = reinterpret_cast<int2*>(static_cast<uint8_t*>(a.out) + token * layout.row_bytes());
    for (int quad = threadIdx.x; quad < num_quads; quad += kThreads) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (uint32_t left = ranks; left != 0;) {
        // A batch of ranks' partials loaded before the first is added; the sum stays in rank order.
        int4 batch[kRecvBatch];
        bool as_bf16[kRecvBatch];
        int n = 0;
#pragma unroll
        for (int j = 0; j < kRecvBatch; ++j) {
          if (left == 0) break;
          const int r = __ffs(left) - 1;
          as_bf16[j] = a.bf16_partials && r != a.rank;
          batch[j] = load_partial_quad(rows, layout.hidden, r, quad, as_bf16[j]);
          left &= left - 1;
          n = j + 1;
        }
#pragma unroll
        for (int j = 0; j < kRecvBatch; ++j)
          if (j < n) add_partial_quad(acc, batch[j], as_bf16[j]);
      }
      int2 packed;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
      pairs[0] = __floats2bfloat162_rn(acc[0], acc[1]);
      pairs[1] = __floats2bfloat162_rn(acc[2], acc[3]);
      out[quad] = packed;
    }
    __syncthreads();  // token_ranks is rewritten for the next token
  }
}

// kShrink: launched with a rank mask (args.rank_mask != nullptr).
template <bool kShrink>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineArgs args) {
  if (args.phases & kPhaseSend) {
    if (args.expert_sums && args.bf16_partials) {
      combine_send_sums<8>(args);
    } else if (args.expert_sums) {
      combine_send_sums<4>(args);
    } else {
      combine_send(args);
    }
  }
  if (args.phases & kPhaseRecv) {
    if (args.expert_sums) {
      combine_recv_sums<kShrink>(args);
    } else {
      combine_recv<kShrink>(args);
    }
  }
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  EP_HOST_ASSERT(args.num_blocks > 0, "low-latency combine needs at least one block");
  EP_HOST_ASSERT(args.phases != 0, "low-latency combine launched with no phase");
  if (args.rank_mask != nullptr) {
    combine_kernel<true><<<args.num_blocks, kThreads, 0, stream>>>(args);
  } else {
    combine_kernel<false><<<args.num_blocks, kThreads, 0, stream>>>(args);
  }
  CUDA_CHECK(cudaGetLastError());
}

int combine_blocks_per_sm() {
  int blocks = 0, shrink_blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, combine_kernel<false>, kThreads, 0));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shrink_blocks, combine_kernel<true>, kThreads, 0));
  return blocks < shrink_blocks ? blocks : shrink_blocks;
}

}  // namespace ep_plugin::low_latency
