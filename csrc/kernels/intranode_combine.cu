// Intranode combine: every received row goes back to its source rank, which sums all copies of
// each token in fp32 (plus optional biases) and writes bf16.
//
// Grid: 2 blocks per channel (even = sender, odd = receiver), kWarpsPerChannel warps each.
// The receiver ("owner") side mirrors dispatch's token split: channel c owns a contiguous chunk of
// the owner's tokens and owner warp w every kWarpsPerChannel-th token of it. A sender warp w on
// rank r sends back, in token order, exactly the rows of the tokens that owner warp w handles, into
// the sub-ring (c, w) that owner warp consumes; so the owner finds the copy of its next token from
// rank r in the next slot of that ring. The owner's own copy is read straight from its input `x`.
// A wait that expires (Deadline::expired) ends its lane's or warp's part; every warp still reaches the
// block's end (finish_operation), and the outputs are undefined.
#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"

namespace ep_plugin::intranode {
namespace {

// Sends one row into the owner's ring; lane `owner` holds that ring's state.
__device__ __forceinline__ void send_row(const CombineArgs& a, const RingLayout& layout, int row, int owner,
                                         uint8_t* ring, uint64_t* remote_tail, uint32_t epoch, uint32_t chunk,
                                         uint32_t& sent, uint32_t& published) {
  const int lane = lane_id();
  uint8_t* slot = static_cast<uint8_t*>(
      shfl_ptr(lane == owner ? ring + static_cast<int64_t>(sent % layout.slots) * layout.slot_bytes : nullptr, owner));
  warp_copy_bytes<Load::kReadOnly>(slot + kSlotPayloadOffset,
                                   static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2,
                                   2LL * a.hidden);
  if (a.num_topk > 0 && lane < a.num_topk)
    reinterpret_cast<SlotMeta*>(slot)->topk_weights[lane] = a.topk_weights[static_cast<int64_t>(row) * a.num_topk + lane];
  // NOTE: the warp barrier orders every lane's slot writes before the owner's release of the tail.
  __syncwarp();
  if (lane == owner && ++sent - published >= chunk)
    st_release_sys(remote_tail, pack_counter(epoch, published = sent, false));
}

// NOTE: the sender serves its owners round-robin and never blocks on one full ring while another
// has room: an owner waits for all copies of a token, so blocking here could close a cycle.
__device__ void combine_sender(const CombineArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                               int channel, int warp, const WaitSite& site) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  // Lane s drives the sub-ring towards owner rank s and keeps its cursor over the rows to send.
  const bool owns_ring = lane < R && lane != a.rank;
  uint8_t* ring = nullptr;
  uint64_t* remote_tail = nullptr;
  const uint64_t* head = nullptr;
  if (owns_ring) {
    ring = reinterpret_cast<uint8_t*>(a.peer_buffers[lane]) + layout.ring_offset(lane, a.rank, channel, warp);
    remote_tail = &header_of(a.peer_buffers, lane)->tails[a.rank][channel][warp];
    head = &me->heads[lane][channel][warp];
  }
  // Tails are published once per chunk and at the end of each owner's turn (see dispatch).
  uint32_t sent = 0, published = 0, consumed = 0;
  const uint32_t chunk = static_cast<uint32_t>(a.send_chunk < layout.slots ? a.send_chunk : layout.slots);
  int cursor = 0, last = 0, token_begin = 0;
  for (int owner = 0; owner < R; ++owner) {
    if (owner == a.rank) continue;
    // Rows from `owner` whose source token lies in this channel's chunk of the owner's tokens.
    int begin, end;
    channel_token_range(a.src_num_tokens[owner], a.num_channels, channel, begin, end);
    const int rows_begin = a.recv_rank_offsets[owner], rows_end = a.recv_rank_offsets[owner + 1];
    const int first = warp_lower_bound(a.recv_src_idx, rows_begin, rows_end, begin);
    const int stop = warp_lower_bound(a.recv_src_idx, first, rows_end, end);
    if (lane == owner) cursor = first, last = stop, token_begin = begin;
  }

