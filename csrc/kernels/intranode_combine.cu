// Intranode combine: every received row goes back to its source rank, which sums all copies of
// each token in fp32 (plus optional biases) and writes bf16.
//
// Grid: 2 blocks per channel (even = sender, odd = receiver), kWarpsPerChannel warps each. Channel c
// owns a contiguous chunk of each owner's tokens, as in dispatch. Rows from sender s for owner o's channel
// c go, in o's token order, into one ring per (channel, sender) in o's buffer: the channel's sub-rings of
// RingLayout side by side (combine_ring_slots slots).
// - Sender block: its warps are split into one group per owner; a group sends its channel's rows for that
//   owner in chunks of send_chunk rows, one row per warp at a time, then its leader publishes the tail.
// - Receiver block: warp 0 polls each sender's tail into shared memory and returns freed slots (head) to
//   the sender; the other warps take the channel's tokens in turn, each as soon as its copies are in, and
//   mark their slots done. No receiver warp waits for one particular sender warp.
// The owner's own copy is read straight from its input `x`.
// A wait that expires (Deadline::expired) ends its warp's or group's part; every warp still reaches the
// block's end (finish_operation), and the outputs are undefined.
#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"

namespace ep_plugin::intranode {
namespace {

// Slots of a (channel, sender) ring; capped so that the receiver's done flags fit shared memory.
constexpr int kMaxCombineRingSlots = 512;
__device__ __forceinline__ int combine_ring_slots(const RingLayout& layout) {
  const int slots = layout.slots * kWarpsPerChannel;
  return slots < kMaxCombineRingSlots ? slots : kMaxCombineRingSlots;
}

// Rows a sender publishes at once, within its ring; the receiver returns slots by the same count.
__device__ __forceinline__ int combine_chunk(const CombineArgs& a, int slots) {
  return a.send_chunk < slots ? a.send_chunk : slots;
}

// The named barrier of a sender group (id 0 is __syncthreads'); the warp reconverges first (its leader
// lane may come from a wait of its own).
__device__ __forceinline__ void sync_group(int group, int threads) {
  __syncwarp();
  asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(threads) : "memory");
}

// Sender group `group` (warps w with w % (R - 1) == group) returns rows to owner rank + 1 + group.
__device__ void combine_sender(const CombineArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                               int channel, int warp, const WaitSite& site) {
  __shared__ int group_expired[kMaxNvlPeers];
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int peers = R - 1;
  if (peers == 0) return;
  const int group = warp % peers;
  const int group_warps = (kWarpsPerChannel - group + peers - 1) / peers;
  const int index_in_group = warp / peers;
  const bool leader = index_in_group == 0;
  const int owner = (a.rank + 1 + group) % R;

  // This channel's rows for `owner`: those whose source token lies in the channel's chunk of its tokens.
  int begin, end;
  channel_token_range(a.src_num_tokens[owner], a.num_channels, channel, begin, end);
  const int rows_begin = a.recv_rank_offsets[owner], rows_end = a.recv_rank_offsets[owner + 1];
  const int first = warp_lower_bound(a.recv_src_idx, rows_begin, rows_end, begin);
  const int total = warp_lower_bound(a.recv_src_idx, first, rows_end, end) - first;

  uint8_t* ring = reinterpret_cast<uint8_t*>(a.peer_buffers[owner]) + layout.ring_offset(owner, a.rank, channel, 0);
  uint64_t* remote_tail = &header_of(a.peer_buffers, owner)->tails[a.rank][channel][0];
  const uint64_t* head = &me->heads[owner][channel][0];
  const int slots = combine_ring_slots(layout);
  const int chunk = combine_chunk(a, slots);
  const int threads = group_warps * 32;
  if (leader && lane == 0) group_expired[group] = 0;
  sync_group(group, threads);

  int sent = 0;
  while (sent < total) {
    const int count = chunk < total - sent ? chunk : total - sent;
    // The leader waits for room for the chunk; the group learns the outcome at the barrier.
    if (leader && lane == 0) {
      Deadline deadline(site);
      uint32_t consumed = 0;
      while (true) {
        const uint64_t word = ld_acquire_sys(head);
        if (counter_epoch(word) == epoch) consumed = counter_count(word);
        if (sent + count - static_cast<int>(consumed) <= slots) break;
        if (deadline.expired(kWaitFreeSlot, owner, sent + count - slots, consumed)) {
          group_expired[group] = 1;
          break;
        }
      }
    }
    sync_group(group, threads);
    if (group_expired[group]) return;
    // NOTE: the warp's rows of the chunk are asked of L2 first, so that only a row's first loads wait for
    // HBM (EP4, 24 SMs: 592 against 625 us; docs/design.md, "Combine at 3-8 ranks").
    if (lane == 0)
      for (int i = index_in_group; i < count; i += group_warps)
        prefetch_to_l2(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(first + sent + i) * a.hidden * 2,
                       static_cast<uint32_t>(2 * a.hidden));
    for (int i = index_in_group; i < count; i += group_warps) {
      const int row = first + sent + i;
      uint8_t* slot = ring + static_cast<int64_t>((sent + i) % slots) * layout.slot_bytes;
      warp_copy_bytes<Load::kReadOnly>(slot + kSlotPayloadOffset,
                                       static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2,
                                       2LL * a.hidden);
      if (a.num_topk > 0 && lane < a.num_topk)
        reinterpret_cast<SlotMeta*>(slot)->topk_weights[lane] =
            a.topk_weights[static_cast<int64_t>(row) * a.num_topk + lane];
    }
    sent += count;
    // NOTE: the barrier orders every warp's slot writes before the leader's release of the tail.
    sync_group(group, threads);
    if (leader && lane == 0) st_release_sys(remote_tail, pack_counter(epoch, sent, false));
  }

  // Final count, then the leader waits until everything sent was consumed (the next operation reuses the ring).
  if (!leader || lane != 0) return;
  st_release_sys(remote_tail, pack_counter(epoch, sent, true));
  Deadline drain(site);
  while (true) {
    const uint64_t word = ld_acquire_sys(head);
    if (counter_epoch(word) == epoch && static_cast<int>(counter_count(word)) == sent) break;
    if (drain.expired(kWaitDrain, owner, sent, counter_epoch(word) == epoch ? counter_count(word) : 0)) break;
  }
}

// What the receiver block's warps share: where each sender's rows of this channel start, how far each
// sender's ring is filled, which slots are summed, and how many summing warps are done.
struct ReceiverState {
  int base[kMaxNvlPeers];                                  // [src]: src's row of the channel's first token it holds
  volatile uint32_t tail[kMaxNvlPeers];                    // [src]: rows src has published
  volatile uint8_t done[kMaxNvlPeers][kMaxCombineRingSlots];  // [src][slot]: summed, not yet returned
  volatile int retired;                                    // summing warps that have finished
};

// Warp 0, lane s: src s's row (send_pos) of the channel's first token that has a copy on s.
__device__ void find_bases(const CombineArgs& a, int token_begin, int token_end, ReceiverState& state) {
  const int lane = lane_id();
  for (int s = 0; s < a.num_ranks; ++s) {
    int base = 0;
    for (int t0 = token_begin; t0 < token_end; t0 += 32) {
      const int t = t0 + lane;
      const int pos = t < token_end ? a.send_pos[static_cast<int64_t>(t) * a.num_ranks + s] : -1;
      const uint32_t held = __ballot_sync(0xffffffffu, pos >= 0);
      if (held != 0) {
        base = shfl(pos, __ffs(held) - 1);
        break;
      }
    }
    if (lane == 0) state.base[s] = base;
  }
}

// Warp 0, lane s: moves sender s's tail into shared memory and returns summed slots to s, until every
// summing warp has finished; then the final head, so that a sender with nothing left ends its drain.
__device__ void coordinate_ring(const CombineArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                                int channel, ReceiverState& state) {
  const int lane = lane_id();
  const bool owns_ring = lane < a.num_ranks && lane != a.rank;
  const uint64_t* tail = owns_ring ? &me->tails[lane][channel][0] : nullptr;
  uint64_t* remote_head = owns_ring ? &header_of(a.peer_buffers, lane)->heads[a.rank][channel][0] : nullptr;
  const int slots = combine_ring_slots(layout);
  const uint32_t chunk = static_cast<uint32_t>(combine_chunk(a, slots));
  uint32_t head = 0, published = 0;
  while (true) {
    const bool finished = state.retired == kWarpsPerChannel - 1;
    if (owns_ring) {
      const uint64_t word = ld_acquire_sys(tail);
      if (counter_epoch(word) == epoch) state.tail[lane] = counter_count(word);
      while (state.done[lane][head % slots]) {
        state.done[lane][head % slots] = 0;
        ++head;
      }
      // Once per chunk, and whenever everything that arrived is summed: a sender whose next chunk needs
      // the slots of a partial chunk would otherwise wait for them.
      if (head != published && (head - published >= chunk || head == state.tail[lane]))
        st_release_sys(remote_head, pack_counter(epoch, published = head, false));
    }
    if (__all_sync(0xffffffffu, finished)) break;
  }
  if (owns_ring) st_release_sys(remote_head, pack_counter(epoch, head, false));
}

// Summing warp `warp` (1..): tokens token_begin + warp - 1, then every (kWarpsPerChannel - 1)-th.
__device__ void sum_channel_tokens(const CombineArgs& a, const RingLayout& layout, int channel, int warp,
                                   int token_begin, int token_end, ReceiverState& state, const WaitSite& site) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int num_units = a.hidden / 8;
  const int slots = combine_ring_slots(layout);
  // Lane s: the ring that sender s fills for this channel.
  const bool is_source = lane < R && lane != a.rank;
  const uint8_t* ring = is_source ? reinterpret_cast<const uint8_t*>(a.peer_buffers[a.rank]) +
                                        layout.ring_offset(a.rank, lane, channel, 0)
                                  : nullptr;
  const int4* bias_0 = static_cast<const int4*>(a.bias_0);
  const int4* bias_1 = static_cast<const int4*>(a.bias_1);
  const int base = is_source ? state.base[lane] : 0;
  for (int t = token_begin + warp - 1; t < token_end; t += kWarpsPerChannel - 1) {
    const int pos = lane < R ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
    const uint32_t src_mask = __ballot_sync(0xffffffffu, pos >= 0);
    const bool remote = is_source && pos >= 0;
    const uint32_t index = remote ? static_cast<uint32_t>(pos - base) : 0u;  // the row's place in s's stream
    // The own copy (user memory) is asked of L2 while the remote copies arrive.
    if (lane == a.rank && pos >= 0)
      prefetch_to_l2(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(pos) * a.hidden * 2,
                     static_cast<uint32_t>(2 * a.hidden));

    // Wait until each remote copy of this token is in its ring.
    bool expired = false;
    if (remote) {
      Deadline deadline(site);
      while (state.tail[lane] <= index)
        if ((expired = deadline.expired(kWaitData, lane, index + 1, state.tail[lane]))) break;
    }
    if (__any_sync(0xffffffffu, expired)) break;
    // NOTE: orders the warp's reads of the tails (acquired by warp 0) before its reads of the slots.
    __threadfence_block();
    __syncwarp();

    const uint8_t* own_slot = remote ? ring + static_cast<int64_t>(index % slots) * layout.slot_bytes : nullptr;
    // NOTE: each remote copy is asked of L2 once in (a warp reads a row in several dependent batches):
    // EP4, 24 SMs 584 against 594 us, 8 SMs 1414 against 1548 (docs/design.md, "Combine at 3-8 ranks").
    if (remote) prefetch_to_l2(own_slot + kSlotPayloadOffset, static_cast<uint32_t>(2 * a.hidden));
    const int4* src[kMaxNvlPeers];
    const float* src_weights[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      const uint8_t* slot = static_cast<const uint8_t*>(shfl_ptr(own_slot, r < R ? r : 0));
      const int row = shfl(pos, r < R ? r : 0);
      src[r] = nullptr;
      src_weights[r] = nullptr;
      if (r < R && (src_mask >> r & 1u)) {
        if (r == a.rank) {
          src[r] = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2);
          src_weights[r] = a.topk_weights + static_cast<int64_t>(row) * a.num_topk;
        } else {
          src[r] = reinterpret_cast<const int4*>(slot + kSlotPayloadOffset);
          src_weights[r] = reinterpret_cast<const SlotMeta*>(slot)->topk_weights;
        }
      }
    }
    const int64_t row_units = static_cast<int64_t>(t) * num_units;
    sum_token_copies(src, a.rank, num_units, bias_0 == nullptr ? nullptr : bias_0 + row_units,
                     bias_1 == nullptr ? nullptr : bias_1 + row_units,
                     reinterpret_cast<int4*>(a.combined_x) + row_units);
    if (a.combined_topk_weights != nullptr)
      sum_token_weights(src_weights, a.rank, a.num_topk, a.combined_topk_weights + static_cast<int64_t>(t) * a.num_topk);

