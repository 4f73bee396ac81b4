// Intranode dispatch: every token goes once to each rank that holds one of its experts.
//
// Grid: 2 blocks per channel (even = sender, odd = receiver), kWarpsPerChannel warps each.
// Channel c owns a contiguous chunk of this rank's tokens; sender warp w takes every
// kWarpsPerChannel-th token of the chunk. Per destination rank it owns one sub-ring in that rank's
// buffer, paired with receiver warp w there: the sender writes a slot (metadata + row + scales),
// then publishes the ring tail; the receiver copies the slot to the row named in its metadata and
// publishes the ring head back. Tokens for this rank itself skip the ring: the sender writes them
// straight into recv_x. Rows come from notify's send_pos, so receivers need no ordering.
// On sm_90 on, a sender warp moves its rows by bulk copies through shared memory (WarpBulkRows), the
// next rows' loads in flight while a row is stored; metadata, scales and top-k go by plain stores.
// A wait that expires (Deadline::expired) ends its warp's part; every warp still reaches the block's
// end (finish_operation), and the outputs are undefined.
#include "../common/bulk_rows.cuh"
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"
#include "dispatch_rows.cuh"

namespace ep_plugin::intranode {
namespace {

template <bool kBulk>
__device__ void dispatch_sender(const DispatchArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                                int channel, int warp, const WaitSite& site, uint8_t* shared) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  int token_begin, token_end;
  channel_token_range(a.num_tokens, a.num_channels, channel, token_begin, token_end);
  // Warp w takes every kWarpsPerChannel-th token of the channel's chunk, from its w-th.
  const StridedTokens tokens{token_begin + warp, kWarpsPerChannel, token_end};
  SenderRows<kBulk> rows(a, shared, warp, kWarpsPerChannel);

  // Lane r drives the sub-ring towards rank r.
  const bool owns_ring = lane < R && lane != a.rank;
  uint8_t* ring = nullptr;
  uint64_t* remote_tail = nullptr;
  const uint64_t* head = nullptr;
  if (owns_ring) {
    ring = reinterpret_cast<uint8_t*>(a.peer_buffers[lane]) + layout.ring_offset(lane, a.rank, channel, warp);
    remote_tail = &header_of(a.peer_buffers, lane)->tails[a.rank][channel][warp];
    head = &me->heads[lane][channel][warp];
  }
  // NOTE: a system-scope release costs a round trip over NVLink; publish the tail once per chunk,
  // and always before waiting for ring space (the receiver can only free what it can see).
  uint32_t sent = 0, published = 0, consumed = 0;
  const uint32_t chunk = static_cast<uint32_t>(a.send_chunk < layout.slots ? a.send_chunk : layout.slots);
  const int payload_scales_offset = a.row_bytes;

  // NOTE: the next token's positions are loaded one iteration ahead; the loop is latency-bound.
  auto load_pos = [&](int t) { return lane < R && t < token_end ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1; };
  int next_pos = load_pos(token_begin + warp);
  for (int t = token_begin + warp; t < token_end; t += kWarpsPerChannel) {
    const int pos = next_pos;
    next_pos = load_pos(t + kWarpsPerChannel);
    const uint32_t dst_mask = __ballot_sync(0xffffffffu, pos >= 0);
    const int round = (t - token_begin - warp) / kWarpsPerChannel;
    if (dst_mask == 0) {
      rows.skip(round, tokens);
      continue;
    }
    // Issue the top-k loads before the row copy, which does not depend on them.
    const bool has_topk = a.num_topk > 0 && lane < a.num_topk;
    const int64_t expert = has_topk ? a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane] : -1;
    const float weight =
        has_topk && a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;

    // Reserve the next slot of each remote ring (wait while the ring is full).
    uint8_t* slot = nullptr;
    bool expired = false;
    if (owns_ring && pos >= 0) {
      if (sent - consumed >= static_cast<uint32_t>(layout.slots)) {
        if (published != sent) {
          rows.complete();
          st_release_sys(remote_tail, pack_counter(epoch, published = sent, false));
        }
        Deadline deadline(site);
        while (true) {
          const uint64_t word = ld_acquire_sys(head);
          if (counter_epoch(word) == epoch) consumed = counter_count(word);
          if (sent - consumed < static_cast<uint32_t>(layout.slots)) break;
          if ((expired = deadline.expired(kWaitFreeSlot, lane, sent + 1 - layout.slots, consumed))) break;
        }
        rows.after_slot_freed();
      }
      slot = ring + static_cast<int64_t>(sent % layout.slots) * layout.slot_bytes;
    }
    if (__any_sync(0xffffffffu, expired)) {
      rows.drain(round);
      return;
    }

