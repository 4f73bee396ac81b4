// Internode normal mode, network leg: how the symmetric (NVSHMEM) buffer is carved, the ring
// protocol, and the Args struct + launcher of each kernel family. The single source of truth for
// the size hint (ep_plugin/tuning.py `Config.get_rdma_buffer_size_hint` mirrors
// `InternodeLayout::total_bytes`; tests/test_native_internode.py keeps both equal).
//
// Hierarchy. Rank r = node * L + local (L ranks per node, N nodes). The network leg only ever
// connects ranks of one "column": the N ranks with the same local index. A token crosses the
// network at most once per destination node, to the rank of its column there (the forwarder),
// which then forwards it over NVLink (the intranode kernels, run by the Python backend).
//
// Buffer of num_rdma_bytes, identical on every PE (symmetric):
//
//   [ header: kHeaderBytes (fixed offsets, zero at start)                                  ]
//   [ dispatch rings: at kHeaderBytes          | combine rings: at kHeaderBytes + stride  ]
//   stride = kind_stride(num_rdma_bytes): the two kinds never overlap, whatever a call's sizes.
//
// Each kind's area, for C channels, N nodes, S slots per ring and slot_bytes per slot:
//   recv rings    [C][N][S] slots: ring (channel, peer node) receives what that peer sends here
//   send staging  [C][N][S] slots: a put's source (the network reads it from symmetric memory)
//   size formula: 2 * C * N * S * slot_bytes.
//
// Ring protocol (per kind, channel, pair of column peers), with counters that never reset:
//   tail[kind][ch][src]   at the receiver: the sender's put-with-signal adds 1 per slot.
//   head[kind][ch][dst]   at the sender: the receiver adds the slots it has consumed.
//   sent_base / recv_base local totals of slots moved so far (both sides agree, because every
//                         call moves exactly the counts the notify step exchanged).
//   The a-th slot ever sent on a ring (a = base + k) lives at index a % S; the sender waits for
//   head >= a + 1 - S before reusing it, the receiver for tail >= a + 1 before reading it.
//   A sender announces its slots in chunks (send_chunk, and never across the ring's end):
//   - peer reached by nvshmem_ptr (NVLink, or this GPU): rows are stored straight into the
//     receiver's slots, then one release add of the chunk's count to its tail;
//   - any other peer (the network): rows are staged in the send slots, then one put with signal
//     carries the chunk's consecutive slots and adds its count.
//   Before a wait for a free slot the sender announces what it holds, so no chunk size can
//   deadlock. `Common::puts_only` forces the network path even where nvshmem_ptr reaches the
//   peer (YAML network.force_puts: runs the RDMA code path on an NVLink-only machine).
//
// Notify (per non-cached dispatch): every rank puts its per-(destination node, channel) token
// counts to each column peer (parity-double-buffered slots, a signal word per source that only
// grows); the receiver waits for the count of every source, so the notify step is also a column
// barrier: when it returns, every column peer has finished all its earlier kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../common/status.h"

