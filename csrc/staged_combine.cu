// The copy-engine combine's host side (IntranodeRuntime::staged_combine); its kernels are in
// kernels/intranode_staged_combine.cu.
//
// Each rank copies the rows it received from owner o (one contiguous block of its combine input) into
// o's staging area (above 2 ranks: into its own region for o, from which o pulls them) with
// cudaMemcpyAsync on a copy stream per owner; after each copy, the owner's signal stream writes the
// rows-landed word into o's header. Meanwhile every rank's reduction kernel (on the
// side stream) does its sender side and sums its own tokens as their rows land. After the reduction the
// area is refilled with unlanded bytes and released to the senders.
#include <cuda.h>

#include <algorithm>
#include <vector>

#include "common/binding.h"
#include "common/exception.cuh"
#include "common/text.h"
#include "kernels/buffer_layout.cuh"
#include "runtime.cuh"

namespace ep_plugin {
namespace {

using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

void check_addresses(const intranode::StagedReduceArgs& a) {
  check_pointer(a.x, "x", false, 16);
  check_pointer(a.topk_weights, "topk_weights", false);
  check_pointer(a.send_pos, "send_pos", a.num_tokens > 0);
  check_pointer(a.bias_0, "bias_0", false, 16);
  check_pointer(a.bias_1, "bias_1", false, 16);
  check_pointer(a.combined_x, "combined_x", a.num_tokens > 0, 16);
  check_pointer(a.combined_topk_weights, "combined_topk_weights", false);
}

}  // namespace


int64_t IntranodeRuntime::staging_rows(int64_t staging_bytes, int hidden) const {
  if (staging_bytes > staging_bytes_) return 0;
  return intranode::StagingLayout::fit(num_ranks_, staging_offset_, staging_bytes, 2LL * hidden).rows_capacity();
}

void IntranodeRuntime::create_copy_streams(int64_t staging_bytes) {
  if (staging_bytes == 0) return;
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_streams_[r], cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&copy_done_[r], cudaEventDisableTiming));
    CUDA_CHECK(cudaStreamCreateWithFlags(&signal_streams_[r], cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&copy_landed_[r], cudaEventDisableTiming));
  }
}

void IntranodeRuntime::preload_staged_combine() {
  // NOTE: loaded up front: the first launch of a kernel loads it, and the load waits for the running
  // reduction, which waits for the very copies queued behind that launch (every combine timed out).
  intranode::load_staged_combine_kernels();
  // One harmless run of each sender-side kernel, on this rank's own words (never read by a peer).
  auto* header = reinterpret_cast<intranode::Header*>(buffer_);
  wait_for_owner(&header->staged_released[rank_], 0, rank_, -1, nullptr);
  intranode::launch_write_word(&header->staged_released[rank_], 0, nullptr);
}