    // Destinations: this rank's recv_x row, and each remote slot's payload.
    const int self_row = shfl(pos, a.rank);
    uint8_t* dst[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) {
      uint8_t* remote = static_cast<uint8_t*>(shfl_ptr(slot, r < R ? r : 0));
      dst[r] = nullptr;
      if (r < R && (dst_mask >> r & 1u))
        dst[r] = r == a.rank ? static_cast<uint8_t*>(a.recv_x) + static_cast<int64_t>(self_row) * a.row_bytes
                             : remote + kSlotPayloadOffset;
    }
    const float* token_scales = a.x_scales + static_cast<int64_t>(t) * a.scale_token_stride;
    const int num_early = early_scale_count(a);
    float early_scales[kEarlyScalesPerLane];
    load_early_scales<Load::kReadOnly>(token_scales, a.scale_stride, num_early, early_scales);
    uint8_t* const lane_dst = pos < 0 || lane >= R ? nullptr
                              : lane == a.rank ? static_cast<uint8_t*>(a.recv_x) + static_cast<int64_t>(pos) * a.row_bytes
                                               : slot + kSlotPayloadOffset;
    rows.copy(a, t, round, dst, lane_dst, tokens);

    // Scales follow the row in a slot; for this rank they go to recv_x_scales.
    for_each_scale<Load::kReadOnly>(token_scales, a.scale_stride, a.num_scales, num_early, early_scales,
                                    [&](int i, float scale) {
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r) {
        if (dst[r] == nullptr) continue;
        if (r == a.rank) a.recv_x_scales[static_cast<int64_t>(self_row) * a.num_scales + i] = scale;
        else reinterpret_cast<float*>(dst[r] + payload_scales_offset)[i] = scale;
      }
    });

    // Top-k ids become destination-local expert ids (-1 elsewhere); weights follow them.
    if (has_topk) {
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r) {
        if (dst[r] == nullptr) continue;
        const int32_t local_id = local_expert_id(expert, r, a.num_local_experts);
        const float local_weight = local_id >= 0 ? weight : 0.f;
        if (r == a.rank) {
          a.recv_topk_idx[static_cast<int64_t>(self_row) * a.num_topk + lane] = local_id;
          if (a.recv_topk_weights != nullptr)
            a.recv_topk_weights[static_cast<int64_t>(self_row) * a.num_topk + lane] = local_weight;
        } else {
          SlotMeta* meta = reinterpret_cast<SlotMeta*>(dst[r] - kSlotPayloadOffset);
          meta->topk_idx[lane] = local_id;
          meta->topk_weights[lane] = local_weight;
        }
      }
    }
    if (owns_ring && pos >= 0) {
      SlotMeta* meta = reinterpret_cast<SlotMeta*>(slot);
      meta->row = pos;
      meta->src_token = t;
    }
    if (lane == a.rank && pos >= 0 && a.recv_src_idx != nullptr) a.recv_src_idx[pos] = t;

    // NOTE: the warp barrier orders every lane's slot writes before the owner's release of the tail.
    __syncwarp();
    if (owns_ring && pos >= 0 && ++sent - published >= chunk) {
      rows.complete();
      st_release_sys(remote_tail, pack_counter(epoch, published = sent, false));
    }
    __syncwarp();
  }

  // Tell each receiver how many tokens this warp sent, then wait until it consumed them all, so
  // that no peer touches this rank's counters or rings for this epoch after the kernel ends.
  rows.complete();
  if (owns_ring) {
    st_release_sys(remote_tail, pack_counter(epoch, sent, true));
    Deadline deadline(site);
    while (true) {
      const uint64_t word = ld_acquire_sys(head);
      if (counter_epoch(word) == epoch) consumed = counter_count(word);
      if (consumed == sent && counter_epoch(word) == epoch) break;
      if (deadline.expired(kWaitDrain, lane, sent, consumed)) break;
    }
  }
  __syncwarp();
}

__device__ void copy_slot_to_outputs(const DispatchArgs& a, const uint8_t* slot) {
  const int lane = lane_id();
  const SlotMeta* meta = reinterpret_cast<const SlotMeta*>(slot);
  const int row = ld_cg_s32(&meta->row);
  const int4* payload = reinterpret_cast<const int4*>(slot + kSlotPayloadOffset);
  int4* out_row = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.recv_x) + static_cast<int64_t>(row) * a.row_bytes);
  const float* scales = reinterpret_cast<const float*>(slot + kSlotPayloadOffset + a.row_bytes);
  const int num_early = early_scale_count(a);
  float early_scales[kEarlyScalesPerLane];
  load_early_scales<Load::kL2Only>(scales, 1, num_early, early_scales);  // a slot's scales are contiguous
  warp_copy_units<Load::kL2Only>(out_row, payload, a.row_bytes / 16);
  for_each_scale<Load::kL2Only>(scales, 1, a.num_scales, num_early, early_scales, [&](int i, float scale) {
    a.recv_x_scales[static_cast<int64_t>(row) * a.num_scales + i] = scale;
  });
  if (a.num_topk > 0 && lane < a.num_topk) {
    a.recv_topk_idx[static_cast<int64_t>(row) * a.num_topk + lane] = ld_cg_s32(&meta->topk_idx[lane]);
    if (a.recv_topk_weights != nullptr)
      a.recv_topk_weights[static_cast<int64_t>(row) * a.num_topk + lane] = ld_cg_f32(&meta->topk_weights[lane]);
  }
  if (lane == 0 && a.recv_src_idx != nullptr) a.recv_src_idx[row] = ld_cg_s32(&meta->src_token);
}