namespace ep_plugin::internode {

constexpr int kMaxNodes = 256;          // column peers (nodes) of one group
constexpr int kMaxChannels = 128;       // = ep_plugin.tuning.INTERNODE_MAX_CHANNELS (sub-channels: up to 2 per SM)
constexpr int kMaxTopk = 32;            // = ep_plugin.tuning.MAX_TOPK
constexpr int kThreads = 512;           // threads of every internode kernel block
constexpr int kWarps = kThreads / 32;
constexpr int kSlotMetaBytes = 16;      // SlotMeta at the start of every slot
// Bytes a slot needs beyond the 16-byte-aligned row: meta, top-k ids and weights at the largest
// top-k, and 16 bytes of alignment slack (FP8 rows carry their scales in the row budget).
constexpr int64_t kSlotExtraBytes = kSlotMetaBytes + 8 * kMaxTopk + 4 * kMaxTopk + 16;
constexpr int64_t kAreaAlign = 128;
constexpr int kNotifySlotBytes = 1024;  // one notify message: NotifyMessage, padded
constexpr int kNumKinds = 2;

enum Kind : int { kKindDispatch = 0, kKindCombine = 1 };

__host__ __device__ constexpr int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// First 16 bytes of every slot.
struct SlotMeta {
  int32_t src_token;  // token index on the source rank (dispatch), source row (combine)
  int32_t reserved[3];
};
static_assert(sizeof(SlotMeta) == kSlotMetaBytes, "SlotMeta must stay 16 bytes");

// What a rank tells each column peer in the notify step.
struct NotifyMessage {
  int32_t counts[kMaxChannels];  // tokens it sends to that peer, per channel
  int32_t row_bytes, num_scales, num_topk, has_weights, num_channels, num_tokens;
  int32_t reserved[2];
};
static_assert(sizeof(NotifyMessage) <= kNotifySlotBytes, "NotifyMessage must fit its slot");

// Local bookkeeping of this PE (never written by a peer).
struct State {
  uint64_t notify_epoch;  // notify steps completed by this PE
  int32_t error_claim;    // the first device error of this PE claims it
  int32_t reserved[29];
};
static_assert(sizeof(State) == 128, "State must stay 128 bytes");

// ---- the header: fixed offsets ------------------------------------------------------------------
constexpr int64_t kCounterWords = static_cast<int64_t>(kNumKinds) * kMaxChannels * kMaxNodes;
constexpr int64_t kNotifyRecvOffset = 0;                                          // [2][kMaxNodes] slots
constexpr int64_t kNotifySendOffset = kNotifyRecvOffset + 2LL * kMaxNodes * kNotifySlotBytes;  // [2][kMaxNodes]
constexpr int64_t kNotifySignalOffset = kNotifySendOffset + 2LL * kMaxNodes * kNotifySlotBytes;  // u64 [kMaxNodes]
constexpr int64_t kTailOffset = kNotifySignalOffset + 8LL * kMaxNodes;            // u64 [kind][ch][node]
constexpr int64_t kHeadOffset = kTailOffset + 8 * kCounterWords;                  // u64 [kind][ch][node]
constexpr int64_t kSentBaseOffset = kHeadOffset + 8 * kCounterWords;              // u64 [kind][ch][node]
constexpr int64_t kRecvBaseOffset = kSentBaseOffset + 8 * kCounterWords;          // u64 [kind][ch][node]
constexpr int64_t kStateOffset = kRecvBaseOffset + 8 * kCounterWords;             // State
constexpr int64_t kHeaderBytes = align_up(kStateOffset + static_cast<int64_t>(sizeof(State)), 1 << 20);

__host__ __device__ constexpr int64_t counter_index(int kind, int channel, int node) {
  return (static_cast<int64_t>(kind) * kMaxChannels + channel) * kMaxNodes + node;
}

// Bytes between the starts of the dispatch and the combine area in a buffer of `num_bytes`.
__host__ __device__ inline int64_t kind_stride(int64_t num_bytes) {
  const int64_t data = num_bytes > kHeaderBytes ? num_bytes - kHeaderBytes : 0;
  return data / 2 / kAreaAlign * kAreaAlign;
}

// Token range of channel `ch` among `num_tokens` tokens (contiguous, in token order).
__host__ __device__ inline void channel_range(int num_tokens, int num_channels, int ch, int* begin, int* end) {
  const int per = (num_tokens + num_channels - 1) / num_channels;
  const int b = ch * per;
  *begin = b < num_tokens ? b : num_tokens;
  *end = b + per < num_tokens ? b + per : num_tokens;
}

// ---- slots ------------------------------------------------------------------------------------
// Dispatch slot: meta | row (row_bytes) | scales (float) | top-k ids (int64, global) | weights.
// Each part starts 16-byte aligned. A cached dispatch uses the same offsets for row and scales.
struct DispatchSlot {
  int row_bytes, num_scales, num_topk, has_weights;
  __host__ __device__ int64_t row_offset() const { return kSlotMetaBytes; }
  __host__ __device__ int64_t scales_offset() const { return row_offset() + align_up(row_bytes, 16); }
  __host__ __device__ int64_t topk_offset() const { return scales_offset() + align_up(4LL * num_scales, 16); }
  __host__ __device__ int64_t weights_offset() const { return topk_offset() + align_up(8LL * num_topk, 16); }
  __host__ __device__ int64_t bytes() const {
    return weights_offset() + (has_weights ? align_up(4LL * num_topk, 16) : 0);
  }
};

// Combine slot: meta | bf16 row (2H) | weights (float, K).
struct CombineSlot {
  int hidden, num_topk;
  __host__ __device__ int64_t row_offset() const { return kSlotMetaBytes; }
  __host__ __device__ int64_t weights_offset() const { return row_offset() + align_up(2LL * hidden, 16); }
  __host__ __device__ int64_t bytes() const { return weights_offset() + align_up(4LL * num_topk, 16); }
};

// Slot bytes the size hint reserves for rows of `hidden_bytes` (DeepEP's hidden * max(elem, 2)).
__host__ __device__ constexpr int64_t hint_slot_bytes(int64_t hidden_bytes) {
  return align_up(hidden_bytes, 16) + kSlotExtraBytes;
}

// ---- one kind's area ----------------------------------------------------------------------------
struct InternodeLayout {
  int num_nodes;      // N
  int num_channels;   // C
  int ring_slots;     // S (num_max_rdma_chunked_recv_tokens)
  int64_t slot_bytes; // a multiple of 16