  Deadline deadline(site);
  bool expired = false;
  while (__any_sync(0xffffffffu, cursor < last)) {
    bool progressed = false;
    for (int owner = 0; owner < R; ++owner) {
      if (owner == a.rank) continue;
      int row = shfl(cursor, owner);
      const int end = shfl(last, owner), begin = shfl(token_begin, owner);
      if (row >= end) continue;
      if (lane == owner) {
        const uint64_t word = ld_acquire_sys(head);
        if (counter_epoch(word) == epoch) consumed = counter_count(word);
      }
      uint32_t free_slots = shfl(static_cast<uint32_t>(layout.slots) - (sent - consumed), owner);
      while (free_slots > 0 && row < end) {
        const int candidate = row + lane;
        const bool mine = candidate < end && (a.recv_src_idx[candidate] - begin) % kWarpsPerChannel == warp;
        const uint32_t rows = __ballot_sync(0xffffffffu, mine);
        if (rows == 0) {
          row = row + 32 < end ? row + 32 : end;
          continue;
        }
        const int next = row + __ffs(rows) - 1;
        send_row(a, layout, next, owner, ring, remote_tail, epoch, chunk, sent, published);
        row = next + 1;
        --free_slots;
        progressed = true;
      }
      if (lane == owner) {
        cursor = row;
        if (published != sent) st_release_sys(remote_tail, pack_counter(epoch, published = sent, false));
      }
    }
    if (progressed) {
      deadline.restart();
    } else if (cursor < last && deadline.expired(kWaitFreeSlot, lane, sent + 1 - layout.slots, consumed)) {
      expired = true;
      last = cursor;  // this lane's owner gets no more rows
    }
  }

  // Final count to each owner, then wait until everything sent was consumed (see dispatch).
  if (owns_ring && !expired) {
    st_release_sys(remote_tail, pack_counter(epoch, sent, true));
    Deadline drain(site);
    while (true) {
      const uint64_t word = ld_acquire_sys(head);
      if (counter_epoch(word) == epoch) consumed = counter_count(word);
      if (consumed == sent && counter_epoch(word) == epoch) break;
      if (drain.expired(kWaitDrain, lane, sent, consumed)) break;
    }
  }
}

__device__ void combine_receiver(const CombineArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                                 int channel, int warp, const WaitSite& site) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int num_units = a.hidden / 8;
  int token_begin, token_end;
  channel_token_range(a.num_tokens, a.num_channels, channel, token_begin, token_end);

  // Lane s drives the sub-ring that rank s fills with this warp's tokens.
  const bool owns_ring = lane < R && lane != a.rank;
  const uint8_t* ring = nullptr;
  const uint64_t* tail = nullptr;
  uint64_t* remote_head = nullptr;
  if (owns_ring) {
    ring = reinterpret_cast<const uint8_t*>(a.peer_buffers[a.rank]) + layout.ring_offset(a.rank, lane, channel, warp);
    tail = &me->tails[lane][channel][warp];
    remote_head = &header_of(a.peer_buffers, lane)->heads[a.rank][channel][warp];
  }
  // Heads are published once per chunk and always before waiting (the sender may be waiting for space).
  uint32_t consumed = 0, available = 0, published = 0;
  const uint32_t chunk = static_cast<uint32_t>(a.send_chunk < layout.slots ? a.send_chunk : layout.slots);
  const int4* bias_0 = static_cast<const int4*>(a.bias_0);
  const int4* bias_1 = static_cast<const int4*>(a.bias_1);

  for (int t = token_begin + warp; t < token_end; t += kWarpsPerChannel) {
    const int pos = lane < R ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
    const uint32_t src_mask = __ballot_sync(0xffffffffu, pos >= 0);

    // Wait until each remote copy of this token has arrived.
    bool expired = false;
    if (owns_ring && pos >= 0 && available <= consumed) {
      if (published != consumed) st_release_sys(remote_head, pack_counter(epoch, published = consumed, false));
      Deadline deadline(site);
      while (true) {
        const uint64_t word = ld_acquire_sys(tail);
        if (counter_epoch(word) == epoch) available = counter_count(word);
        if (available > consumed) break;
        if ((expired = deadline.expired(kWaitData, lane, consumed + 1, available))) break;
      }
    }
    if (__any_sync(0xffffffffu, expired)) return;
    // NOTE: orders the owners' acquire loads before every lane's reads of the slots.
    __syncwarp();

    const int4* src[kMaxNvlPeers];
    const float* src_weights[kMaxNvlPeers];
    const uint8_t* own_slot =
        owns_ring ? ring + static_cast<int64_t>(consumed % layout.slots) * layout.slot_bytes : nullptr;
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

    // Hand the slot back to its sender.
    __syncwarp();
    if (owns_ring && pos >= 0 && ++consumed - published >= chunk)
      st_release_sys(remote_head, pack_counter(epoch, published = consumed, false));
  }
  // Acknowledge, so that a sender with nothing for this warp can finish its drain.
  if (owns_ring) st_release_sys(remote_head, pack_counter(epoch, consumed, false));
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
