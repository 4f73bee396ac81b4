// Internode combine, network leg: the reverse of dispatch's network leg. Each forwarder returns one
// partial row per forwarder row (already reduced over its node by the intranode combine); each
// source rank sums, per token, the partial rows of the nodes it went to, in fp32 and in node order,
// adds the biases and writes bf16.
//
// Blocks [0, B) send (forwarder side), blocks [B, 2B) receive (source side); block b of a half serves
// channels b, b + B, ... (C / B sub-channels, as in dispatch).
// - Sender: one warp per (sub-channel ch, source node) ring; rows recv_offsets[src * C + ch] .. +count
//   go, in order, into ring (ch, this node) of that source.
// - Receiver: one warp group of W = kWarps / (C / B) warps per sub-channel, all at once. A channel's
//   tokens go in batches of G = min(W, S), one token per warp. A token's row from node n is slot
//   send_pos[t, n] of ring (ch, n); rows of one ring arrive in token order, so after a batch every
//   ring has been consumed up to a known count, which is returned to its forwarder. G <= S keeps
//   every slot a batch needs within the sender's window.

#include "../common/bf16.cuh"
#include "../common/exception.cuh"
#include "internode_layout.cuh"

namespace ep_plugin::internode {
namespace {

// Sender warp of ring (ch, src).
__device__ void send_ring(const CombineArgs& a, int ch, int src) {
  const Place& place = a.c.place;
  const InternodeLayout& layout = a.layout;
  const int C = layout.num_channels;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const CombineSlot& slot = a.slot;
  const int64_t row_bytes = 2LL * slot.hidden;
  const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeCombine, place.rank, ch, warp};
  const int first_row = a.recv_offsets[src * C + ch];
  const int count = a.recv_offsets[src * C + ch + 1] - first_row;
  SendRing ring(a.c, layout, kKindCombine, ch, src, a.send_chunk, slot.bytes());
  for (int i = 0; i < count; ++i) {
    const uint64_t index = ring.base() + i;
    ring.wait_free(index, site);
    uint8_t* out = ring.slot(index);
    const int64_t row = static_cast<int64_t>(first_row) + i;
    if (lane == 0) reinterpret_cast<SlotMeta*>(out)->src_token = static_cast<int32_t>(row);
    if (row < a.capacity) {
      warp_copy_bytes<Load::kReadOnly>(out + slot.row_offset(), static_cast<const uint8_t*>(a.partial_x) + row * row_bytes,
                      row_bytes);
      if (slot.num_topk > 0)
        warp_copy_words<true>(out + slot.weights_offset(), a.partial_weights + row * slot.num_topk,
                              4LL * slot.num_topk);
    } else {  // only after a reported overflow in dispatch: keep the protocol going with zeros
      int4* zero = reinterpret_cast<int4*>(out + slot.row_offset());
      for (int64_t u = lane; u < (slot.bytes() - slot.row_offset()) / 16; u += 32) zero[u] = make_int4(0, 0, 0, 0);
    }
    ring.filled();
  }
  ring.close(count);
}

constexpr int kSumUnroll = 4;  // units of 8 bf16 channels a lane sums per step

// Adds units first_unit + 32 j (j < kSumUnroll, below `units`) of each non-null row (bf16) into
// acc[j]. Every load of every row is issued before the first add; rows are added in order (the
// summation order stays node order, then bias order).
template <Load kLoad, int kRows>
__device__ __forceinline__ void add_rows(float (&acc)[kSumUnroll][8], const int4* const (&rows)[kRows],
                                         int64_t first_unit, int64_t units) {
  int4 values[kRows][kSumUnroll];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < kSumUnroll; ++j) {
      const int64_t u = first_unit + 32 * j;
      if (rows[r] != nullptr && u < units) values[r][j] = load_unit<kLoad>(rows[r] + u);
    }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < kSumUnroll; ++j)
      if (rows[r] != nullptr && first_unit + 32 * j < units) add_bf16x8(acc[j], values[r][j]);
}

// Row `token` of a [T, hidden] bf16 bias, or nullptr.
__device__ __forceinline__ const int4* bias_row(const void* bias, int token, int hidden) {
  if (bias == nullptr) return nullptr;
  return reinterpret_cast<const int4*>(static_cast<const uint8_t*>(bias) + static_cast<int64_t>(token) * hidden * 2);
}

// Barrier of one receiver warp group (named barrier `group + 1`; 0 is __syncthreads).
__device__ __forceinline__ void sync_group(int group, int num_warps) {
  asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(num_warps * 32) : "memory");
}