  // recv rings = C * N * S * slot_bytes; send staging the same.
  __host__ __device__ int64_t ring_bytes() const {
    return static_cast<int64_t>(num_channels) * num_nodes * ring_slots * slot_bytes;
  }
  __host__ __device__ int64_t kind_bytes() const { return align_up(2 * ring_bytes(), kAreaAlign); }
  // Bytes a buffer needs: the header, then two kinds (Config.get_rdma_buffer_size_hint).
  __host__ __device__ int64_t total_bytes() const { return kHeaderBytes + 2 * kind_bytes(); }
  __host__ __device__ bool fits(int64_t num_bytes) const { return kind_bytes() <= kind_stride(num_bytes); }

  __host__ __device__ int64_t slot_index(int channel, int node, int slot) const {
    return (static_cast<int64_t>(channel) * num_nodes + node) * ring_slots + slot;
  }
  __host__ __device__ int64_t recv_slot_offset(int channel, int node, int slot) const {
    return slot_index(channel, node, slot) * slot_bytes;
  }
  __host__ __device__ int64_t send_slot_offset(int channel, int node, int slot) const {
    return ring_bytes() + slot_index(channel, node, slot) * slot_bytes;
  }
};

// Local symmetric addresses of the header and of one kind's area (valid as NVSHMEM `dest`).
struct Pointers {
  uint8_t* notify_recv;     // [2][kMaxNodes][kNotifySlotBytes]
  uint8_t* notify_send;     // [2][kMaxNodes][kNotifySlotBytes]
  uint64_t* notify_signal;  // [kMaxNodes]
  uint64_t* tail;           // [kind][ch][node]
  uint64_t* head;
  uint64_t* sent_base;
  uint64_t* recv_base;
  State* state;
  uint8_t* area;            // this call's kind area
};

__host__ __device__ inline Pointers make_pointers(void* buffer, int64_t num_bytes, int kind) {
  uint8_t* base = static_cast<uint8_t*>(buffer);
  Pointers p;
  p.notify_recv = base + kNotifyRecvOffset;
  p.notify_send = base + kNotifySendOffset;
  p.notify_signal = reinterpret_cast<uint64_t*>(base + kNotifySignalOffset);
  p.tail = reinterpret_cast<uint64_t*>(base + kTailOffset);
  p.head = reinterpret_cast<uint64_t*>(base + kHeadOffset);
  p.sent_base = reinterpret_cast<uint64_t*>(base + kSentBaseOffset);
  p.recv_base = reinterpret_cast<uint64_t*>(base + kRecvBaseOffset);
  p.state = reinterpret_cast<State*>(base + kStateOffset);
  p.area = base + kHeaderBytes + kind * kind_stride(num_bytes);
  return p;
}

// Where this rank sits. Column peer of node n: PE n * ranks_per_node + local.
struct Place {
  int rank, node, local, ranks_per_node, num_nodes;
  __host__ __device__ int pe_of(int node_index) const { return node_index * ranks_per_node + local; }
};

// ---- kernel families -----------------------------------------------------------------------------
// Fields marked (runtime) are filled by InternodeRuntime; the rest by the caller.
struct Common {
  Pointers ptr;                     // (runtime)
  Place place;                      // (runtime)
  DeviceStatus* status;             // (runtime)
  int* error_claim;                 // (runtime)
  uint64_t timeout_ns;              // (runtime)
  bool puts_only;                   // (runtime) never store straight into a peer's buffer
};

struct NotifyArgs {
  Common c;
  int num_channels, num_tokens;
  const bool* is_token_in_node;     // [T, N]
  int row_bytes, num_scales, num_topk, has_weights;  // compared across the column
  int32_t* send_counts;             // [N * C] out: tokens to node n in channel ch at n * C + ch
  int32_t* recv_offsets;            // [N * C + 1] out: first forwarder row of (source node, channel)
  int32_t* num_recv;                // [1] out: rows this rank receives over the network
  int capacity;                     // > 0 (graph mode): rows allocated; more is an error
  int32_t host_tag;                 // > 0: publish the result to `status` with this tag; 0: graph mode
};
void launch_notify(const NotifyArgs& args, cudaStream_t stream);

struct DispatchArgs {
  Common c;
  InternodeLayout layout;
  int num_blocks;                   // B blocks send and B receive; block b serves channels b, b + B, ... (C % B == 0)
  int send_chunk;                   // slots a sender announces at once (>= 1)
  DispatchSlot slot;                // num_topk = 0 for a cached dispatch
  int num_tokens;
  const void* x;                    // [T, row_bytes]
  const float* x_scales;            // [T, num_scales] or nullptr
  const int64_t* topk_idx;          // [T, K] or nullptr (cached)
  const float* topk_weights;        // [T, K] or nullptr
  const bool* is_token_in_node;     // [T, N]
  int32_t* send_pos;                // [T, N] out (nullptr when cached): index in its (channel, node) stream, or -1
  const int32_t* recv_offsets;      // [N * C + 1]
  // Forwarder rows (capacity rows; rows past the received count get top-k ids -1).
  int capacity;
  void* recv_x;                     // [capacity, row_bytes]
  float* recv_x_scales;             // [capacity, num_scales] or nullptr
  int64_t* recv_topk_idx;           // [capacity, K] or nullptr
  float* recv_topk_weights;         // [capacity, K] or nullptr
  int32_t* recv_src_idx;            // [capacity] or nullptr
};
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);

