// Internode combine, network leg: the reverse of dispatch's network leg. Each forwarder returns one
// partial row per forwarder row (already reduced over its node by the intranode combine); each
// source rank sums, per token, the partial rows of the nodes it went to, in fp32 and in node order,
// adds the biases and writes bf16.
//
// Blocks [0, B) send (forwarder side), blocks [B, 2B) receive (source side); block b of a half serves
// channels b, b + B, ... (C / B sub-channels, as in dispatch).
// - Sender: one warp per (sub-channel ch, source node) ring; rows recv_offsets[src * C + ch] .. +count
//   go, in order, into ring (ch, this node) of that source.
// - Receiver: the block takes its sub-channels one after another (their senders run meanwhile, up
//   to a full ring each). A channel's tokens go in groups of G = min(kWarps, S), one token per warp.
//   A token's row from node n is slot send_pos[t, n] of ring (ch, n); rows of one ring arrive in
//   token order, so after a group every ring has been consumed up to a known count, which is
//   returned to its forwarder. G <= S keeps every slot a group needs within the sender's window.

#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "internode_layout.cuh"

namespace ep_plugin::internode {
namespace {

// Sender warp of ring (ch, src).
__device__ void send_ring(const CombineArgs& a, int ch, int src) {
  const Place& place = a.c.place;
  const InternodeLayout& layout = a.layout;
  const int C = layout.num_channels, S = layout.ring_slots;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const CombineSlot& slot = a.slot;
  const int64_t row_bytes = 2LL * slot.hidden;
  const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeCombine, place.rank, ch, warp};
  const int pe = place.pe_of(src);
  const int64_t counter = counter_index(kKindCombine, ch, src);
  uint64_t* head = a.c.ptr.head + counter;
  const uint64_t base = a.c.ptr.sent_base[counter];
  const int first_row = a.recv_offsets[src * C + ch];
  const int count = a.recv_offsets[src * C + ch + 1] - first_row;
  for (int i = 0; i < count; ++i) {
    const uint64_t index = base + i;
    const int s = static_cast<int>(index % S);
    if (lane == 0 && index + 1 > static_cast<uint64_t>(S))
      wait_at_least(head, index + 1 - S, site, kWaitFreeSlot, pe);
    __syncwarp();
    uint8_t* staged = a.c.ptr.area + layout.send_slot_offset(ch, src, s);
    const int64_t row = static_cast<int64_t>(first_row) + i;
    if (lane == 0) reinterpret_cast<SlotMeta*>(staged)->src_token = static_cast<int32_t>(row);
    if (row < a.capacity) {
      warp_copy_bytes<Load::kReadOnly>(staged + slot.row_offset(), static_cast<const uint8_t*>(a.partial_x) + row * row_bytes,
                      row_bytes);
      if (slot.num_topk > 0)
        warp_copy_words<true>(staged + slot.weights_offset(), a.partial_weights + row * slot.num_topk,
                              4LL * slot.num_topk);
    } else {  // only after a reported overflow in dispatch: keep the protocol going with zeros
      int4* zero = reinterpret_cast<int4*>(staged + slot.row_offset());
      for (int64_t u = lane; u < (slot.bytes() - slot.row_offset()) / 16; u += 32) zero[u] = make_int4(0, 0, 0, 0);
    }
    put_slot(a.c.ptr.area + layout.recv_slot_offset(ch, place.node, s), staged, slot.bytes(),
             a.c.ptr.tail + counter_index(kKindCombine, ch, place.node), pe);
  }
  if (lane == 0) a.c.ptr.sent_base[counter] = base + count;
}


__device__ void receive_channel(const CombineArgs& a, int ch) {
  __shared__ uint64_t ring_base[kMaxNodes];
  __shared__ uint32_t consumed[kMaxNodes];
  __shared__ uint32_t released[kMaxNodes];
  const Place& place = a.c.place;
  const InternodeLayout& layout = a.layout;
  const int N = place.num_nodes, C = layout.num_channels, S = layout.ring_slots;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const CombineSlot& slot = a.slot;
  const int hidden = slot.hidden, K = slot.num_topk;
  const int group = kWarps < S ? kWarps : S;
  const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeCombine, place.rank, ch, warp};
  int begin, end;
  channel_range(a.num_tokens, C, ch, &begin, &end);

  __syncthreads();  // the block's previous sub-channel has finished with the shared words
  for (int n = threadIdx.x; n < N; n += kThreads) {
    ring_base[n] = a.c.ptr.recv_base[counter_index(kKindCombine, ch, n)];
    consumed[n] = released[n] = 0;
  }
  __syncthreads();

