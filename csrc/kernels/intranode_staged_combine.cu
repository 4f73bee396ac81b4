// Copy-engine combine: the kernels on the owner's side and the sender's waits.
//
// A sender's rows for owner o are one contiguous block of its combine input (rows are ordered by
// source rank), so the host copies them into o's staging area with the copy engines, a piece per
// copy on one stream per owner; after each copy a signal stream counts the rows
// landed in o's header (runtime.cu). No SM moves a remote byte. Owner o runs `staged_reduce_kernel`: each warp
// takes tokens in order, waits (on its own header) for the rows that hold their copies, sums
// them with its own copy, and frees a piece's staging slot for its sender once every row of it is
// summed. The last block to finish tells every sender that o has released this combine's area.
// Every progress word is written where its waiter polls it, so no wait reads across NVLink.
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"

namespace ep_plugin::intranode {
namespace {

// Lane `peer` waits until `word` carries this epoch and returns its value.
__device__ __forceinline__ uint32_t wait_for_epoch(const uint64_t* word, uint32_t epoch, int peer, int kind,
                                                   const WaitSite& site) {
  Deadline deadline(site);
  while (true) {
    const uint64_t value = ld_acquire_sys(word);
    if (counter_epoch(value) == epoch) return static_cast<uint32_t>(value);
    deadline.check(kind, peer, epoch, counter_epoch(value));
  }
}

// What lane s (a source rank) knows about source s's rows in this combine.
struct SourceState {
  bool known = false;  // base and rows read from the header
  int base = 0;        // source's first row of this rank's block (its recv_rank_offsets[rank])
  int rows = 0;        // rows of this rank's block
  int landed = 0;      // rows seen landed
};

// Lane s: the staged index (slot * rows_per_piece + row in piece) of the copy at source position `pos`,
// after waiting for its piece; sets `piece` and `weights_index` (where the row's top-k weights are).
__device__ __forceinline__ int64_t wait_for_staged_row(const StagedReduceArgs& a, const StagingLayout& layout,
                                                       const Header* me, SourceState& state, int source, int pos,
                                                       int& piece, int64_t& weights_index, const WaitSite& site) {
  if (!state.known) {
    state.rows = static_cast<int>(wait_for_epoch(&me->staged_rows[source], a.epoch, source, kWaitStagedRows, site));
    state.base = static_cast<int>(wait_for_epoch(&me->staged_base[source], a.epoch, source, kWaitStagedRows, site));
    state.known = true;
  }
  const int index = pos - state.base;
  piece = index / layout.rows_per_piece;
  const int slot = piece % layout.num_slots;
  if (state.landed <= index) {
    // One copy stream per owner: copies land in order, and the word counts the rows landed.
    const uint64_t target = staged_word(a.epoch, static_cast<uint32_t>(index + 1));
    Deadline deadline(site);
    uint64_t value;
    while ((value = ld_acquire_sys(&me->staged_landed[source])) < target)
      deadline.check(kWaitStagedRows, source, index + 1, counter_epoch(value) == a.epoch ? static_cast<uint32_t>(value) : 0);
    state.landed = static_cast<int>(static_cast<uint32_t>(value));
  }
  const int64_t staged = static_cast<int64_t>(slot) * layout.rows_per_piece + index % layout.rows_per_piece;
  weights_index = layout.weights_fit_whole(state.rows, a.num_topk) ? index : staged;
  return staged;
}

// Lane s: one more row of `piece` is summed; the last one frees the piece's slot for source s.
__device__ __forceinline__ void count_summed_row(const StagedReduceArgs& a, const StagingLayout& layout, Header* me,
                                                 const SourceState& state, int source, int piece) {
  const int slot = piece % layout.num_slots;
  const int first = piece * layout.rows_per_piece;
  const uint32_t piece_rows = static_cast<uint32_t>(min(layout.rows_per_piece, state.rows - first));
  if (atomicAdd(&me->staged_rows_done[source][slot], 1u) + 1u == piece_rows) {
    // NOTE: the count is reset before the slot is freed: the next piece in this slot lands only after.
    me->staged_rows_done[source][slot] = 0;
    __threadfence();
    st_release_sys(&header_of(a.peer_buffers, source)->staged_freed[a.rank][slot], staged_word(a.epoch, piece + 1));
  }
}

// kPair: a combine of 2 ranks without bias, whose tokens have at most two copies (sum_copy_pair).
template <bool kPair>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) staged_reduce_kernel(StagedReduceArgs a) {
  Header* me = header_of(a.peer_buffers, a.rank);
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;
  const int R = a.num_ranks;
  const int num_units = a.hidden / 8;
  const StagingLayout layout = StagingLayout::fit(R, a.staging_offset, a.staging_bytes, 2LL * a.hidden);
  const WaitSite site{a.status, &me->error_claim, a.timeout_ns, kOpCombine, a.rank, -1, warp};
  const bool is_source = lane < R && lane != a.rank;
  const uint8_t* region = is_source ? static_cast<const uint8_t*>(a.peer_buffers[a.rank]) +
                                          layout.region_offset(a.rank, lane)
                                    : nullptr;
  const int4* bias_0 = static_cast<const int4*>(a.bias_0);
  const int4* bias_1 = static_cast<const int4*>(a.bias_1);
  SourceState state;

  // Warps take tokens in order across the grid, so the first pieces to land are summed first.
  const int num_warps = gridDim.x * kWarpsPerChannel;
  for (int t = blockIdx.x * kWarpsPerChannel + warp; t < a.num_tokens; t += num_warps) {
    const int pos = lane < R ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
    int piece = -1;
    int64_t staged = -1, weights_index = -1;
    if (is_source && pos >= 0)
      staged = wait_for_staged_row(a, layout, me, state, lane, pos, piece, weights_index, site);
    // NOTE: orders each lane's acquire of its source's piece before every lane's reads of the rows.
    __syncwarp();

    const int4* src[kMaxNvlPeers];
    const float* src_weights[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      const int row = shfl(pos, r < R ? r : 0);
      const int64_t index = shfl(staged, r < R ? r : 0);
      const int64_t weights_at = shfl(weights_index, r < R ? r : 0);
      const uint8_t* base = static_cast<const uint8_t*>(shfl_ptr(const_cast<uint8_t*>(region), r < R ? r : 0));
      src[r] = nullptr;
      src_weights[r] = nullptr;
      if (r >= R || row < 0) continue;
      if (r == a.rank) {
        src[r] = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2);
        src_weights[r] = a.topk_weights + static_cast<int64_t>(row) * a.num_topk;
      } else {
        src[r] = reinterpret_cast<const int4*>(base + layout.row_offset(index));
        src_weights[r] = reinterpret_cast<const float*>(base + layout.weights_offset(weights_at, a.num_topk));
      }
    }
    const int64_t row_units = static_cast<int64_t>(t) * num_units;
    int4* out = reinterpret_cast<int4*>(a.combined_x) + row_units;
    if constexpr (kPair) {
      // The copies in rank order, as sum_token_copies adds them.
      const bool has_0 = src[0] != nullptr;
      sum_copy_pair(has_0 ? src[0] : src[1], has_0 ? a.rank == 0 : a.rank == 1, has_0 ? src[1] : nullptr, a.rank == 1,
                    num_units, out);
    } else {
      sum_token_copies(src, a.rank, num_units, bias_0 == nullptr ? nullptr : bias_0 + row_units,
                       bias_1 == nullptr ? nullptr : bias_1 + row_units, out);
    }
    if (a.combined_topk_weights != nullptr)
      sum_token_weights(src_weights, a.rank, a.num_topk, a.combined_topk_weights + static_cast<int64_t>(t) * a.num_topk);
    __syncwarp();
    if (piece >= 0) count_summed_row(a, layout, me, state, lane, piece);
  }