struct CombineArgs {
  Common c;
  InternodeLayout layout;
  int num_blocks;                   // as in DispatchArgs
  int send_chunk;                   // as in DispatchArgs
  CombineSlot slot;                 // num_topk = 0 without weights
  // Forwarder side: one partial row per forwarder row (the intranode combine's output).
  int capacity;                     // rows of partial_x
  const void* partial_x;            // [capacity, H] bf16
  const float* partial_weights;     // [capacity, K] or nullptr
  const int32_t* recv_offsets;      // [N * C + 1] from the dispatch
  // Source side.
  int num_tokens;
  const bool* is_token_in_node;     // [T, N]
  const int32_t* send_pos;          // [T, N] from the dispatch
  const int32_t* send_counts;       // [N * C] from the dispatch
  const void* bias_0;               // [T, H] bf16 or nullptr
  const void* bias_1;
  void* combined_x;                 // [T, H] bf16
  float* combined_weights;          // [T, K] or nullptr
};
void launch_combine(const CombineArgs& args, cudaStream_t stream);

}  // namespace ep_plugin::internode

// ---- device helpers shared by the internode kernels ------------------------------------------------
// Only NVSHMEM's standard device API (put with signal, signal operations): the transport is a
// configuration choice.
#if defined(__CUDACC__)
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../common/copy.cuh"
#include "../common/device_status.cuh"
#include "../common/ptx.cuh"

