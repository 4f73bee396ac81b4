// Internode dispatch, step 1: exchange per-(destination node, channel) token counts with every
// column peer over NVSHMEM and compute where every forwarded row lands.
//
// Forwarder rows are ordered by source node, then channel, then source token index: since a
// channel is a contiguous range of the source's tokens, that is source node, then source token
// index (and with one rank per column and node, source rank, then token, as the reference).
//
// One block. Every rank takes part, with or without tokens: the step doubles as a column barrier.
#include "../common/exception.cuh"
#include "internode_layout.cuh"

namespace ep_plugin::internode {
namespace {

__device__ __forceinline__ NotifyMessage* message_at(uint8_t* area, int parity, int node) {
  return reinterpret_cast<NotifyMessage*>(area + (static_cast<int64_t>(parity) * kMaxNodes + node) * kNotifySlotBytes);
}

__global__ void __launch_bounds__(kThreads, 1) notify_kernel(const __grid_constant__ NotifyArgs a) {
  const Place& place = a.c.place;
  const int N = place.num_nodes, C = a.num_channels;
  const int warp = threadIdx.x / 32, lane = lane_id();
  __shared__ uint64_t epoch_shared;
  __shared__ int bad_source;
  if (threadIdx.x == 0) {
    epoch_shared = a.c.ptr.state->notify_epoch;
    bad_source = -1;
  }
  __syncthreads();
  const uint64_t epoch = epoch_shared;
  const int parity = static_cast<int>(epoch & 1);

  // 1. Count, per (destination node, channel), the tokens that go to that node.
  for (int pair = warp; pair < N * C; pair += kWarps) {
    const int dst = pair / C, ch = pair % C;
    int begin, end;
    channel_range(a.num_tokens, C, ch, &begin, &end);
    int count = 0;
    for (int t = begin + lane; t < end; t += 32) count += a.is_token_in_node[static_cast<int64_t>(t) * N + dst] ? 1 : 0;
    count = __reduce_add_sync(0xffffffffu, count);
    if (lane == 0) {
      message_at(a.c.ptr.notify_send, parity, dst)->counts[ch] = count;
      a.send_counts[dst * C + ch] = count;
    }
  }
  for (int dst = threadIdx.x; dst < N; dst += kThreads) {
    NotifyMessage* m = message_at(a.c.ptr.notify_send, parity, dst);
    m->row_bytes = a.row_bytes;
    m->num_scales = a.num_scales;
    m->num_topk = a.num_topk;
    m->has_weights = a.has_weights;
    m->num_channels = C;
    m->num_tokens = a.num_tokens;
  }
  // NOTE: every thread's part of the messages is written before any warp puts them.
  __syncthreads();

  // 2. Put each message into slot [parity][this node] of its destination, adding 1 to the
  // destination's signal word of this node. The slot of this parity is free there: its last use,
  // two notify steps ago, was read before the destination sent its previous message, which this
  // PE has received (it completed the previous notify step).
  for (int dst = warp; dst < N; dst += kWarps) {
    const int pe = place.pe_of(dst);
    put_slots(message_at(a.c.ptr.notify_recv, parity, place.node), message_at(a.c.ptr.notify_send, parity, dst),
              sizeof(NotifyMessage), a.c.ptr.notify_signal + place.node, 1, pe);
  }

  // 3. Wait for the message of every source (its signal word counts its notify steps).
  for (int src = threadIdx.x; src < N; src += kThreads) {
    const WaitSite site{a.c.status, a.c.error_claim, a.c.timeout_ns, kOpInternodeNotify, place.rank, -1,
                        static_cast<int>(threadIdx.x / 32)};
    wait_at_least(a.c.ptr.notify_signal + src, epoch + 1, site, kWaitBarrier, place.pe_of(src));
  }
  // NOTE: each waiting thread's acquire load, then this barrier, order the messages' bytes before
  // the reads below (which go through L2: ld.cg).
  __syncthreads();

  // 4. Offsets of (source node, channel) blocks, source-major; agreement on the row layout.
  if (threadIdx.x == 0) {
    int running = 0;
    for (int src = 0; src < N; ++src) {
      const NotifyMessage* m = message_at(a.c.ptr.notify_recv, parity, src);
      const bool same = ld_cg_s32(&m->row_bytes) == a.row_bytes && ld_cg_s32(&m->num_scales) == a.num_scales &&
                        ld_cg_s32(&m->num_topk) == a.num_topk && ld_cg_s32(&m->has_weights) == a.has_weights &&
                        ld_cg_s32(&m->num_channels) == C;
      if (!same && bad_source < 0) bad_source = src;
      for (int ch = 0; ch < C; ++ch) {
        a.recv_offsets[src * C + ch] = running;
        running += same ? ld_cg_s32(&m->counts[ch]) : 0;
      }
    }
    a.recv_offsets[N * C] = running;
    a.num_recv[0] = running;
    if (a.capacity > 0 && running > a.capacity)
      record_error(a.c.status, a.c.error_claim, kErrTooManyRecvTokens, kOpInternodeNotify, 0, place.rank, -1, -1, 0,
                   a.capacity, running);
    a.c.ptr.state->notify_epoch = epoch + 1;
    if (bad_source >= 0) {
      // A disagreement is seen by every rank of the column (each compares every message with its
      // own); the host raises before any data moves.
      a.c.status->bad_input_rank = place.pe_of(bad_source);
      a.c.status->bad_input_code = 1;
    }
    if (a.host_tag > 0) {
      a.c.status->num_recv_tokens = running;
      // NOTE: results before the tag: the host reads them once it sees the tag.
      __threadfence_system();
      a.c.status->notify_tag = a.host_tag;
    }
  }
}

}  // namespace

void launch_notify(const NotifyArgs& args, cudaStream_t stream) {
  EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
               "internode notify: num_channels must be in [1, " << kMaxChannels << "], got " << args.num_channels);
  EP_CHECK_ARG(args.c.place.num_nodes >= 1 && args.c.place.num_nodes <= kMaxNodes,
               "internode notify: at most " << kMaxNodes << " nodes, got " << args.c.place.num_nodes);
  notify_kernel<<<1, kThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::internode
