// Low-latency combine: every slot that dispatch filled goes back to its source token, which sums
// its top-k rows weighted by topk_weights in fp32 and writes bf16.
//
// Send (the expert side; block b: local experts b, b + B, ...): for each source rank, announce how
// many row pieces this expert returns to it (an expert with few rows splits each into pieces so
// that all warps work); then warps send each filled slot's row of x, piece by piece, to row
// (token * kMaxTopk + k) of the source's combine_recv area and add 1 per piece to the source's
// signal word of this expert (stores + release over NVLink; put-with-signal over the network, from
// this round's dispatch_recv area used as staging, or straight from it with zero_copy).
// Receive (the token side; block b: tokens b, b + B, ...): one lane per top-k entry waits until
// the word of its expert is complete, then all threads reduce the token's rows in k order. The last
// block to finish waits for every word of the round (each expert announces a count, also of 0) and
// resets them.

#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "low_latency_layout.cuh"
#include "phase_profile.cuh"

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
// it from. Warp-collective.
__device__ void send_row_piece(const CombineArgs& a, int local, int slot, int piece, int pieces) {
  const LowLatencyLayout& layout = a.layout;
  const int64_t row_bytes = layout.row_bytes();
  const int64_t row_units = row_bytes / 16;
  const int64_t first_unit = piece * row_units / pieces, end_unit = (piece + 1) * row_units / pieces;
  const int64_t offset = first_unit * 16, bytes = (end_unit - first_unit) * 16;
  const int64_t index = static_cast<int64_t>(local) * layout.num_slots() + slot;
  const int info = a.recv_src_info[index];
  const int src = info >> kSourceRowBits;
  const int64_t dst_row = info & ((1 << kSourceRowBits) - 1);
  const uint8_t* row = static_cast<const uint8_t*>(a.x) + index * row_bytes + offset;
  uint8_t* dst = a.round.data + layout.combine_recv_offset() + dst_row * row_bytes + offset;  // symmetric address
  uint64_t* signal = a.round.combine_signals + a.rank * layout.num_local_experts() + local;
  uint8_t* peer_dst = static_cast<uint8_t*>(nvshmem_ptr(dst, src));
  if (peer_dst != nullptr) {
    warp_copy_bytes<Load::kReadOnly>(peer_dst, row, bytes);
    publish_direct(signal, src);
  } else {
    // A network peer: the put needs a symmetric source. This round's dispatch_recv area, viewed as
    // [E_local][R * T_max][H] bf16, is free once the dispatch's receive has copied it out (with
    // zero_copy, x is that area).
    uint8_t* staged = a.round.data + layout.dispatch_recv_offset() + index * row_bytes + offset;
    if (!a.x_is_staging) warp_copy_bytes<Load::kReadOnly>(staged, row, bytes);
    put_with_signal(dst, staged, bytes, signal, src);
  }
}

__device__ void combine_send(const CombineArgs& a) {
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
        announce_count(a.round.combine_signals + a.rank * num_local + local,
                       static_cast<uint32_t>(regions[src] & 0xffffffff) * pieces, src);
    }
    // Warps take (slot, piece) items in turn.
    for (int item = warp; item < total * pieces; item += kWarps)
      send_row_piece(a, local, item / pieces, item % pieces, pieces);
  }
}

// ---- receive ------------------------------------------------------------------------------------

constexpr int kReduceBatch = 8;  // top-k rows loaded before the first is summed

// out[token] = sum over k (in order) of weight * row, each product and sum rounded to fp32 as the
// reference computes it (no FMA contraction), then rounded to bf16.
// NOTE: the rows of a batch are loaded before any is summed (the loads are volatile, so the
// compiler keeps their order); the sum itself stays in k order.
__device__ void reduce_token(const CombineArgs& a, int token) {
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
        if (k >= num_topk) continue;
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

__device__ void combine_recv(const CombineArgs& a) {
  __shared__ bool is_last_block;
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int num_experts = layout.num_experts, num_local = layout.num_local_experts();

  for (int token = blockIdx.x; token < a.num_tokens; token += a.num_blocks) {
    if (warp == 0 && lane < a.num_topk) {
      const int64_t id = __ldg(a.topk_idx + static_cast<int64_t>(token) * a.num_topk + lane);
      if (id >= 0 && id < num_experts) {
        const WaitSite site{a.status, a.error_claim, a.timeout_ns, kOpLowLatencyCombine, a.rank,
                            static_cast<int>(id), 0};
        wait_signal(a.round.combine_signals + id, site, static_cast<int>(id / num_local));
      }
    }
    // NOTE: the waiting lanes' acquire loads, then this barrier, order the rows' bytes before the
    // reduction's loads (L2 only: ld.cg).
    __syncthreads();
    if (token == blockIdx.x) EP_PHASE_MARK(2);
    reduce_token(a, token);
  }
  EP_PHASE_MARK(3);

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
    wait_signal(word, site, expert / num_local);
    // NOTE: the expert's rank adds to this word again only in the combine two rounds later, after
    // this rank's dispatch of that round, i.e. causally after this kernel ended.
    st_volatile_u64(word, 0);
  }
  if (threadIdx.x == 0) a.round.state->combine_blocks_done = 0;
  EP_PHASE_MARK(4);
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineArgs args) {
  EP_PHASE_MARK(0);
  if (args.phases & kPhaseSend) {
    combine_send(args);
    EP_PHASE_SYNC();
    EP_PHASE_MARK(1);
  }
  if (args.phases & kPhaseRecv) combine_recv(args);
#ifdef EP_PLUGIN_PHASE_PROFILE
  EP_PHASE_MARK(5);
  const char* names[] = {"start", "sent", "first_wait", "reduced", "reset", "end"};
  phase_report(args.phases == (kPhaseSend | kPhaseRecv) ? "combine" : args.phases == kPhaseSend ? "combine_send" : "combine_recv",
               args.rank, args.num_tokens, names);
#endif
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  EP_HOST_ASSERT(args.num_blocks > 0, "low-latency combine needs at least one block");
  EP_HOST_ASSERT(args.phases != 0, "low-latency combine launched with no phase");
  combine_kernel<<<args.num_blocks, kThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

int combine_blocks_per_sm() {
  int blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, combine_kernel, kThreads, 0));
  return blocks;
}

}  // namespace ep_plugin::low_latency
