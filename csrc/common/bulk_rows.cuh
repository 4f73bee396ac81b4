// One warp streams a sequence of equal rows through shared memory by bulk (TMA) copies: each row is
// loaded once and stored by every lane that has a destination for it (this rank's output, a peer's
// ring slot). Rows go in pieces; the loads of the next kBulkLoadsAhead pieces are in flight while a
// piece is stored, and no registers hold the data, so far more bytes are in flight per warp than
// with loads into registers.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace ep_plugin {

constexpr int kBulkStages = 8;                    // pieces of shared memory per warp
constexpr int kBulkLoadsAhead = kBulkStages - 2;  // one stage being stored, one still read by the store before it
constexpr int kBulkMaxPieceBytes = 1792;

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

#ifdef EP_PLUGIN_HAS_BULK_COPIES
class WarpBulkRows {
 public:
  // Row k of the sequence starts at first_row + k * row_stride; `shared` is the block's dynamic shared
  // memory (bulk_rows_shared_bytes of all its warps), this warp is `warp`. Warp-collective.
  __device__ WarpBulkRows(uint8_t* shared, int warp, int num_warps, const uint8_t* first_row, int64_t row_stride,
                          int num_rows, int row_bytes)
      : stages_(shared + static_cast<int64_t>(warp) * kBulkStages * kBulkMaxPieceBytes),
        bars_(reinterpret_cast<uint64_t*>(shared + static_cast<int64_t>(num_warps) * kBulkStages * kBulkMaxPieceBytes) +
              warp * kBulkStages),
        first_row_(first_row),
        row_stride_(row_stride),
        row_bytes_(row_bytes),
        pieces_(bulk_pieces(row_bytes)),
        piece_bytes_(bulk_piece_bytes(row_bytes)),
        num_items_(num_rows * pieces_) {
    if (lane_id() == 0) {
      for (int s = 0; s < kBulkStages; ++s) mbarrier_init(&bars_[s], 1);
      fence_mbarrier_init();
    }
    __syncwarp();
  }

  // Row k (the next one: rows go in order, each exactly once) to `dst` of this lane, if not null.
  // Warp-collective.
  __device__ void copy_row(int k, uint8_t* dst) {
    for (int p = 0; p < pieces_; ++p) {
      const int item = k * pieces_ + p;
      issue_loads_through(min(item + kBulkLoadsAhead, num_items_ - 1));
      const int stage = item % kBulkStages;
      while (!mbarrier_try_wait(&bars_[stage], (item / kBulkStages) & 1)) {
      }
      if (dst != nullptr) bulk_store(dst + p * piece_bytes_, stages_ + stage * kBulkMaxPieceBytes, bytes_of(p));
      // NOTE: every lane commits a group per piece (empty without a store), so that the group
      // count is the piece count in every lane.
      bulk_commit_group();
    }
  }

 private:
  __device__ int bytes_of(int piece) const { return min(piece_bytes_, row_bytes_ - piece * piece_bytes_); }

  __device__ void issue_loads_through(int last) {
    if (issued_ > last) return;
    // The stages of these items last held items <= item - 2: only the newest group may still read.
    bulk_wait_read<1>();
    __syncwarp();
    if (lane_id() == 0) {
      for (int item = issued_; item <= last; ++item) {
        const int stage = item % kBulkStages, row = item / pieces_, piece = item % pieces_;
        const uint32_t bytes = bytes_of(piece);
        mbarrier_arrive_expect_bytes(&bars_[stage], bytes);
        bulk_load(stages_ + stage * kBulkMaxPieceBytes, first_row_ + row * row_stride_ + piece * piece_bytes_, bytes,
                  &bars_[stage]);
      }
    }
    issued_ = last + 1;
  }

  uint8_t* stages_;
  uint64_t* bars_;
  const uint8_t* first_row_;
  int64_t row_stride_;
  int row_bytes_, pieces_, piece_bytes_, num_items_;
  int issued_ = 0;
};
#endif

}  // namespace ep_plugin