void IntranodeRuntime::staged_combine(StagedCombineRequest request, cudaStream_t stream, cudaStream_t side) {
  require_connected();
  const int R = num_ranks_;
  intranode::StagedReduceArgs& args = request.reduce;
  check_addresses(args);
  EP_CHECK_ARG(static_cast<int>(request.rows_from.size()) == R, "rows_from needs one count per rank");
  EP_CHECK_ARG(request.staging_bytes > 0 && request.staging_bytes <= staging_bytes_,
               "staging_bytes must be in (0, " << staging_bytes_ << "], got " << request.staging_bytes);
  const auto layout = intranode::StagingLayout::fit(R, staging_offset_, request.staging_bytes, 2LL * args.hidden);
  EP_CHECK_ARG(layout.num_slots >= 2, "the staging area holds fewer than two pieces of rows of hidden " << args.hidden);
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = R;
  args.staging_offset = staging_offset_;
  args.staging_bytes = request.staging_bytes;
  args.epoch = ++staged_epoch_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  // Rows received from rank r are rows [first, first + rows_from[r]) of x: they go back to r.
  for (int r = 0, first = 0; r < R; first += request.rows_from[r], ++r) {
    args.send_first[r] = first;
    args.send_rows[r] = request.rows_from[r];
  }

  // The owner side sums on `side`; the rows for each owner go out on that owner's copy stream.
  // NOTE: one stream per owner: a sender that waits for one owner to free a slot must not hold back
  // its rows for another owner, which may need them to free its own slots.
  CUDA_CHECK(cudaEventRecord(fork_, stream));
  // NOTE: the first round of copies is queued before the reduction is launched: the critical path is
  // the copy, and the reduction has nothing to sum before its first rows land (a launch before the
  // copies held them back by about 7 us). The pieces that wait for a freed slot are queued after the
  // launch: where streams share a hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, or more streams than
  // queues), a waiting piece ahead of the reduction would hold it back, and the owner waits for the
  // reduction's words to free the slot.
  std::vector<int64_t> rows_copied(R, 0);
  for (int r = 0; r < R; ++r) {
    if (r == rank_) continue;
    CUDA_CHECK(cudaStreamWaitEvent(copy_streams_[r], fork_, 0));
    if (args.pull_rows) {
      EP_CHECK_ARG(args.send_rows[r] <= layout.rows_capacity(), "pulled rows must fit the staging region: "
                                                                     << args.send_rows[r] << " rows for rank " << r
                                                                     << ", room for " << layout.rows_capacity());
      wait_for_release(args, r, copy_streams_[r]);
    } else {
      rows_copied[r] = copy_first_round(args, layout, r, copy_streams_[r]);
    }
  }
  if (args.pull_rows) copy_pulled_rows(args, layout);
  launch_reduction(args, request.num_sms, side);
  for (int r = 0; r < R; ++r) {
    if (r == rank_) continue;
    if (!args.pull_rows) copy_later_pieces(args, layout, r, rows_copied[r], copy_streams_[r]);
    // NOTE: the caller's stream waits for every copy out of x: this rank's reduction may end before them
    // (the owners, not this rank, wait for its pulled rows), and the caller may then reuse x.
    CUDA_CHECK(cudaEventRecord(copy_done_[r], copy_streams_[r]));
    CUDA_CHECK(cudaStreamWaitEvent(stream, copy_done_[r], 0));
    // NOTE: the caller need not wait for the landed words: they touch only the owner's header, and the
    // next writes to it queue behind them on the same signal stream (no graph captures this combine).
  }
  wait_for_releases(args.epoch);
  CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
  // NOTE: queued last, so that nothing the host might block on stands before the copies the
  // running reduction waits for.
  release_staging(args, layout, side);
}

void IntranodeRuntime::wait_for_release(const intranode::StagedReduceArgs& args, int owner, cudaStream_t stream) {
  // The owner must have finished reading the previous combine's staged rows and words (unless the
  // previous combine's copy stream already waited for that); the reduction kernel tells it where this
  // combine's block is.
  auto* mine = reinterpret_cast<intranode::Header*>(buffer_);
  if (released_epoch_waited_[owner] != args.epoch - 1)
    wait_for_owner(&mine->staged_released[owner], args.epoch - 1, owner, -1, stream);
}

int64_t IntranodeRuntime::copy_first_round(const intranode::StagedReduceArgs& args,
                                            const intranode::StagingLayout& layout, int owner, cudaStream_t stream) {
  wait_for_release(args, owner, stream);
  // Every slot is free and summed as it lands: one copy.
  const int64_t first_round_rows = static_cast<int64_t>(layout.num_slots) * layout.rows_per_piece;
  const int64_t rows = std::min<int64_t>(first_round_rows, args.send_rows[owner]);
  copy_piece(args, layout, owner, 0, 0, rows, stream);
  return rows;
}