  for (int first = begin; first < end; first += group) {
    const int token = first + warp;
    if (warp < group && token < end) {
      const int32_t* pos = a.send_pos + static_cast<int64_t>(token) * N;
      // Wait for this token's row from every node it went to.
      if (lane == 0) {
        for (int n = 0; n < N; ++n) {
          const int p = pos[n];
          if (p < 0) continue;
          wait_at_least(a.c.ptr.tail + counter_index(kKindCombine, ch, n), ring_base[n] + p + 1, site, kWaitData,
                        place.pe_of(n));
          atomicMax(&consumed[n], static_cast<uint32_t>(p + 1));
        }
      }
      // NOTE: lane 0's acquires, then the warp barrier, order the slots' bytes before the ld.cg reads.
      __syncwarp();
      // Sum in fp32, node by node (fixed order), then the biases; 8 channels per lane and step.
      const int64_t units = hidden / 8;
      for (int64_t u = lane; u < units; u += 32) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int n = 0; n < N; ++n) {
          const int p = pos[n];
          if (p < 0) continue;
          const uint8_t* ring_slot =
              a.c.ptr.area + layout.recv_slot_offset(ch, n, static_cast<int>((ring_base[n] + p) % S));
          add_bf16x8(acc, ld_cg_v4(reinterpret_cast<const int4*>(ring_slot + slot.row_offset()) + u));
        }
        if (a.bias_0 != nullptr)
          add_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.bias_0) +
                                                                 static_cast<int64_t>(token) * hidden * 2) + u));
        if (a.bias_1 != nullptr)
          add_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.bias_1) +
                                                                 static_cast<int64_t>(token) * hidden * 2) + u));
        int4 out;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
        reinterpret_cast<int4*>(static_cast<uint8_t*>(a.combined_x) + static_cast<int64_t>(token) * hidden * 2)[u] = out;
      }
      if (a.combined_weights != nullptr) {
        for (int k = lane; k < K; k += 32) {
          float sum = 0.0f;
          for (int n = 0; n < N; ++n) {
            const int p = pos[n];
            if (p < 0) continue;
            const uint8_t* ring_slot =
                a.c.ptr.area + layout.recv_slot_offset(ch, n, static_cast<int>((ring_base[n] + p) % S));
            sum += ld_cg_f32(reinterpret_cast<const float*>(ring_slot + slot.weights_offset()) + k);
          }
          a.combined_weights[static_cast<int64_t>(token) * K + k] = sum;
        }
      }
    }
    // NOTE: every warp has finished reading its slots (values already stored) before any of them
    // is returned to its forwarder.
    __syncthreads();
    for (int n = threadIdx.x; n < N; n += kThreads) {
      if (consumed[n] > released[n]) {
        release_slots(a.c.ptr.head + counter_index(kKindCombine, ch, place.node), consumed[n] - released[n],
                      place.pe_of(n));
        released[n] = consumed[n];
      }
    }
    __syncthreads();
  }
  for (int n = threadIdx.x; n < N; n += kThreads)
    a.c.ptr.recv_base[counter_index(kKindCombine, ch, n)] = ring_base[n] + a.send_counts[n * C + ch];
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineArgs args) {
  const int B = args.num_blocks, N = args.c.place.num_nodes, per_block = args.layout.num_channels / B;
  if (static_cast<int>(blockIdx.x) < B) {
    // Warp w takes the (sub-channel, node) pairs w, w + kWarps, ... of this block.
    for (int pair = threadIdx.x / 32; pair < per_block * N; pair += kWarps)
      send_ring(args, blockIdx.x + pair / N * B, pair % N);
  } else {
    for (int g = 0; g < per_block; ++g) receive_channel(args, blockIdx.x - B + g * B);
  }
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  const InternodeLayout& layout = args.layout;
  EP_CHECK_ARG(layout.num_channels >= 1 && layout.num_channels <= kMaxChannels,
               "internode combine: num_channels must be in [1, " << kMaxChannels << "], got " << layout.num_channels);
  EP_CHECK_ARG(layout.ring_slots >= 1, "internode combine: ring slots must be positive");
  EP_CHECK_ARG(args.slot.bytes() <= layout.slot_bytes, "internode combine: slot too small for the row");
  EP_CHECK_ARG(args.slot.hidden % 8 == 0, "internode combine: hidden must be a multiple of 8");
  EP_CHECK_ARG(args.num_blocks >= 1 && layout.num_channels % args.num_blocks == 0,
               "internode combine: num_blocks must divide num_channels");
  combine_kernel<<<2 * args.num_blocks, kThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::internode
