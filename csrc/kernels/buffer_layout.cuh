// How a rank's NVLink buffer is carved. The single source of truth for the native kernels; the
// Python size hints (ep_plugin/tuning.py) mirror it and a test keeps the two equal.
//
// [ Header (kHeaderBytes) | rings written by peer 0 | ... by peer R-2 ] ... [ staging (optional) ]
// Rings: for each writing peer, channel and warp one sub-ring of `slots` slots; a slot is
// [ SlotMeta (272 B, padded to 384) | payload: row bytes, then float scales, padded to 128 B ].
// Staging (copy-engine combine, past num_nvl_bytes): for each writing peer, `num_slots` pieces of
// `rows_per_piece` bf16 rows, then the same pieces' top-k weights (see StagingLayout).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../common/status.h"

namespace ep_plugin::intranode {

constexpr int kMaxChannels = 64;
constexpr int kMaxTopk = 32;
constexpr int kWarpsPerChannel = 16;
constexpr int kThreadsPerBlock = kWarpsPerChannel * 32;
constexpr int64_t kHeaderBytes = 1 << 20;
constexpr int kMaxStagingSlots = 64;
constexpr int kStagingRowsPerPiece = 512;  // rows per copy-engine transfer (and per arrival signal)

struct SlotMeta {
  int32_t row;        // destination row in recv_x
  int32_t src_token;  // source token index
  int32_t topk_idx[kMaxTopk];
  float topk_weights[kMaxTopk];
  int32_t pad[2];
};
constexpr int kSlotMetaBytes = sizeof(SlotMeta);
static_assert(kSlotMetaBytes == 272, "SlotMeta must stay 272 bytes (mirrored in ep_plugin/tuning.py)");
// Payloads start and slots end on 128-byte lines: a warp's 512-byte store then fills four whole lines
// over NVLink, where a row 16 bytes off them touched five, two of them in part.
constexpr int kSlotLineBytes = 128;
constexpr int kSlotPayloadOffset = (kSlotMetaBytes + kSlotLineBytes - 1) / kSlotLineBytes * kSlotLineBytes;

// What every rank's rows of one dispatch must share, packed in one word: the bytes of a row of x, its
// FP8 scales, its top-k width and whether weights come with it. A sender writes its rows, scales and
// top-k entries at the receiver's row positions with its own widths, so ranks that differ would write
// past the receiver's outputs; notify compares the words before any row moves.
__host__ __device__ constexpr int64_t pack_row_layout(int row_bytes, int num_scales, int num_topk, bool has_weights) {
  return static_cast<int64_t>(row_bytes) << 32 | static_cast<int64_t>(num_scales & 0xffffff) << 8 |
         static_cast<int64_t>(num_topk & 0x7f) << 1 | (has_weights ? 1 : 0);
}
__host__ __device__ constexpr int row_layout_bytes(int64_t word) { return static_cast<int>(word >> 32); }
__host__ __device__ constexpr int row_layout_scales(int64_t word) { return static_cast<int>(word >> 8 & 0xffffff); }
__host__ __device__ constexpr int row_layout_topk(int64_t word) { return static_cast<int>(word >> 1 & 0x7f); }
__host__ __device__ constexpr bool row_layout_weights(int64_t word) { return (word & 1) != 0; }

// What each rank writes into every peer's header during notify.
struct NotifyBlock {
  int32_t bad_input_code;  // ErrorCode of this rank's input check
  int32_t num_tokens;      // T of the writer
  int64_t row_layout;      // pack_row_layout of the writer's x, scales, top-k and weights
  int64_t bad_input_detail[3];
  int32_t tokens_to_rank[kMaxNvlPeers];       // writer's token count for every rank
  int32_t expert_counts[kMaxLocalExperts];    // writer's (token, expert) entries for the reader's experts
};

// Where a rank's direct-dispatch outputs are: byte offsets into its buffer, -1 for an output the call
// does not have (intranode_direct_dispatch.cu).
struct DirectOutputs {
  int64_t recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx;
};

// Counters are epoch-tagged so that no kernel ever has to reset them:
// bits 63..32 = operation epoch, bit 31 = done (sender finished), bits 30..0 = count.
struct Header {
  uint64_t notify_signal[kMaxNvlPeers];                            // [src]: src's notify epoch
  uint64_t tails[kMaxNvlPeers][kMaxChannels][kWarpsPerChannel];    // [src][c][w]: written by src
  uint64_t heads[kMaxNvlPeers][kMaxChannels][kWarpsPerChannel];    // [dst][c][w]: written by dst
  NotifyBlock notify[2][kMaxNvlPeers];                             // [epoch parity][src]
  // Copy-engine combine; words are (combine epoch << 32) | value. Each word lives with its waiter.
  // Written by the signal streams of sender src, into this (the owner's) header:
  uint64_t staged_landed[kMaxNvlPeers];                   // [src]: rows src has copied here (in order)
  // Written by the reduction kernel of sender src, into this header:
  uint64_t staged_base[kMaxNvlPeers];                     // [src]: src's first row of this rank's block
  uint64_t staged_rows[kMaxNvlPeers];                     // [src]: rows src sends back to this rank
  uint64_t staged_weights_landed[kMaxNvlPeers];           // [src]: count 1 once src's top-k weights are all here
  // Written by the owner dst's reduction kernel, into this (the sender's) header:
  uint64_t staged_freed[kMaxNvlPeers][kMaxStagingSlots];  // [dst][slot]: piece + 1 dst has read
  uint64_t staged_released[kMaxNvlPeers];                 // [dst]: epoch whose staging dst has finished reading
  // Direct dispatch; words are pack_counter(epoch, count, ...). Written by rank dst, into this (a sender's) header:
  DirectOutputs direct_outputs[kMaxNvlPeers];  // [dst]: where dst's outputs of the call are
  uint64_t direct_ready[kMaxNvlPeers];         // [dst]: epoch of the call whose outputs those are; count 1 when
                                               // they are in dst's region, 0 when dst had no room (all fall back)
  // Written by rank src, into this (a destination's) header:
  uint64_t direct_done[kMaxNvlPeers];          // [src]: epoch whose rows src has all written here
  // Local state, touched only by this rank's kernels.
  uint32_t notify_epoch;
  uint32_t op_epoch;
  uint32_t blocks_done;
  int32_t error_claim;
  uint32_t direct_fell_back;  // 1: the last direct dispatch found a rank without room; the ring kernel runs
  uint32_t direct_next_chunk;  // chunks of tokens the direct dispatch's warps have claimed in this call
  uint32_t staged_rows_done[kMaxNvlPeers][kMaxStagingSlots];  // [src][slot]: rows of the piece reduced so far
  // The copy-engine combine's reduction: work its warps claim, so that no block's absence holds the rest.
  uint32_t staged_next_token;                  // tokens claimed for summing
  uint32_t staged_next_weights_token;          // tokens claimed for the weights summed after the rows (2 ranks)
  uint32_t weights_next_chunk[kMaxNvlPeers];   // [dst]: chunks of this rank's weights for dst claimed
  uint32_t weights_chunks_done[kMaxNvlPeers];  // [dst]: those stored
  uint32_t staged_blocks_done;                 // blocks of the reduction past their work (the last resets the above)
};
static_assert(sizeof(Header) <= kHeaderBytes, "header outgrew kHeaderBytes");

__host__ __device__ constexpr int slots_per_sub_ring(int recv_tokens_per_channel) {
  int slots = (recv_tokens_per_channel + kWarpsPerChannel - 1) / kWarpsPerChannel;
  return slots < 2 ? 2 : slots;
}

__host__ __device__ constexpr int64_t slot_bytes_for(int64_t payload_bytes) {
  return kSlotPayloadOffset + (payload_bytes + kSlotLineBytes - 1) / kSlotLineBytes * kSlotLineBytes;
}

__host__ __device__ constexpr uint64_t pack_counter(uint32_t epoch, uint32_t count, bool done) {
  return (static_cast<uint64_t>(epoch) << 32) | (done ? 0x80000000ull : 0ull) | (count & 0x7fffffffu);
}
// Copy-engine combine words: (combine epoch << 32) | a 32-bit value.
__host__ __device__ constexpr uint64_t staged_word(uint32_t epoch, uint32_t value) {
  return (static_cast<uint64_t>(epoch) << 32) | value;
}
__host__ __device__ constexpr uint32_t counter_epoch(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
__host__ __device__ constexpr uint32_t counter_count(uint64_t word) { return static_cast<uint32_t>(word) & 0x7fffffffu; }
__host__ __device__ constexpr bool counter_done(uint64_t word) { return (word & 0x80000000ull) != 0; }

// Tokens of one channel: contiguous chunks of ceil(T / C).
__host__ __device__ inline void channel_token_range(int num_tokens, int num_channels, int channel, int& begin,
                                                    int& end) {
  int chunk = (num_tokens + num_channels - 1) / num_channels;
  begin = channel * chunk < num_tokens ? channel * chunk : num_tokens;
  end = begin + chunk < num_tokens ? begin + chunk : num_tokens;
}

struct RingLayout {
  int num_ranks;
  int num_channels;
  int slots;
  int64_t slot_bytes;

  __host__ __device__ int64_t ring_bytes() const { return slots * slot_bytes; }

  __host__ __device__ int64_t total_bytes() const {
    return kHeaderBytes + static_cast<int64_t>(num_ranks - 1) * num_channels * kWarpsPerChannel * ring_bytes();
  }

  // The sub-ring in `owner`'s buffer that `writer` fills for (channel, warp).
  __host__ __device__ int64_t ring_offset(int owner, int writer, int channel, int warp) const {
    int peer_index = writer < owner ? writer : writer - 1;
    return kHeaderBytes +
           ((static_cast<int64_t>(peer_index) * num_channels + channel) * kWarpsPerChannel + warp) * ring_bytes();
  }
};

// The copy-engine combine's staging area in the owner's buffer: for each writing peer, `num_slots`
// pieces of `rows_per_piece` bf16 rows of `row_bytes`, then room for kMaxTopk float weights per row
// (a call packs its top-k weights num_topk per row, as one copy of topk_weights' rows). Piece g
// of a combine lands in slot g % num_slots; a sender reuses a slot once the owner has freed it.
struct StagingLayout {
  int num_ranks;
  int64_t offset;      // first byte of the staging area in the buffer
  int64_t row_bytes;   // 2 * hidden
  int rows_per_piece;
  int num_slots;

  // What fits into `staging_bytes`, for rows of `row_bytes`; num_slots == 0 when not even two pieces fit.
  __host__ __device__ static StagingLayout fit(int num_ranks, int64_t offset, int64_t staging_bytes, int64_t row_bytes) {
    StagingLayout layout{num_ranks, offset, row_bytes, kStagingRowsPerPiece, 0};
    if (num_ranks > 1) {
      const int64_t per_peer = staging_bytes / (num_ranks - 1);
      const int64_t slots = per_peer / layout.piece_bytes();
      layout.num_slots = slots < 2 ? 0 : (slots > kMaxStagingSlots ? kMaxStagingSlots : static_cast<int>(slots));
    }
    return layout;
  }
  __host__ __device__ int64_t piece_bytes() const { return rows_per_piece * (row_bytes + kMaxTopk * 4); }
  __host__ __device__ int64_t rows_capacity() const { return static_cast<int64_t>(num_slots) * rows_per_piece; }
  __host__ __device__ int64_t peer_bytes() const { return num_slots * piece_bytes(); }

  // The region of `owner`'s buffer that `writer` fills.
  __host__ __device__ int64_t region_offset(int owner, int writer) const {
    const int peer_index = writer < owner ? writer : writer - 1;
    return offset + peer_index * peer_bytes();
  }
  // Where `source`'s rows for `owner` are staged: in the owner's buffer (copied across NVLink), or,
  // pulled (StagedReduceArgs::pull_rows), in the source's own buffer (copied within its GPU).
  __host__ __device__ int region_home(int owner, int source, bool pulled) const { return pulled ? source : owner; }
  __host__ __device__ int64_t staged_region_offset(int owner, int source, bool pulled) const {
    return pulled ? region_offset(source, owner) : region_offset(owner, source);
  }
  // Within a region: the row and weights of staged row `index` (slot * rows_per_piece + row in piece).
  __host__ __device__ int64_t row_offset(int64_t index) const { return index * row_bytes; }
  // Whether all `rows` rows' weights fit the weights area at once: then one copy carries them before
  // the first piece, indexed by row of the block; otherwise each piece carries its own, by staged index.
  __host__ __device__ bool weights_fit_whole(int64_t rows, int num_topk) const {
    return rows * num_topk <= rows_capacity() * kMaxTopk;
  }
  __host__ __device__ int64_t weights_offset(int64_t index, int num_topk) const {
    return rows_capacity() * row_bytes + index * num_topk * 4;
  }
};

// Bytes a buffer needs for `payload_bytes` per token (Config.get_nvl_buffer_size_hint).
__host__ __device__ inline int64_t nvl_buffer_size_hint(int64_t payload_bytes, int num_ranks, int num_sms,
                                                        int recv_tokens_per_channel) {
  int num_nvl_ranks = num_ranks < kMaxNvlPeers ? num_ranks : kMaxNvlPeers;
  RingLayout layout{num_nvl_ranks, num_sms / 2, slots_per_sub_ring(recv_tokens_per_channel),
                    slot_bytes_for(payload_bytes)};
  return layout.total_bytes();
}

}  // namespace ep_plugin::intranode