// Receiver warp group `group` (warps [group * W, group * W + W)) of a block: sub-channel `ch`.
// `ring_base`, `consumed`, `released`: the group's N entries of the block's shared arrays.
__device__ void receive_channel(const CombineArgs& a, int ch, int group, int num_warps, uint64_t* ring_base,
                                uint32_t* consumed, uint32_t* released) {
  const Place& place = a.c.place;
  const InternodeLayout& layout = a.layout;
  const int N = place.num_nodes, C = layout.num_channels, S = layout.ring_slots;
  const int warp = threadIdx.x / 32 - group * num_warps, lane = lane_id();
  const int thread = warp * 32 + lane, threads = num_warps * 32;
  const CombineSlot& slot = a.slot;
  const int hidden = slot.hidden, K = slot.num_topk;
  const int batch = num_warps < S ? num_warps : S;
  const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeCombine, place.rank, ch,
                      static_cast<int>(threadIdx.x / 32)};
  uint64_t* head = a.c.ptr.head + counter_index(kKindCombine, ch, place.node);  // at each forwarder
  int begin, end;
  channel_range(a.num_tokens, C, ch, &begin, &end);

  for (int n = thread; n < N; n += threads) {
    ring_base[n] = a.c.ptr.recv_base[counter_index(kKindCombine, ch, n)];
    consumed[n] = released[n] = 0;
  }
  sync_group(group, num_warps);

  for (int first = begin; first < end; first += batch) {
    const int token = first + warp;
    if (warp < batch && token < end) {
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
      // Sum in fp32, node by node (fixed order), then the biases. A lane takes kSumUnroll units of 8
      // channels per step and issues two nodes' loads of them together (one latency per two nodes).
      const int64_t units = hidden / 8;
      const int4* biases[2] = {bias_row(a.bias_0, token, hidden), bias_row(a.bias_1, token, hidden)};
      int4* out_row = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.combined_x) + static_cast<int64_t>(token) * hidden * 2);
      for (int64_t first_unit = lane; first_unit < units; first_unit += 32 * kSumUnroll) {
        float acc[kSumUnroll][8] = {};
        for (int n = 0; n < N;) {
          const int4* rows[2] = {nullptr, nullptr};  // the next two nodes this token went to, in order
          for (int found = 0; n < N && found < 2; ++n) {
            const int p = pos[n];
            if (p < 0) continue;
            const uint8_t* ring_slot =
                a.c.ptr.area + layout.recv_slot_offset(ch, n, static_cast<int>((ring_base[n] + p) % S));
            rows[found++] = reinterpret_cast<const int4*>(ring_slot + slot.row_offset());
          }
          add_rows<Load::kL2Only>(acc, rows, first_unit, units);
        }
        add_rows<Load::kReadOnly>(acc, biases, first_unit, units);
#pragma unroll
        for (int j = 0; j < kSumUnroll; ++j) {
          const int64_t u = first_unit + 32 * j;
          if (u >= units) continue;
          int4 out;
          __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
          for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[j][2 * i], acc[j][2 * i + 1]);
          out_row[u] = out;
        }
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
    // NOTE: every warp of the group has finished reading its slots (values already stored) before
    // any of them is returned to its forwarder.
    sync_group(group, num_warps);
    for (int n = thread; n < N; n += threads) {
      if (consumed[n] > released[n]) {
        const int pe = place.pe_of(n);
        release_slots(head, direct_address(a.c, head, pe), consumed[n] - released[n], pe);
        released[n] = consumed[n];
      }
    }
    sync_group(group, num_warps);
  }
  for (int n = thread; n < N; n += threads)
    a.c.ptr.recv_base[counter_index(kKindCombine, ch, n)] = ring_base[n] + a.send_counts[n * C + ch];
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineArgs args) {
  const int B = args.num_blocks, N = args.c.place.num_nodes, per_block = args.layout.num_channels / B;
  if (static_cast<int>(blockIdx.x) < B) {
    // Warp w takes the (sub-channel, node) pairs w, w + kWarps, ... of this block.
    for (int pair = threadIdx.x / 32; pair < per_block * N; pair += kWarps)
      send_ring(args, blockIdx.x + pair / N * B, pair % N);
  } else {
    // One group of kWarps / per_block warps per sub-channel, all at once (a sub-channel left
    // waiting would stall its senders once their rings are full).
    __shared__ uint64_t ring_base[kMaxNodes];
    __shared__ uint32_t consumed[kMaxNodes];
    __shared__ uint32_t released[kMaxNodes];
    const int num_warps = kWarps / per_block, group = static_cast<int>(threadIdx.x / 32) / num_warps;
    if (group < per_block)
      receive_channel(args, blockIdx.x - B + group * B, group, num_warps, ring_base + group * N,
                      consumed + group * N, released + group * N);
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
  const int per_block = layout.num_channels / args.num_blocks;
  EP_CHECK_ARG(per_block <= kWarps && per_block * layout.num_nodes <= kMaxNodes,
               "internode combine: " << per_block << " sub-channels per block of " << layout.num_nodes
                                     << " nodes need more warps or shared slots than a block has");
  EP_CHECK_ARG(args.send_chunk >= 1, "internode combine: send_chunk must be positive");
  combine_kernel<<<2 * args.num_blocks, kThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::internode
