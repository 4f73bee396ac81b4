// Internode dispatch, step 2 (network leg): every token goes once to each node that holds one of
// its experts, to the forwarder (the rank of this column there), through per-(channel, node) rings.
//
// Blocks [0, B) send, blocks [B, 2B) receive. Block b of a half serves channels b, b + B, ...
// (C / B of them: sub-channels, so that with few nodes every warp drives a ring), one warp per
// (channel, node) ring:
// - a sender warp walks its channel's tokens in order and writes each token bound for its node
//   (row, scales, top-k ids and weights) into the next slot of the receiver's ring, announcing
//   them in chunks (SendRing: direct stores over NVLink, staged puts with signal over the network);
// - a receiver warp takes its ring's slots in order and writes forwarder row
//   recv_offsets[src * C + ch] + i.
//
// Both halves run in one launch (2B <= SMs, checked by the backend): a sender may wait for a
// receiver of its own rank to drain a ring (a node sends to itself through the same protocol).
#include "../common/exception.cuh"
#include "internode_layout.cuh"

namespace ep_plugin::internode {
namespace {

// Sender warp of ring (ch, dst).
__device__ void send_ring(const DispatchArgs& a, int ch, int dst) {
  const Place& place = a.c.place;
  const InternodeLayout& layout = a.layout;
  const int N = place.num_nodes;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const DispatchSlot& slot = a.slot;
  int begin, end;
  channel_range(a.num_tokens, layout.num_channels, ch, &begin, &end);
  const int64_t used_bytes = slot.num_topk > 0 ? slot.bytes() : slot.topk_offset();
  const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeDispatch, place.rank, ch, warp};
  SendRing ring(a.c, layout, kKindDispatch, ch, dst, a.send_chunk, used_bytes);
  uint64_t sent = 0;
  for (int first = begin; first < end; first += 32) {
    const int t = first + lane;
    const bool wanted = t < end && a.is_token_in_node[static_cast<int64_t>(t) * N + dst];
    if (a.send_pos != nullptr && t < end && !wanted) a.send_pos[static_cast<int64_t>(t) * N + dst] = -1;
    uint32_t mask = __ballot_sync(0xffffffffu, wanted);
    while (mask != 0) {
      const int token = first + __ffs(mask) - 1;
      mask &= mask - 1;
      const uint64_t index = ring.base() + sent;  // the index-th slot ever sent on this ring
      if (lane == 0 && a.send_pos != nullptr)
        a.send_pos[static_cast<int64_t>(token) * N + dst] = static_cast<int32_t>(sent);
      ring.wait_free(index, site);
      uint8_t* out = ring.slot(index);
      if (lane == 0) reinterpret_cast<SlotMeta*>(out)->src_token = token;
      warp_copy_bytes<Load::kReadOnly>(out + slot.row_offset(),
                      static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(token) * slot.row_bytes, slot.row_bytes);
      if (a.x_scales != nullptr)
        warp_copy_words<true>(out + slot.scales_offset(), a.x_scales + static_cast<int64_t>(token) * slot.num_scales,
                              4LL * slot.num_scales);
      if (slot.num_topk > 0) {
        warp_copy_words<true>(out + slot.topk_offset(), a.topk_idx + static_cast<int64_t>(token) * slot.num_topk,
                              8LL * slot.num_topk);
        if (slot.has_weights)
          warp_copy_words<true>(out + slot.weights_offset(),
                                a.topk_weights + static_cast<int64_t>(token) * slot.num_topk, 4LL * slot.num_topk);
      }
      ring.filled();
      ++sent;
    }
  }
  ring.close(sent);
}

// Receiver warp of ring (ch, src).
__device__ void receive_ring(const DispatchArgs& a, int ch, int src) {
  const Place& place = a.c.place;
  const InternodeLayout& layout = a.layout;
  const int C = layout.num_channels, S = layout.ring_slots;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const DispatchSlot& slot = a.slot;
  const int release_batch = S / 2 > 1 ? S / 2 : 1;  // <= S, so a sender always gets room eventually
  const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeDispatch, place.rank, ch, warp};
  const int pe = place.pe_of(src);
  const int64_t counter = counter_index(kKindDispatch, ch, src);
  const uint64_t* tail = a.c.ptr.tail + counter;
  uint64_t* head = a.c.ptr.head + counter_index(kKindDispatch, ch, place.node);  // at the sender
  uint64_t* direct_head = direct_address(a.c, head, pe);
  const uint64_t base = a.c.ptr.recv_base[counter];
  const int first_row = a.recv_offsets[src * C + ch];
  const int count = a.recv_offsets[src * C + ch + 1] - first_row;
  int released = 0;
  for (int i = 0; i < count; ++i) {
    const uint64_t index = base + i;
    if (lane == 0) wait_at_least(tail, index + 1, site, kWaitData, pe);
    // NOTE: lane 0's acquire of the tail, then the warp barrier, order the slot's bytes (delivered
    // before the signal) before every lane's ld.cg reads below.
    __syncwarp();
    const uint8_t* ring_slot = a.c.ptr.area + layout.recv_slot_offset(ch, src, static_cast<int>(index % S));
    const int64_t row = static_cast<int64_t>(first_row) + i;
    if (row < a.capacity) {  // past capacity only after a reported overflow: consume, drop
      warp_copy_bytes<Load::kL2Only>(static_cast<uint8_t*>(a.recv_x) + row * slot.row_bytes, ring_slot + slot.row_offset(),
                       slot.row_bytes);
      if (a.recv_x_scales != nullptr)
        warp_copy_words<false>(a.recv_x_scales + row * slot.num_scales, ring_slot + slot.scales_offset(),
                               4LL * slot.num_scales);
      if (a.recv_topk_idx != nullptr)
        warp_copy_words<false>(a.recv_topk_idx + row * slot.num_topk, ring_slot + slot.topk_offset(),
                               8LL * slot.num_topk);
      if (a.recv_topk_weights != nullptr)
        warp_copy_words<false>(a.recv_topk_weights + row * slot.num_topk, ring_slot + slot.weights_offset(),
                               4LL * slot.num_topk);
      if (a.recv_src_idx != nullptr && lane == 0)
        a.recv_src_idx[row] = ld_cg_s32(reinterpret_cast<const int*>(ring_slot));
    }
    __syncwarp();
    if (i + 1 - released >= release_batch || i + 1 == count) {
      if (lane == 0) release_slots(head, direct_head, static_cast<uint64_t>(i + 1 - released), pe);
      released = i + 1;
    }
  }
  if (lane == 0) a.c.ptr.recv_base[counter] = base + count;
}