  // The last block out releases this combine's staging areas to their senders.
  __shared__ bool last_block;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last_block = atomicAdd(&me->staged_blocks_done, 1u) + 1u == gridDim.x;
    if (last_block) me->staged_blocks_done = 0;
  }
  __syncthreads();
  if (last_block && threadIdx.x < R && threadIdx.x != a.rank) {
    __threadfence();
    st_release_sys(&header_of(a.peer_buffers, threadIdx.x)->staged_released[a.rank], a.epoch);
  }
}

__global__ void staging_wait_kernel(StagingWaitArgs a) {
  const WaitSite site{a.status, a.claim, a.timeout_ns, kOpCombine, a.rank, a.slot, 0};
  Deadline deadline(site);
  while (true) {
    const uint64_t value = ld_acquire_sys(a.word);
    if (value >= a.target) break;
    const bool same_epoch = counter_epoch(value) == counter_epoch(a.target);
    deadline.check(kWaitStagingFree, a.peer, static_cast<int64_t>(a.target & 0xffffffffu),
                   same_epoch ? static_cast<int64_t>(value & 0xffffffffu) : 0);
  }
  // NOTE: writing here saves the stream a write of its own (each costs the copy stream ~5 us).
  for (const WordWrite& then : a.then_write)
    if (then.word != nullptr) st_release_sys(then.word, then.value);
}

__global__ void write_word_kernel(uint64_t* address, uint64_t value) {
  __threadfence_system();
  st_release_sys(address, value);
}

}  // namespace

void launch_write_word(uint64_t* address, uint64_t value, cudaStream_t stream) {
  write_word_kernel<<<1, 1, 0, stream>>>(address, value);
  CUDA_CHECK(cudaGetLastError());
}

void load_staged_combine_kernels() {
  cudaFuncAttributes attributes;
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, staged_reduce_kernel<false>));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, staged_reduce_kernel<true>));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, staging_wait_kernel));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, write_word_kernel));
}

void launch_staged_reduce(const StagedReduceArgs& args, int num_blocks, cudaStream_t stream) {
  EP_CHECK_ARG(args.num_ranks >= 2 && args.num_ranks <= kMaxNvlPeers,
               "the copy-engine combine needs 2 to " << kMaxNvlPeers << " ranks, got " << args.num_ranks);
  EP_CHECK_ARG(args.hidden > 0 && args.hidden % 8 == 0, "bf16 rows must be a multiple of 16 bytes, hidden = "
                                                           << args.hidden);
  EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "top-k must be at most " << kMaxTopk);
  EP_CHECK_ARG(num_blocks >= 1, "the reduction needs at least one SM");
  if (args.pair_path && args.num_ranks == 2 && args.bias_0 == nullptr && args.bias_1 == nullptr)
    staged_reduce_kernel<true><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  else
    staged_reduce_kernel<false><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

void launch_staging_wait(const StagingWaitArgs& args, cudaStream_t stream) {
  staging_wait_kernel<<<1, 1, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