    // NOTE: every lane's reads of the slots are done before the slot is marked summed.
    __syncwarp();
    __threadfence_block();
    if (remote) state.done[lane][index % slots] = 1;
  }
  __syncwarp();
  if (lane == 0) atomicAdd(const_cast<int*>(&state.retired), 1);
}

__device__ void combine_receiver(const CombineArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                                 int channel, int warp, const WaitSite& site) {
  __shared__ ReceiverState state;
  int token_begin, token_end;
  channel_token_range(a.num_tokens, a.num_channels, channel, token_begin, token_end);
  for (int i = threadIdx.x; i < kMaxNvlPeers * kMaxCombineRingSlots; i += blockDim.x)
    state.done[i / kMaxCombineRingSlots][i % kMaxCombineRingSlots] = 0;
  if (threadIdx.x < kMaxNvlPeers) state.tail[threadIdx.x] = 0;
  if (threadIdx.x == 0) state.retired = 0;
  if (warp == 0) find_bases(a, token_begin, token_end, state);
  __syncthreads();
  if (warp == 0) coordinate_ring(a, layout, me, epoch, channel, state);
  else sum_channel_tokens(a, layout, channel, warp, token_begin, token_end, state, site);
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_kernel(CombineArgs args) {
  Header* me = header_of(args.peer_buffers, args.rank);
  // An earlier kernel of this rank failed: its rings are not to be trusted (see dispatch_kernel).
  const bool rank_failed = __any_sync(0xffffffffu, error_claimed(&me->error_claim));
  const uint32_t epoch = me->op_epoch + 1;
  const int channel = blockIdx.x >> 1;
  const int warp = threadIdx.x >> 5;
  const RingLayout layout{args.num_ranks, args.num_channels, slots_per_sub_ring(args.recv_tokens_per_channel),
                          slot_bytes_for(static_cast<int64_t>(args.hidden) * 2)};
  const WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpCombine, args.rank, channel, warp};
  if (!rank_failed) {
    if ((blockIdx.x & 1) == 0) combine_sender(args, layout, me, epoch, channel, warp, site);
    else combine_receiver(args, layout, me, epoch, channel, warp, site);
  }
  finish_operation(me, epoch);
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  EP_CHECK_ARG(args.num_ranks >= 1 && args.num_ranks <= kMaxNvlPeers,
               "intranode kernels support 1 to " << kMaxNvlPeers << " ranks, got " << args.num_ranks);
  EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
               "channels (num_sms / 2) must be in [1, " << kMaxChannels << "], got " << args.num_channels);
  EP_CHECK_ARG(args.hidden > 0 && args.hidden % 8 == 0, "bf16 rows must be a multiple of 16 bytes, hidden = "
                                                           << args.hidden);
  EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "top-k must be at most " << kMaxTopk);
  EP_CHECK_ARG(args.send_chunk >= 1, "num_max_nvl_chunked_send_tokens must be >= 1");
  combine_kernel<<<args.num_channels * 2, kThreadsPerBlock, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