// Rows past the received count (graph mode) route nowhere in the intranode stage. Receiver block b of B.
__device__ void clear_padding_ids(const DispatchArgs& a, int b) {
  if (a.recv_topk_idx == nullptr) return;
  const int N = a.c.place.num_nodes, C = a.layout.num_channels, K = a.slot.num_topk;
  const int total = a.recv_offsets[N * C];
  const int64_t first = total < a.capacity ? total : a.capacity;
  const int64_t entries = (a.capacity - first) * K;
  for (int64_t e = static_cast<int64_t>(b) * kThreads + threadIdx.x; e < entries;
       e += static_cast<int64_t>(a.num_blocks) * kThreads)
    a.recv_topk_idx[first * K + e] = -1;
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  const int B = args.num_blocks, N = args.c.place.num_nodes;
  const bool sender = static_cast<int>(blockIdx.x) < B;
  const int b = sender ? blockIdx.x : blockIdx.x - B;
  // Warp w takes the (sub-channel, node) pairs w, w + kWarps, ... of this block's C / B channels.
  const int num_pairs = args.layout.num_channels / B * N;
  for (int pair = threadIdx.x / 32; pair < num_pairs; pair += kWarps) {
    const int ch = b + pair / N * B, node = pair % N;
    if (sender) {
      send_ring(args, ch, node);
    } else {
      receive_ring(args, ch, node);
    }
  }
  if (!sender) clear_padding_ids(args, b);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  const InternodeLayout& layout = args.layout;
  EP_CHECK_ARG(layout.num_channels >= 1 && layout.num_channels <= kMaxChannels,
               "internode dispatch: num_channels must be in [1, " << kMaxChannels << "], got " << layout.num_channels);
  EP_CHECK_ARG(layout.ring_slots >= 1, "internode dispatch: ring slots must be positive");
  EP_CHECK_ARG(args.slot.bytes() <= layout.slot_bytes, "internode dispatch: slot too small for the row");
  EP_CHECK_ARG(args.slot.row_bytes % 16 == 0, "internode dispatch: rows must be a multiple of 16 bytes");
  EP_CHECK_ARG(args.num_blocks >= 1 && layout.num_channels % args.num_blocks == 0,
               "internode dispatch: num_blocks must divide num_channels");
  EP_CHECK_ARG(args.send_chunk >= 1, "internode dispatch: send_chunk must be positive");
  dispatch_kernel<<<2 * args.num_blocks, kThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::internode