__device__ void dispatch_receiver(const DispatchArgs& a, const RingLayout& layout, Header* me, uint32_t epoch,
                                  int channel, int warp, const WaitSite& site) {
  const int lane = lane_id();
  const int R = a.num_ranks;
  // Lane s drives the sub-ring that rank s fills.
  const bool owns_ring = lane < R && lane != a.rank;
  const uint8_t* ring = nullptr;
  const uint64_t* tail = nullptr;
  uint64_t* remote_head = nullptr;
  if (owns_ring) {
    ring = reinterpret_cast<const uint8_t*>(a.peer_buffers[a.rank]) + layout.ring_offset(a.rank, lane, channel, warp);
    tail = &me->tails[lane][channel][warp];
    remote_head = &header_of(a.peer_buffers, lane)->heads[a.rank][channel][warp];
  }
  uint32_t consumed = 0, available = 0;
  bool finished = !owns_ring, sender_done = false;
  Deadline deadline(site);
  while (!__all_sync(0xffffffffu, finished)) {
    if (!finished) {
      const uint64_t word = ld_acquire_sys(tail);
      if (counter_epoch(word) == epoch) {
        available = counter_count(word);
        sender_done = counter_done(word);
      }
    }
    // NOTE: orders the owners' acquire loads before every lane's reads of the slots.
    __syncwarp();
    bool progressed = false;
    for (int s = 0; s < R; ++s) {
      if (s == a.rank) continue;
      const uint32_t begin = shfl(consumed, s), end = shfl(available, s);
      const uint8_t* src_ring = static_cast<const uint8_t*>(shfl_ptr(ring, s));
      for (uint32_t i = begin; i < end; ++i)
        copy_slot_to_outputs(a, src_ring + static_cast<int64_t>(i % layout.slots) * layout.slot_bytes);
      progressed |= end != begin;
    }
    __syncwarp();
    const bool any_progress = __any_sync(0xffffffffu, progressed);
    if (!finished) {
      if (available != consumed || sender_done) {
        consumed = available;
        st_release_sys(remote_head, pack_counter(epoch, consumed, false));
        finished = sender_done;
      }
    }
    __syncwarp();
    if (any_progress) {
      deadline.restart();
    } else if (!finished) {
      finished = deadline.expired(kWaitData, lane, consumed + 1, available);
    }
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) dispatch_kernel(DispatchArgs args) {
  extern __shared__ __align__(16) uint8_t shared[];
  Header* me = header_of(args.peer_buffers, args.rank);
  if (args.only_after_fallback) {
    // Launched while the direct dispatch before it ends (programmatic dependent launch): its flag is
    // final once it has ended. It ran (the usual case): nothing to do.
    wait_for_prerequisites();
    if (me->direct_fell_back == 0) return;
  }
  // An earlier kernel of this rank failed: its inputs (send_pos, the rings) are not to be trusted.
  // NOTE: decided per warp (a kernel on another stream may claim an error meanwhile); every warp still
  // reaches finish_operation's barrier.
  const bool rank_failed = __any_sync(0xffffffffu, error_claimed(&me->error_claim));
  const uint32_t epoch = me->op_epoch + 1;
  const int channel = blockIdx.x >> 1;
  const bool is_sender = (blockIdx.x & 1) == 0;
  const int warp = threadIdx.x >> 5;
  const int payload_bytes = args.row_bytes + args.num_scales * static_cast<int>(sizeof(float));
  const RingLayout layout{args.num_ranks, args.num_channels, slots_per_sub_ring(args.recv_tokens_per_channel),
                          slot_bytes_for(payload_bytes)};
  const WaitSite site{args.status, &me->error_claim, args.timeout_ns, kOpDispatch, args.rank, channel, warp};

  if (!rank_failed) {
    if (is_sender) {
#ifdef EP_PLUGIN_HAS_BULK_COPIES
      if (args.bulk_rows) dispatch_sender<true>(args, layout, me, epoch, channel, warp, site, shared);
      else
#endif
        dispatch_sender<false>(args, layout, me, epoch, channel, warp, site, shared);
    } else {
      mark_padding_rows(args, channel, args.num_channels);
      dispatch_receiver(args, layout, me, epoch, channel, warp, site);
    }
  }
  finish_operation(me, epoch);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  check_dispatch_args(args);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(args.num_channels * 2);
  config.blockDim = dim3(kThreadsPerBlock);
  config.dynamicSmemBytes = bulk_rows_shared_bytes_for<dispatch_kernel>(args);
  config.stream = stream;
  // NOTE: after a direct dispatch, the launch overlaps that kernel's end (it calls launch_dependents
  // once its rows are written), so that the usual case, no fallback, costs no launch gap. Programmatic
  // dependent launches exist from sm_90 on; once per process, which drives one GPU.
  static const bool dependent_launches = [] {
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major >= 9;
  }();
  cudaLaunchAttribute overlap = {};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  if (args.only_after_fallback && dependent_launches) {
    config.attrs = &overlap;
    config.numAttrs = 1;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&config, dispatch_kernel, args));
}

}  // namespace ep_plugin::intranode