void IntranodeRuntime::copy_pulled_rows(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout) {
  // NOTE: every owner's rows in even pieces, queued piece by piece across the owners and all before the
  // reduction's launch: every owner's first piece lands early. How the pieces went out did not matter in a
  // forced EP2 pull (four pieces, two, or the launch ahead of them: docs/design.md, "Pulled by the owners");
  // the reduction, not the copies, sets the pace. Each piece costs the host four calls (the copy, its
  // event, the wait, the landed word), so a small block goes in fewer pieces.
  std::vector<int64_t> copied(num_ranks_, 0), pieces(num_ranks_, 1);
  for (int r = 0; r < num_ranks_; ++r)
    pieces[r] = std::clamp<int64_t>((args.send_rows[r] + kPulledPieceRows - 1) / kPulledPieceRows, 1, kPulledPieces);
  for (int piece = 0; piece < kPulledPieces; ++piece) {
    for (int r = 0; r < num_ranks_; ++r) {
      if (r == rank_ || piece >= pieces[r]) continue;
      const int64_t end = args.send_rows[r] * (piece + 1) / pieces[r];
      copy_piece(args, layout, r, copied[r], copied[r], end - copied[r], copy_streams_[r]);
      copied[r] = end;
    }
  }
}

void IntranodeRuntime::copy_later_pieces(const intranode::StagedReduceArgs& args,
                                         const intranode::StagingLayout& layout, int owner, int64_t done,
                                         cudaStream_t stream) {
  using intranode::staged_word;
  auto* mine = reinterpret_cast<intranode::Header*>(buffer_);
  const int64_t rows = args.send_rows[owner];
  // One piece per copy, each after the owner has summed its slot's previous piece.
  for (int64_t piece = layout.num_slots; done < rows; ++piece) {
    const int slot = static_cast<int>(piece % layout.num_slots);
    wait_for_owner(&mine->staged_freed[owner][slot],
                   staged_word(args.epoch, static_cast<uint32_t>(piece - layout.num_slots + 1)), owner, slot, stream);
    const int64_t count = std::min<int64_t>(layout.rows_per_piece, rows - done);
    copy_piece(args, layout, owner, done, static_cast<int64_t>(slot) * layout.rows_per_piece, count, stream);
    done += count;
  }
}

void IntranodeRuntime::copy_piece(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                                  int owner, int64_t done, int64_t staged, int64_t count, cudaStream_t stream) {
  if (count == 0) return;
  const bool pulled = args.pull_rows != 0;
  uint8_t* region = static_cast<uint8_t*>(peer_buffers_[layout.region_home(owner, rank_, pulled)]) +
                    layout.staged_region_offset(owner, rank_, pulled);
  // Weights that fit whole are stored by the reduction kernel; the others go with each piece.
  const bool weights_per_piece = args.topk_weights != nullptr && args.num_topk > 0 &&
                                 !layout.weights_fit_whole(args.send_rows[owner], args.num_topk);
  const int64_t row_bytes = 2LL * args.hidden;
  const int64_t row = args.send_first[owner] + done;
  CUDA_CHECK(cudaMemcpyAsync(region + layout.row_offset(staged), static_cast<const uint8_t*>(args.x) + row * row_bytes,
                             count * row_bytes, cudaMemcpyDeviceToDevice, stream));
  if (weights_per_piece)
    CUDA_CHECK(cudaMemcpyAsync(region + layout.weights_offset(staged, args.num_topk),
                               args.topk_weights + row * args.num_topk, count * args.num_topk * 4,
                               cudaMemcpyDeviceToDevice, stream));
  // Copies land in order on this one stream: the owner counts the rows landed.
  signal_landed(owner, intranode::staged_word(args.epoch, static_cast<uint32_t>(done + count)), stream);
}


