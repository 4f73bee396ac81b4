// One warp streams a sequence of equal rows through shared memory by bulk (TMA) copies: each row is
// loaded once and stored by every lane that has a destination for it (this rank's output, a peer's
// ring slot). Rows go in pieces; the loads of the next kBulkLoadsAhead pieces are in flight while a
// piece is stored, and no registers hold the data, so far more bytes are in flight per warp than
// with loads into registers.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace ep_plugin {

// The pipeline's shared memory must stay within a block's 227 KB. The cost is per piece, not per byte:
// 4 pieces of 3584 bytes with 2 loads ahead beat 8 of 1792 with 6 ahead (docs/performance.md).
constexpr int kBulkStages = 4;                    // pieces of shared memory per warp
constexpr int kBulkLoadsAhead = kBulkStages - 2;  // one stage being stored, one still read by the store before it
constexpr int kBulkMaxPieceBytes = 3584;
static_assert(kBulkStages >= 3 && kBulkMaxPieceBytes % 16 == 0, "the bulk pipeline needs 3 stages of 16-byte multiples");

// Dynamic shared memory for `warps` warps: their stages, then their mbarriers.
__host__ __device__ constexpr int bulk_rows_shared_bytes(int warps) {
  return warps * kBulkStages * (kBulkMaxPieceBytes + static_cast<int>(sizeof(uint64_t)));
}

// A row goes in bulk_pieces(row_bytes) pieces of bulk_piece_bytes (16-byte multiples; the last one shorter).
__host__ __device__ constexpr int bulk_pieces(int row_bytes) {
  return (row_bytes + kBulkMaxPieceBytes - 1) / kBulkMaxPieceBytes;
}
__host__ __device__ constexpr int bulk_piece_bytes(int row_bytes) {
  return ((row_bytes + bulk_pieces(row_bytes) - 1) / bulk_pieces(row_bytes) + 15) / 16 * 16;
}
// Whether that split leaves the last piece non-empty (rows up to about 200 KB).
__host__ __device__ constexpr bool bulk_rows_fit(int row_bytes) {
  return (bulk_pieces(row_bytes) - 1) * bulk_piece_bytes(row_bytes) < row_bytes;
}

// Row k of a warp's sequence is token first + k * stride, below end (a fixed share of the tokens).
struct StridedTokens {
  int first, stride, end;
  // The token of row k, or -1 past the end. Any lane.
  __device__ int lookahead(int k) const {
    const int64_t t = first + static_cast<int64_t>(k) * stride;
    return t < end ? static_cast<int>(t) : -1;
  }
};

#ifdef EP_PLUGIN_HAS_BULK_COPIES
// Rows are tokens' rows of `rows` (row_bytes apart); which token row k of the sequence is comes from a
// token source (StridedTokens, or tokens claimed as the warp goes) whose lookahead(k) gives row k's
// token for lane 0, the loader, or -1 while it is not known or past the end.
class WarpBulkRows {
 public:
  // `shared` is the block's dynamic shared memory (bulk_rows_shared_bytes of all its warps), this warp
  // is `warp`. Warp-collective.
  __device__ WarpBulkRows(uint8_t* shared, int warp, int num_warps, const uint8_t* rows, int row_bytes)
      : stages_(shared + static_cast<int64_t>(warp) * kBulkStages * kBulkMaxPieceBytes),
        bars_(reinterpret_cast<uint64_t*>(shared + static_cast<int64_t>(num_warps) * kBulkStages * kBulkMaxPieceBytes) +
              warp * kBulkStages),
        rows_(rows),
        row_bytes_(row_bytes),
        pieces_(bulk_pieces(row_bytes)),
        piece_bytes_(bulk_piece_bytes(row_bytes)) {
    if (lane_id() == 0) {
      for (int s = 0; s < kBulkStages; ++s) mbarrier_init(&bars_[s], 1);
      fence_mbarrier_init();
    }
    __syncwarp();
  }

  // Row k (the next one: rows go in order, each exactly once; tokens.lookahead(k) is known) to `dst`
  // of this lane, if not null. Warp-collective.
  template <typename Tokens>
  __device__ void copy_row(int k, uint8_t* dst, const Tokens& tokens) {
    for (int p = 0; p < pieces_; ++p) {
      const int item = k * pieces_ + p;
      issue_loads_through(item + kBulkLoadsAhead, tokens);
      const int stage = item % kBulkStages;
      while (!mbarrier_try_wait(&bars_[stage], (item / kBulkStages) & 1)) {
      }
      if (dst != nullptr) bulk_store(dst + p * piece_bytes_, stages_ + stage * kBulkMaxPieceBytes, bytes_of(p));
      // NOTE: every lane commits a group per piece (empty without a store), so that the group
      // count is the piece count in every lane.
      bulk_commit_group();
    }
  }

  // Before the warp leaves at row k without copying it (an error): waits for the loads issued for rows
  // from k on and for every store, so that no bulk copy outlives the block. Warp-collective.
  __device__ void drain(int k) {
    for (int item = k * pieces_; item < issued_; ++item)
      while (!mbarrier_try_wait(&bars_[item % kBulkStages], (item / kBulkStages) & 1)) {
      }
    bulk_wait_all();
  }

 private:
  __device__ int bytes_of(int piece) const { return min(piece_bytes_, row_bytes_ - piece * piece_bytes_); }

  // Loads items up to `last` whose rows are known; item `issued_` (the one about to be stored, at least)
  // always is.
  template <typename Tokens>
  __device__ void issue_loads_through(int last, const Tokens& tokens) {
    if (issued_ > last) return;
    // The stages of these items last held items <= item - 2: only the newest group may still read.
    bulk_wait_read<1>();
    __syncwarp();
    int item = issued_;
    if (lane_id() == 0) {
      for (; item <= last; ++item) {
        const int row = item / pieces_, piece = item % pieces_;
        const int token = tokens.lookahead(row);
        if (token < 0) break;
        const int stage = item % kBulkStages;
        const uint32_t bytes = bytes_of(piece);
        mbarrier_arrive_expect_bytes(&bars_[stage], bytes);
        bulk_load(stages_ + stage * kBulkMaxPieceBytes,
                  rows_ + static_cast<int64_t>(token) * row_bytes_ + piece * piece_bytes_, bytes, &bars_[stage]);
      }
    }
    issued_ = shfl(item, 0);
  }

  uint8_t* stages_;
  uint64_t* bars_;
  const uint8_t* rows_;
  int row_bytes_, pieces_, piece_bytes_;
  int issued_ = 0;
};
#endif

}  // namespace ep_plugin