namespace ep_plugin::internode {

// Spins (one thread) until the local counter `word` reaches `target`; returns its value.
__device__ __forceinline__ uint64_t wait_at_least(const uint64_t* word, uint64_t target, const WaitSite& site,
                                                  int kind, int peer) {
  Deadline deadline(site);
  while (true) {
    const uint64_t value = ld_acquire_sys(word);
    if (value >= target) return value;
    deadline.check(kind, peer, static_cast<int64_t>(target), static_cast<int64_t>(value));
  }
}

// Warp copy of `bytes` (a multiple of 4) between 4-byte-aligned addresses.
template <bool kReadOnlySource>
__device__ __forceinline__ void warp_copy_words(void* dst, const void* src, int64_t bytes) {
  int* d = static_cast<int*>(dst);
  const int* s = static_cast<const int*>(src);
  for (int64_t i = lane_id(); i < bytes / 4; i += 32) d[i] = kReadOnlySource ? __ldg(s + i) : ld_cg_s32(s + i);
}

// `symmetric` (an address in this PE's buffer) as stored to on `pe`, or nullptr where the network
// (or Common::puts_only) stands between them.
template <typename T>
__device__ __forceinline__ T* direct_address(const Common& c, T* symmetric, int pe) {
  return c.puts_only ? nullptr : static_cast<T*>(nvshmem_ptr(symmetric, pe));
}

// Sends `bytes` from the local symmetric `src` to the symmetric `dst` on `pe`, then adds `count`
// to `signal` there (delivered after the bytes: NVSHMEM's put-with-signal). Warp-collective.
// NOTE: the transport reads `src` from memory: every lane's stores to it are made visible at
// system scope, and the warp is converged, before the put is issued.
__device__ __forceinline__ void put_slots(void* dst, const void* src, int64_t bytes, uint64_t* signal, uint64_t count,
                                          int pe) {
  __threadfence_system();
  __syncwarp();
  nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(bytes), signal, count, NVSHMEM_SIGNAL_ADD, pe);
  __syncwarp();
}

// Returns `count` consumed slots to the sender `pe` (adds to its head word `head`, symmetric;
// `direct_head` is the same word through nvshmem_ptr, or nullptr). One thread.
// NOTE: called after the warp has finished reading those slots (the loaded values were already
// stored elsewhere, so the loads are complete): the sender may overwrite them once it sees this.
// Additions commute, so several releases in flight can land in any order. Each head word has a
// single writer, which always takes the same path (a NIC's atomics and the GPU's are not atomic
// with each other on one word).
__device__ __forceinline__ void release_slots(uint64_t* head, uint64_t* direct_head, uint64_t count, int pe) {
  if (direct_head != nullptr) {
    red_add_release_sys(direct_head, count);
  } else {
    __threadfence_system();
    nvshmemx_signal_op(head, count, NVSHMEM_SIGNAL_ADD, pe);
  }
}

// The sending side of ring (kind, channel, destination node), held by one warp (every lane keeps
// the same copy): its slots, counters and announcements. The a-th slot ever sent on the ring is
// slot(a); after writing it, the warp calls filled(); close() announces the rest.
class SendRing {
 public:
  // `used_bytes`: bytes of each slot that carry data in this call.
  __device__ SendRing(const Common& c, const InternodeLayout& layout, int kind, int ch, int node, int chunk,
                      int64_t used_bytes)
      : pe_(c.place.pe_of(node)),
        recv_ring_(c.ptr.area + layout.recv_slot_offset(ch, c.place.node, 0)),
        staging_(c.ptr.area + layout.send_slot_offset(ch, node, 0)),
        direct_ring_(direct_address(c, recv_ring_, pe_)),
        tail_(c.ptr.tail + counter_index(kind, ch, c.place.node)),
        direct_tail_(direct_address(c, tail_, pe_)),
        head_(c.ptr.head + counter_index(kind, ch, node)),
        sent_base_(c.ptr.sent_base + counter_index(kind, ch, node)),
        base_(*sent_base_), slot_bytes_(layout.slot_bytes), used_bytes_(used_bytes), slots_(layout.ring_slots),
        chunk_(chunk < layout.ring_slots ? chunk : layout.ring_slots), pending_first_(base_), pending_(0) {}