void IntranodeRuntime::signal_landed(int owner, uint64_t value, cudaStream_t stream) {
  auto* theirs = static_cast<intranode::Header*>(peer_buffers_[owner]);
  // NOTE: the event keeps the writes in copy order; each wait takes the event's latest record.
  cudaStream_t signals = signal_streams_[owner];
  CUDA_CHECK(cudaEventRecord(copy_landed_[owner], stream));
  CUDA_CHECK(cudaStreamWaitEvent(signals, copy_landed_[owner], 0));
  write_word(&theirs->staged_landed[rank_], value, signals);
}

void IntranodeRuntime::wait_for_owner(const uint64_t* word, uint64_t target, int owner, int slot, cudaStream_t stream) {
  intranode::StagingWaitArgs wait{};
  wait.word = word;
  wait.target = target;
  wait.peer = owner;
  wait.slot = slot;
  wait.rank = rank_;
  wait.status = status_device_;
  wait.claim = &reinterpret_cast<intranode::Header*>(buffer_)->error_claim;
  wait.timeout_ns = timeout_ns_;
  intranode::launch_staging_wait(wait, stream);
}

void IntranodeRuntime::write_word(uint64_t* address, uint64_t value, cudaStream_t stream) {
  if (write_value64_ == nullptr) {
    intranode::launch_write_word(address, value, stream);
    return;
  }
  // NOTE: the default flags put a memory barrier before the write: the copies queued before it are
  // visible to whoever reads the new value.
  const CUresult result = reinterpret_cast<WriteValue64>(write_value64_)(
      reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value, 0);
  if (result != CUDA_SUCCESS) {
    Text out;
    out << "ep_plugin: rank " << rank_ << ": cuStreamWriteValue64 failed with CUresult " << static_cast<int>(result);
    throw Error(out.str());
  }
}

void IntranodeRuntime::launch_reduction(const intranode::StagedReduceArgs& args, int num_sms, cudaStream_t side) {
  CUDA_CHECK(cudaStreamWaitEvent(side, fork_, 0));
  intranode::launch_staged_reduce(args, num_sms, side);
  CUDA_CHECK(cudaEventRecord(join_, side));
}

void IntranodeRuntime::wait_for_releases(uint32_t epoch) {
  // The next combine's copies need each owner's release of this one: waited for now, behind this
  // combine's copies (after their events, so the caller does not wait), it is usually over before the
  // next combine starts.
  auto* mine = reinterpret_cast<intranode::Header*>(buffer_);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    wait_for_owner(&mine->staged_released[r], epoch, r, -1, copy_streams_[r]);
    released_epoch_waited_[r] = epoch;
  }
}

void IntranodeRuntime::release_staging(const intranode::StagedReduceArgs& args, const intranode::StagingLayout& layout,
                                       cudaStream_t side) {
  // NOTE: after the reduction, off the caller's stream: the caller waits for the sums only. The next
  // combine's reduction follows on `side`, and its senders copy once they see the release.
  // Every row and weight a source can have sent: each of this rank's tokens has at most one copy per rank.
  const int64_t rows = std::min<int64_t>(args.num_tokens, layout.rows_capacity());
  const int64_t weights = std::min<int64_t>(static_cast<int64_t>(args.num_tokens) * args.num_topk,
                                            layout.rows_capacity() * intranode::kMaxTopk);
  for (int r = 0; r < num_ranks_; ++r) {
    // NOTE: pulled rows are read once reported landed: their regions need no marks.
    if (r == rank_ || rows == 0 || args.pull_rows) continue;
    uint8_t* region = static_cast<uint8_t*>(buffer_) + layout.region_offset(rank_, r);
    CUDA_CHECK(cudaMemsetAsync(region, 0xff, rows * layout.row_bytes, side));
    if (weights > 0) CUDA_CHECK(cudaMemsetAsync(region + layout.weights_offset(0, 1), 0xff, weights * 4, side));
  }
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_) write_word(&static_cast<intranode::Header*>(peer_buffers_[r])->staged_released[rank_], args.epoch, side);
}

}  // namespace ep_plugin