  // Index of this call's first slot: slots before it were sent by earlier calls.
  __device__ uint64_t base() const { return base_; }

  // Where the index-th slot ever sent on this ring is written: the receiver's slot itself
  // (direct), or its staging copy.
  __device__ uint8_t* slot(uint64_t index) const {
    const int64_t offset = static_cast<int64_t>(index % slots_) * slot_bytes_;
    return (direct_ring_ != nullptr ? direct_ring_ : staging_) + offset;
  }

  // Waits (lane 0) until the receiver has consumed the previous use of slot `index`, announcing the
  // held slots first when the slot is not free yet. Warp-collective.
  __device__ void wait_free(uint64_t index, const WaitSite& site) {
    if (index + 1 <= static_cast<uint64_t>(slots_)) return;
    const uint64_t needed = index + 1 - slots_;
    const bool free = shfl(lane_id() == 0 && ld_acquire_sys(head_) >= needed ? 1 : 0, 0) != 0;
    if (free) return;
    announce();
    if (lane_id() == 0) wait_at_least(head_, needed, site, kWaitFreeSlot, pe_);
    __syncwarp();
  }

  // The slot just written (the next index) is complete; announces the chunk when it is full or
  // reaches the ring's end. Warp-collective.
  __device__ void filled() {
    ++pending_;
    if (pending_ == chunk_ || (pending_first_ + pending_) % slots_ == 0) announce();
  }

  // Announces what is held and records this call's `count` slots in the sender's total (the next
  // call on the stream reads it). Warp-collective.
  __device__ void close(uint64_t count) {
    announce();
    if (lane_id() == 0) *sent_base_ = base_ + count;
  }

 private:
  // Announces every filled slot not announced yet. Warp-collective.
  // NOTE (direct): the warp barrier orders every lane's stores into the slots before lane 0's
  // release add, which makes them visible at system scope before the tail moves.
  __device__ void announce() {
    if (pending_ == 0) return;
    if (direct_ring_ != nullptr) {
      __syncwarp();
      if (lane_id() == 0) red_add_release_sys(direct_tail_, static_cast<uint64_t>(pending_));
      __syncwarp();
    } else {
      const int64_t offset = static_cast<int64_t>(pending_first_ % slots_) * slot_bytes_;
      put_slots(recv_ring_ + offset, staging_ + offset, (pending_ - 1) * slot_bytes_ + used_bytes_, tail_,
                static_cast<uint64_t>(pending_), pe_);
    }
    pending_first_ += pending_;
    pending_ = 0;
  }

  int pe_;
  uint8_t* recv_ring_;     // slot 0 of the ring at the receiver (symmetric address)
  uint8_t* staging_;       // slot 0 of this PE's send staging for the ring
  uint8_t* direct_ring_;   // recv_ring_ through nvshmem_ptr, or nullptr
  uint64_t* tail_;         // the receiver's tail word (symmetric)
  uint64_t* direct_tail_;
  const uint64_t* head_;   // this PE's head word: slots the receiver has consumed
  uint64_t* sent_base_;    // this PE's total of slots sent on the ring
  uint64_t base_;
  int64_t slot_bytes_, used_bytes_;
  int slots_, chunk_;
  uint64_t pending_first_;
  int pending_;
};

}  // namespace ep_plugin::internode
#endif  // __CUDACC__
