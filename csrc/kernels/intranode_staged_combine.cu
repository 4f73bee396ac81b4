// Copy-engine combine: the kernels on the owner's side and the sender's waits.
//
// A sender's rows for owner o are one contiguous block of its combine input (rows are ordered by
// source rank), so the host copies them into o's staging area with the copy engines, on one stream
// per owner; after each copy a signal stream counts the rows landed in o's header (staged_combine.cu). No
// SM writes a remote row. Every rank runs `staged_reduce_kernel`, which first does its sender side
// (send_to_owners: the words that tell o where its rows are, and its top-k weights) and then, as
// owner, has its warps claim tokens in order, sums each token's staged copies with its own copy as
// they land (see kUnlandedWord), and frees a piece's staging slot for its sender once every row of
// it is summed. The last block out resets the claim counters. After the kernel, the host refills the
// area with unlanded bytes and then tells every sender that o has released it. At 3-4 ranks the rows are
// pulled instead (StagedReduceArgs::pull_rows, `pulled_reduce_kernel`): each sender copies them into a
// region of its own buffer, and o reads them across NVLink once reported landed. Every progress word is
// written where its waiter polls it, so no wait reads across NVLink. A wait that expires
// (Deadline::expired) sets its lane's `expired`: the warp then ends its tokens, the outputs undefined; a
// block whose sender side fails ends at once.
#include "../common/exception.cuh"
#include "api.cuh"
#include "buffer_layout.cuh"
#include "intranode_common.cuh"
#include "staging_marks.cuh"

namespace ep_plugin::intranode {
namespace {

// Lane `peer` waits until `word` carries this epoch and sets `count` to its count; false if the wait expired.
__device__ __forceinline__ bool wait_for_epoch(const uint64_t* word, uint32_t epoch, int peer, int kind,
                                               const WaitSite& site, uint32_t& count) {
  Deadline deadline(site);
  while (true) {
    const uint64_t value = ld_acquire_sys(word);
    count = static_cast<uint32_t>(value);
    if (counter_epoch(value) == epoch) return true;
    if (deadline.expired(kind, peer, epoch, counter_epoch(value))) return false;
  }
}

// Early rows: the owner sums a staged row while the copy engine may still be writing it, so that a
// copy can be large (the engine moves large copies faster) without the owner waiting for all of it.
// Every combine starts with its staging area filled with 0xff bytes (staging_marks.cuh).

// How a staged row's landing is reported: its source's landed word reaches staged_word(epoch, count).
// count == 0: the row is known to have landed.
struct Landing {
  const uint64_t* word;
  uint32_t epoch;
  uint32_t count;
  int source;

  __device__ __forceinline__ bool known() const { return count == 0; }
  __device__ __forceinline__ bool reported() const { return ld_acquire_sys(word) >= staged_word(epoch, count); }
};

__device__ __forceinline__ Landing landing_of(const StagedReduceArgs& a, const Header* me, int source, uint32_t count) {
  return Landing{&me->staged_landed[source], a.epoch, count, source};
}

// Waits until `landing` is reported; false (and `expired` set) if the wait expired.
__device__ __forceinline__ bool wait_until_reported(Landing landing, const WaitSite& site, bool& expired) {
  Deadline deadline(site);
  while (!landing.reported())
    if ((expired = deadline.expired(kWaitStagedRows, landing.source, landing.count, 0))) return false;
  return true;
}

// The first byte of `source`'s staged rows for `owner` (StagingLayout::region_home).
__device__ __forceinline__ uint8_t* staged_region(const StagedReduceArgs& a, const StagingLayout& layout, int owner,
                                                  int source) {
  const bool pulled = a.pull_rows != 0;
  return static_cast<uint8_t*>(a.peer_buffers[layout.region_home(owner, source, pulled)]) +
         layout.staged_region_offset(owner, source, pulled);
}

// Re-reads a staged unit (int4) or weight (float) until no word of it is unlanded or its row is
// reported landed (if the wait expires: sets `expired` and returns what it read).
// NOTE: the acquire comes before the re-read, so a read after the report sees the landed bytes.
template <typename T>
__device__ __forceinline__ T wait_for_landed(const T* at, Landing landing, const WaitSite& site, bool& expired) {
  Deadline deadline(site);
  while (true) {
    const bool reported = landing.reported();
    const T value = load_staged(at);
    if (reported || !has_unlanded_word(value)) return value;
    if (deadline.expired(kWaitStagedRows, landing.source, landing.count, 0)) {
      expired = true;
      return value;
    }
  }
}

// The sum of a 2-rank combine without bias: a token's own copy (user memory) and its staged copy,
// either may be absent. With no fp32 accumulator array to keep, a lane holds kPairUnroll units of
// both copies in flight, twice sum_token_copies' bytes; two copies sum to the same value in either
// order. Summed in bf16x2, a unit takes about 14 instructions against 90 in fp32 (docs/design.md).
// NOTE: a kernel takes either this or sum_token_copies, never both: the two inlined side by side
// made the kernel spill registers.
constexpr int kPairUnroll = 8;

// A lane's units of a row: base + u * 32 + lane for u < kUnroll. kWhole: all of them are in the row
// (every chunk but a row's last), so no unit needs a bounds check.
template <bool kWhole>
__device__ __forceinline__ bool in_row(int base, int u, int num_units) {
  return kWhole || base + u * 32 + lane_id() < num_units;
}

template <bool kWhole, int kUnroll>
__device__ __forceinline__ void read_units(int4 (&units)[kUnroll], const int4* row, int base, int num_units,
                                           bool staged) {
  const int lane = lane_id();
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (in_row<kWhole>(base, u, num_units))
      units[u] = staged ? load_staged(row + base + u * 32 + lane) : ld_nc_v4(row + base + u * 32 + lane);
}

template <bool kWhole, int kUnroll>
__device__ __forceinline__ bool has_unlanded_unit(const int4 (&units)[kUnroll], int base, int num_units) {
  bool unlanded = false;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (in_row<kWhole>(base, u, num_units)) unlanded = unlanded || has_unlanded_word(units[u]);
  return unlanded;
}

// Given the lane's units of a staged row as read, reads them again, all at once, until none is
// unlanded or the row is reported landed (if the wait expires: sets `expired`).
// NOTE: the re-reads go out together: waited for one by one, a lane that met a row as it landed paid a
// round trip per unit (EP2 at 8 SMs: 305.5 against 317.4 us).
template <bool kWhole, int kUnroll>
__device__ __forceinline__ void wait_for_landed_units(int4 (&units)[kUnroll], const int4* staged, int base,
                                                      int num_units, Landing landing, const WaitSite& site,
                                                      bool& expired) {
  if (landing.known() || !has_unlanded_unit<kWhole>(units, base, num_units)) return;
  Deadline deadline(site);
  while (!deadline.expired(kWaitStagedRows, landing.source, landing.count, 0)) {
    // NOTE: the acquire comes before the re-reads, so reads after the report see the landed bytes.
    const bool reported = landing.reported();
    read_units<kWhole>(units, staged, base, num_units, true);
    if (reported || !has_unlanded_unit<kWhole>(units, base, num_units)) return;
  }
  expired = true;
}

template <bool kWhole>
__device__ __forceinline__ void read_landed_units(int4 (&units)[kPairUnroll], const int4* staged, int base,
                                                  int num_units, Landing landing, const WaitSite& site,
                                                  bool& expired) {
  read_units<kWhole>(units, staged, base, num_units, true);
  wait_for_landed_units<kWhole>(units, staged, base, num_units, landing, site, expired);
}

// sum_token_copies' look at a staged copy's units once read (the general kernel: a combine with biases):
// a copy may still be landing (see kUnlandedWord), so its units are read again until they have, all of a
// batch at once. Checked row by row before the sum, each lane waited one round trip per unit of every
// staged copy.
struct StagedCopiesLanded {
  uint32_t unlanded;  // lane s: the landed count that reports source s's copy, 0 when known landed
  const StagedReduceArgs* args;
  const Header* me;
  int num_units;
  const WaitSite* site;
  bool* expired;

  __device__ __forceinline__ void operator()(int4 (&units)[kCombineUnroll], const int4* row, int source,
                                             int base) const {
    const uint32_t count = shfl(unlanded, source);
    if (count != 0)
      wait_for_landed_units<false>(units, row, base, num_units, landing_of(*args, me, source, count), *site, *expired);
  }
};

// Which copies a token of a 2-rank combine has (none: a token sent to no rank sums to zeros).
enum class PairCopies { kNone, kOwn, kStaged, kBoth };

// One chunk of a token's row: a single copy is stored as read, two are summed in bf16x2 (sum_bf16x8).
template <PairCopies kCopies, bool kWhole>
__device__ __forceinline__ void sum_pair_chunk(const int4* own, const int4* staged, Landing landing, int base,
                                               int num_units, int4* out, const WaitSite& site, bool& expired) {
  const int lane = lane_id();
  int4 a[kPairUnroll], b[kPairUnroll];
  if constexpr (kCopies == PairCopies::kOwn || kCopies == PairCopies::kBoth)
    read_units<kWhole>(a, own, base, num_units, false);
  if constexpr (kCopies == PairCopies::kStaged || kCopies == PairCopies::kBoth)
    read_landed_units<kWhole>(b, staged, base, num_units, landing, site, expired);
#pragma unroll
  for (int u = 0; u < kPairUnroll; ++u) {
    if (!in_row<kWhole>(base, u, num_units)) continue;
    int4* to = out + base + u * 32 + lane;
    if constexpr (kCopies == PairCopies::kNone) st_na_v4(to, make_int4(0, 0, 0, 0));
    if constexpr (kCopies == PairCopies::kOwn) st_na_v4(to, a[u]);
    if constexpr (kCopies == PairCopies::kStaged) st_na_v4(to, b[u]);
    if constexpr (kCopies == PairCopies::kBoth) st_na_v4(to, sum_bf16x8(a[u], b[u]));
  }
}

template <PairCopies kCopies>
__device__ __forceinline__ void sum_pair_row(const int4* own, const int4* staged, Landing landing, int num_units,
                                             int4* out, const WaitSite& site, bool& expired) {
  int base = 0;
  for (; base + 32 * kPairUnroll <= num_units; base += 32 * kPairUnroll)
    sum_pair_chunk<kCopies, true>(own, staged, landing, base, num_units, out, site, expired);
  if (base < num_units) sum_pair_chunk<kCopies, false>(own, staged, landing, base, num_units, out, site, expired);
}

// A token's own copy (user memory) and its staged copy, either may be absent.
__device__ __forceinline__ void sum_own_and_staged(const int4* own, const int4* staged, Landing landing, int num_units,
                                                   int4* out, const WaitSite& site, bool& expired) {
  if (own == nullptr && staged == nullptr)
    sum_pair_row<PairCopies::kNone>(own, staged, landing, num_units, out, site, expired);
  else if (staged == nullptr)
    sum_pair_row<PairCopies::kOwn>(own, staged, landing, num_units, out, site, expired);
  else if (own == nullptr)
    sum_pair_row<PairCopies::kStaged>(own, staged, landing, num_units, out, site, expired);
  else
    sum_pair_row<PairCopies::kBoth>(own, staged, landing, num_units, out, site, expired);
}

// What lane s (a source rank) knows about source s's rows in this combine.
struct SourceState {
  bool known = false;  // base and rows read from the header
  int base = 0;        // source's first row of this rank's block (its recv_rank_offsets[rank])
  int rows = 0;        // rows of this rank's block
  int landed = 0;      // rows seen landed

  // Waits for the words in which `source`'s kernel tells where its block of this combine starts and how
  // many rows it has (send_to_owners); false if a wait expired.
  __device__ __forceinline__ bool learn(const StagedReduceArgs& a, const Header* me, int source, const WaitSite& site) {
    uint32_t block_rows, block_base;
    if (!wait_for_epoch(&me->staged_rows[source], a.epoch, source, kWaitStagedRows, site, block_rows) ||
        !wait_for_epoch(&me->staged_base[source], a.epoch, source, kWaitStagedRows, site, block_base))
      return false;
    rows = static_cast<int>(block_rows);
    base = static_cast<int>(block_base);
    known = true;
    return true;
  }
};

// Lane s: the staged index (slot * rows_per_piece + row in piece) of the copy at source position `pos`;
// sets `piece`, `weights_index` (where the row's top-k weights are) and `unlanded` (the landed count
// that reports the row, 0 when it is known to have landed). -1 with `expired` set if a wait expired.
// Rows of the first round of slots are read early (see kUnlandedWord). A later piece reuses a slot
// whose earlier rows other warps may still be summing, and pulled rows lie in a region that the source
// never marks unlanded: those rows are read once reported landed.
__device__ __forceinline__ int64_t find_staged_row(const StagedReduceArgs& a, const StagingLayout& layout,
                                                   const Header* me, SourceState& state, int source, int pos,
                                                   int& piece, int64_t& weights_index, uint32_t& unlanded,
                                                   const WaitSite& site, bool& expired) {
  if (!state.known && !state.learn(a, me, source, site)) {
    expired = true;
    return -1;
  }
  const int index = pos - state.base;
  piece = index / layout.rows_per_piece;
  const int slot = piece % layout.num_slots;
  unlanded = 0;
  if (state.landed <= index) {
    // NOTE: pulled rows are never read early: nothing marks a source's region as unlanded.
    if (piece < layout.num_slots && !a.pull_rows) {
      unlanded = static_cast<uint32_t>(index + 1);
    } else {
      // One copy stream per owner: copies land in order, and the word counts the rows landed.
      const uint64_t target = staged_word(a.epoch, static_cast<uint32_t>(index + 1));
      Deadline deadline(site);
      uint64_t value;
      while ((value = ld_acquire_sys(&me->staged_landed[source])) < target) {
        if (deadline.expired(kWaitStagedRows, source, index + 1,
                             counter_epoch(value) == a.epoch ? static_cast<uint32_t>(value) : 0)) {
          expired = true;
          return -1;
        }
      }
      state.landed = static_cast<int>(static_cast<uint32_t>(value));
    }
  }
  const int64_t staged = static_cast<int64_t>(slot) * layout.rows_per_piece + index % layout.rows_per_piece;
  weights_index = layout.weights_fit_whole(state.rows, a.num_topk) ? index : staged;
  return staged;
}

// Lane s: one more row of `piece` is summed; the last one frees the piece's slot for source s.
__device__ __forceinline__ void count_summed_row(const StagedReduceArgs& a, const StagingLayout& layout, Header* me,
                                                 const SourceState& state, int source, int piece) {
  const int slot = piece % layout.num_slots;
  const int first = piece * layout.rows_per_piece;
  const uint32_t piece_rows = static_cast<uint32_t>(min(layout.rows_per_piece, state.rows - first));
  if (atomicAdd(&me->staged_rows_done[source][slot], 1u) + 1u == piece_rows) {
    // NOTE: the count is reset before the slot is freed: the next piece in this slot lands only after.
    me->staged_rows_done[source][slot] = 0;
    __threadfence();
    st_release_sys(&header_of(a.peer_buffers, source)->staged_freed[a.rank][slot], staged_word(a.epoch, piece + 1));
  }
}

// Lane k < num_topk: weight k of a token summed over its copies (own: user memory), in rank order as
// sum_token_copies adds rows. Bit r of `by_kernel`: source r's weights were stored by its reduction kernel
// (send_to_owners), and its weights-landed word reports them; else they land with the row.
template <int kSources>
__device__ __forceinline__ float sum_staged_weights(const StagedReduceArgs& a, const Header* me,
                                                    const float* const (&weights)[kSources],
                                                    const uint32_t (&unlanded)[kSources], uint32_t by_kernel,
                                                    const WaitSite& site, bool& expired) {
  const int lane = lane_id();
  float sum = 0.f;
#pragma unroll
  for (int r = 0; r < kSources; ++r) {
    if (weights[r] == nullptr || lane >= a.num_topk) continue;
    if (r == a.rank) {
      sum += weights[r][lane];
      continue;
    }
    const float* weight = weights[r] + lane;
    float value = load_staged(weight);
    const bool stored = (by_kernel >> r) & 1u;
    if ((stored || unlanded[r] != 0) && has_unlanded_word(value))
      value = wait_for_landed(weight, stored ? Landing{&me->staged_weights_landed[r], a.epoch, 1u, r}
                                             : landing_of(a, me, r, unlanded[r]), site, expired);
    sum += value;
  }
  return sum;
}

// Floats of top-k weights a warp claims at a time (sender side).
constexpr int kWeightsChunk = 1024;

// Lane 0 claims the next `step` items of `counter` for its warp; every lane gets the first.
__device__ __forceinline__ uint32_t claim_next(uint32_t* counter, uint32_t step = 1) {
  uint32_t claimed = 0;
  if (lane_id() == 0) claimed = atomicAdd(counter, step);
  return shfl(claimed, 0);
}

// One warp copies a chunk of at most kWeightsChunk floats: 16-byte units, a lane's loads in flight before
// its stores, where both ends are 16-byte aligned (top-k 8); else float by float.
// NOTE: a loop of single floats waits one memory latency per float before its warp sums a token: the
// reduction alone took 221.7-222.1 against 217.4-218.3 us at 8 SMs (benchmarks/probes/staged_reduce.cu, one H200).
// Not common/copy.cuh's warp_copy_units: its loop over any count made the 2-rank kernel spill 48 bytes (ptxas).
__device__ __forceinline__ void warp_copy_chunk(float* to, const float* from, int count) {
  constexpr int kUnitsPerLane = kWeightsChunk / 4 / 32;
  const int lane = lane_id();
  int done = 0;
  if (((reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) & 15) == 0) {
    const int units = count / 4;
    int4 values[kUnitsPerLane];
#pragma unroll
    for (int j = 0; j < kUnitsPerLane; ++j)
      if (lane + 32 * j < units) values[j] = ld_nc_v4(reinterpret_cast<const int4*>(from) + lane + 32 * j);
#pragma unroll
    for (int j = 0; j < kUnitsPerLane; ++j)
      if (lane + 32 * j < units) reinterpret_cast<int4*>(to)[lane + 32 * j] = values[j];
    done = units * 4;
  }
  for (int i = done + lane; i < count; i += 32) to[i] = from[i];
}

// The sender's side of a combine in its reduction kernel: for each owner, once the owner has released
// its staging area (its reads of the previous combine are over), every block tells it where this rank's
// rows start and how many there are (the same words: whichever block runs first), and the warps store
// the top-k weights for it in claimed chunks; whoever stores the last chunk sets the owner's
// weights-landed word. The weights then need no copy of their own ahead of the rows on the copy stream,
// and no block waits for another (under MPS or beside other kernels, not every block may be resident).
// False (in every thread of the block) on an error: an earlier kernel of this rank failed, or a wait expired.
__device__ bool send_to_owners(const StagedReduceArgs& a, const StagingLayout& layout, Header* me,
                               const WaitSite& site) {
  bool failed = threadIdx.x == 0 && error_claimed(&me->error_claim);
  for (int owner = 0; owner < a.num_ranks; ++owner) {
    if (owner == a.rank) continue;
    const int rows = a.send_rows[owner];
    if (threadIdx.x == 0 && !failed) {
      Deadline deadline(site);
      uint64_t value;
      while ((value = ld_acquire_sys(&me->staged_released[owner])) < a.epoch - 1)
        if ((failed = deadline.expired(kWaitStagingFree, owner, a.epoch - 1, value))) break;
    }
    if (__syncthreads_or(failed)) return false;
    Header* theirs = header_of(a.peer_buffers, owner);
    if (threadIdx.x == 0) {
      st_release_sys(&theirs->staged_rows[a.rank], staged_word(a.epoch, static_cast<uint32_t>(rows)));
      st_release_sys(&theirs->staged_base[a.rank], staged_word(a.epoch, static_cast<uint32_t>(a.send_first[owner])));
    }
    if (a.topk_weights == nullptr || a.num_topk == 0 || !layout.weights_fit_whole(rows, a.num_topk)) continue;
    float* to = reinterpret_cast<float*>(staged_region(a, layout, owner, a.rank) + layout.weights_offset(0, a.num_topk));
    const float* from = a.topk_weights + static_cast<int64_t>(a.send_first[owner]) * a.num_topk;
    const int64_t count = static_cast<int64_t>(rows) * a.num_topk;
    const uint32_t chunks = static_cast<uint32_t>((count + kWeightsChunk - 1) / kWeightsChunk);
    for (uint32_t chunk; (chunk = claim_next(&me->weights_next_chunk[owner])) < chunks;) {
      const int64_t first = static_cast<int64_t>(chunk) * kWeightsChunk;
      warp_copy_chunk(to + first, from + first, static_cast<int>(min(static_cast<int64_t>(kWeightsChunk), count - first)));
      // NOTE: every lane's stores are visible before the chunk is counted; the last one then publishes.
      __threadfence_system();
      __syncwarp();
      if (lane_id() == 0 && atomicAdd(&me->weights_chunks_done[owner], 1u) + 1u == chunks) {
        me->weights_chunks_done[owner] = 0;
        __threadfence_system();
        st_release_sys(&theirs->staged_weights_landed[a.rank], staged_word(a.epoch, 1));
      }
    }
  }
  return true;
}

// A token's top-k weight over its two copies in a 2-rank combine, added in rank order from zero as
// sum_staged_weights adds them.
__device__ __forceinline__ float pair_weight_sum(int rank, bool has_own, float own, bool has_staged, float staged) {
  float sum = 0.f;
  if (rank == 0 && has_own) sum += own;
  if (has_staged) sum += staged;
  if (rank == 1 && has_own) sum += own;
  return sum;
}

// Token t's summed top-k weights in a 2-rank combine (sum_pair_weights_after_rows): `stored` says whether
// the other rank's weights were stored by its kernel; if not, they came with the row and are summed there.
__device__ __forceinline__ void sum_pair_weights_of_token(const StagedReduceArgs& a, const StagingLayout& layout,
                                                          const uint8_t* region, int base, bool stored, int t) {
  const int other = a.rank == 0 ? 1 : 0;
  const int K = a.num_topk;
  const int own_row = a.send_pos[static_cast<int64_t>(t) * 2 + a.rank];
  const int staged_pos = a.send_pos[static_cast<int64_t>(t) * 2 + other];
  if (staged_pos >= 0 && !stored) return;
  const float* own = own_row >= 0 && a.topk_weights != nullptr ? a.topk_weights + static_cast<int64_t>(own_row) * K
                                                               : nullptr;
  const float* staged = staged_pos >= 0 ? reinterpret_cast<const float*>(
                                              region + layout.weights_offset(staged_pos - base, K))
                                        : nullptr;
  float* out = a.combined_topk_weights + static_cast<int64_t>(t) * K;
  for (int k0 = 0; k0 < K; k0 += 8) {
    float own_values[8], staged_values[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      own_values[j] = own != nullptr && k0 + j < K ? own[k0 + j] : 0.f;
      staged_values[j] = staged != nullptr && k0 + j < K ? load_staged(staged + k0 + j) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k0 + j < K)
        out[k0 + j] = pair_weight_sum(a.rank, own != nullptr, own_values[j], staged != nullptr, staged_values[j]);
  }
}

// The summed top-k weights of a 2-rank combine once the warp's rows are summed, 32 claimed tokens at a
// time, a token per lane: every token but those whose staged weights came with their piece (summed beside
// the row, before the slot is freed). One wait for the other rank's stored weights and all loads in flight
// at once, where summed token by token they added a latency to each.
__device__ void sum_pair_weights_after_rows(const StagedReduceArgs& a, const StagingLayout& layout, Header* me,
                                            SourceState state, const WaitSite& site, bool& expired) {
  const int other = a.rank == 0 ? 1 : 0;
  const int K = a.num_topk;
  // Lane `other` learns the other rank's block, if none of the warp's tokens had a staged copy.
  if (lane_id() == other && !state.known) expired = !state.learn(a, me, other, site);
  if (__any_sync(0xffffffffu, expired)) return;
  const int base = shfl(state.base, other);
  const int rows = shfl(state.rows, other);
  // NOTE: a sender of no rows stores no weights (its top-k weights may not even exist).
  const bool stored = rows > 0 && layout.weights_fit_whole(rows, K);
  if (stored) wait_until_reported(Landing{&me->staged_weights_landed[other], a.epoch, 1u, other}, site, expired);
  if (__any_sync(0xffffffffu, expired)) return;
  const uint8_t* region = staged_region(a, layout, a.rank, other);
  for (int first; (first = static_cast<int>(claim_next(&me->staged_next_weights_token, 32))) < a.num_tokens;)
    if (first + lane_id() < a.num_tokens) sum_pair_weights_of_token(a, layout, region, base, stored, first + lane_id());
}

// Lane r < R: an L2 prefetch of the copy from rank r of the token (own: user memory). Prefetching the
// warp's next token as well measured slower. Not in a 2-rank combine (kPair), whose bf16x2 sum is bound
// by memory: there the prefetches slowed the reduction alone (benchmarks/probes/staged_reduce.cu, one
// H200, L2 flushed) from 228.4 to 276.1 us at 8 SMs and from 89.7 to 102.2 at 24.
__device__ __forceinline__ void prefetch_rows(const StagedReduceArgs& a, const StagingLayout& layout,
                                              const uint8_t* region, int pos, int64_t staged) {
  const int lane = lane_id();
  if (lane >= a.num_ranks) return;
  const uint32_t row_bytes = static_cast<uint32_t>(layout.row_bytes);
  const uint8_t* own = static_cast<const uint8_t*>(a.x);
  if (pos >= 0 && (lane == a.rank || staged >= 0))
    prefetch_to_l2(lane == a.rank ? own + static_cast<int64_t>(pos) * row_bytes : region + layout.row_offset(staged),
                   row_bytes);
}

// The last block out resets the claim counters for the next combine, which follows on this stream.
// NOTE: after every warp's last claims.
__device__ __forceinline__ void reset_claims_when_last(Header* me, int num_ranks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&me->staged_blocks_done, 1u) + 1u == gridDim.x) {
      me->staged_blocks_done = 0;
      me->staged_next_token = 0;
      me->staged_next_weights_token = 0;
      for (int r = 0; r < num_ranks; ++r) me->weights_next_chunk[r] = 0;
      __threadfence();
    }
  }
}

// Rank r's copy of a warp's token, from the lane that knows it (r < R; else rank 0's lane): its row in
// the rank's combine input (-1: none), its staged index and weights index, and the region it lies in.
struct RankCopy {
  int row;
  int64_t index, weights_at;
  const uint8_t* base;
};

__device__ __forceinline__ RankCopy rank_copy(int r, int R, int pos, int64_t staged, int64_t weights_index,
                                              const uint8_t* region) {
  const int from = r < R ? r : 0;
  return RankCopy{shfl(pos, from), shfl(staged, from), shfl(weights_index, from),
                  static_cast<const uint8_t*>(shfl_ptr(region, from))};
}

// What every reduction kernel starts from: this rank's header, the staging layout, the site of its waits
// and, in lane s < R other than this rank, where source s's rows for it lie.
struct ReductionStart {
  Header* me;
  StagingLayout layout;
  WaitSite site;
  bool is_source;
  const uint8_t* region;
};

__device__ __forceinline__ ReductionStart reduction_start(const StagedReduceArgs& a) {
  Header* me = header_of(a.peer_buffers, a.rank);
  const int lane = lane_id();
  const StagingLayout layout = StagingLayout::fit(a.num_ranks, a.staging_offset, a.staging_bytes, 2LL * a.hidden);
  const bool is_source = lane < a.num_ranks && lane != a.rank;
  return ReductionStart{me, layout,
                        WaitSite{a.status, &me->error_claim, a.timeout_ns, kOpCombine, a.rank, -1,
                                 static_cast<int>(threadIdx.x >> 5)},
                        is_source, is_source ? staged_region(a, layout, a.rank, lane) : nullptr};
}

// kPair: a combine of 2 ranks without bias, whose tokens have at most two copies (sum_own_and_staged);
// a token's weights are loaded before its rows and summed after them, so that their latency overlaps.
template <bool kPair>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) staged_reduce_kernel(StagedReduceArgs a) {
  const auto [me, layout, site, is_source, region] = reduction_start(a);
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int num_units = a.hidden / 8;
  const int4* bias_0 = static_cast<const int4*>(a.bias_0);
  const int4* bias_1 = static_cast<const int4*>(a.bias_1);
  SourceState state;
  if (!send_to_owners(a, layout, me, site)) return;
  bool expired = false;  // a wait of this lane expired: the warp ends its tokens

  // Warps claim tokens in order, so that the first rows to land are summed first and every token is summed
  // by whichever warps run: a later piece waits for a slot that earlier tokens free. The next token is
  // claimed, and its positions loaded, a token ahead.
  auto positions = [&](int t) { return lane < R && t < a.num_tokens ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1; };
  int next = static_cast<int>(claim_next(&me->staged_next_token));
  int pos_ahead = positions(next);
  while (next < a.num_tokens) {
    const int t = next;
    const int pos = pos_ahead;
    next = static_cast<int>(claim_next(&me->staged_next_token));
    pos_ahead = positions(next);
    int piece = -1;
    int64_t staged = -1, weights_index = -1;
    uint32_t unlanded = 0;
    if (is_source && pos >= 0)
      staged = find_staged_row(a, layout, me, state, lane, pos, piece, weights_index, unlanded, site, expired);
    // NOTE: before any row is addressed (a row whose wait expired has no staged index); `expired` also
    // holds the previous token's waits.
    if (__any_sync(0xffffffffu, expired)) break;
    if constexpr (!kPair) prefetch_rows(a, layout, region, pos, staged);
    // NOTE: orders each lane's acquire of its source's piece before every lane's reads of the rows.
    __syncwarp();
    const uint32_t weights_by_kernel =
        __ballot_sync(0xffffffffu, staged >= 0 && layout.weights_fit_whole(state.rows, a.num_topk));

    const int64_t row_units = static_cast<int64_t>(t) * num_units;
    int4* out = reinterpret_cast<int4*>(a.combined_x) + row_units;
    if constexpr (kPair) {
      // The two copies' addresses come straight from this rank's lane and the other's: arrays indexed by
      // the rank live in local memory (a store and a load on every token's path, cuobjdump sm_90a); without
      // them the reduction alone took 221 against 229 us at 8 SMs (staged_reduce.cu, one H200).
      const int other = a.rank == 0 ? 1 : 0;
      const int own_row = shfl(pos, a.rank);
      const int staged_pos = shfl(pos, other);
      const int64_t index = shfl(staged, other);
      const int64_t weights_at = shfl(weights_index, other);
      const uint8_t* base = static_cast<const uint8_t*>(shfl_ptr(region, other));
      const Landing landing = landing_of(a, me, other, shfl(unlanded, other));
      const int4* own = own_row < 0 ? nullptr
                                    : reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) +
                                                                    static_cast<int64_t>(own_row) * a.hidden * 2);
      const int4* staged_row = staged_pos < 0 ? nullptr : reinterpret_cast<const int4*>(base + layout.row_offset(index));
      // Weights stored by the sender's kernel are summed after the warp's last token
      // (sum_pair_weights_after_rows); those that land with a piece are read here, before its slot is freed.
      const bool stored = (weights_by_kernel >> other) & 1u;
      const bool weights_with_row =
          a.combined_topk_weights != nullptr && lane < a.num_topk && staged_row != nullptr && !stored;
      // The weights' loads go out before the rows' and are summed after them: their latency overlaps.
      const float* own_weight = weights_with_row && own != nullptr && a.topk_weights != nullptr
                                    ? a.topk_weights + static_cast<int64_t>(own_row) * a.num_topk
                                    : nullptr;
      const float* staged_weight =
          weights_with_row ? reinterpret_cast<const float*>(base + layout.weights_offset(weights_at, a.num_topk))
                           : nullptr;
      const float own_value = own_weight == nullptr ? 0.f : own_weight[lane];
      float staged_value = staged_weight == nullptr ? 0.f : load_staged(staged_weight + lane);
      sum_own_and_staged(own, staged_row, landing, num_units, out, site, expired);
      if (weights_with_row) {
        if (!landing.known() && has_unlanded_word(staged_value))
          staged_value = wait_for_landed(staged_weight + lane, landing, site, expired);
        a.combined_topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] =
            pair_weight_sum(a.rank, own_weight != nullptr, own_value, true, staged_value);
      }
    } else {
      const int4* src[kMaxNvlPeers];
      const float* src_weights[kMaxNvlPeers];
      uint32_t unlanded_of[kMaxNvlPeers];
#pragma unroll
      for (int r = 0; r < kMaxNvlPeers; ++r) {
        const auto [row, index, weights_at, base] = rank_copy(r, R, pos, staged, weights_index, region);
        unlanded_of[r] = shfl(unlanded, r < R ? r : 0);
        src[r] = nullptr;
        src_weights[r] = nullptr;
        if (r >= R || row < 0) continue;
        if (r == a.rank) {
          src[r] = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2);
          if (a.topk_weights != nullptr) src_weights[r] = a.topk_weights + static_cast<int64_t>(row) * a.num_topk;
        } else {
          src[r] = reinterpret_cast<const int4*>(base + layout.row_offset(index));
          src_weights[r] = reinterpret_cast<const float*>(base + layout.weights_offset(weights_at, a.num_topk));
        }
      }
      if (a.combined_topk_weights != nullptr) {
        const float sum = sum_staged_weights(a, me, src_weights, unlanded_of, weights_by_kernel, site, expired);
        if (lane < a.num_topk) a.combined_topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] = sum;
      }
      sum_token_copies(src, a.rank, num_units, bias_0 == nullptr ? nullptr : bias_0 + row_units,
                       bias_1 == nullptr ? nullptr : bias_1 + row_units, out,
                       StagedCopiesLanded{unlanded, &a, me, num_units, &site, &expired});
    }
    __syncwarp();
    // NOTE: with every row of the source in the first round of slots no slot is reused, so nobody
    // waits for the count (its atomic round trip is skipped).
    if (piece >= 0 && state.rows > layout.rows_capacity())
      count_summed_row(a, layout, me, state, lane, piece);
  }
  if constexpr (kPair)
    if (a.combined_topk_weights != nullptr && !__any_sync(0xffffffffu, expired))
      sum_pair_weights_after_rows(a, layout, me, state, site, expired);
  reset_claims_when_last(me, R);
}

// The most ranks whose rows are pulled (ep_plugin.tuning.STAGING_MAX_RANKS), and the units per lane of each
// copy that a pulled sum loads at once.
constexpr int kMaxPulledRanks = 4;
constexpr int kPulledUnroll = 4;

// One warp sums a token's copies (src[r]: rank r's copy, or nullptr; rank `own`'s is user memory) in fp32,
// in rank order, then the token's biases (kBias: either may be nullptr), and stores the bf16 row: every
// copy's kPulledUnroll units per lane in flight at once, for the pulled copies cross NVLink (a round trip
// several times a local one).
template <bool kBias>
__device__ __forceinline__ void sum_pulled_copies(const int4* const (&src)[kMaxPulledRanks], int own, int num_units,
                                                  const int4* bias_0, const int4* bias_1, int4* out) {
  const int lane = lane_id();
  for (int base = 0; base < num_units; base += 32 * kPulledUnroll) {
    int4 values[kMaxPulledRanks][kPulledUnroll];
#pragma unroll
    for (int r = 0; r < kMaxPulledRanks; ++r) {
      if (src[r] == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kPulledUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < num_units) values[r][u] = r == own ? ld_nc_v4(src[r] + i) : ld_cg_v4(src[r] + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kPulledUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i >= num_units) continue;
      float acc[8] = {};
#pragma unroll
      for (int r = 0; r < kMaxPulledRanks; ++r)
        if (src[r] != nullptr) add_bf16x8(acc, values[r][u]);
      if constexpr (kBias) {
        if (bias_0 != nullptr) add_bf16x8(acc, ld_nc_v4(bias_0 + i));
        if (bias_1 != nullptr) add_bf16x8(acc, ld_nc_v4(bias_1 + i));
      }
      st_na_v4(out + i, to_bf16x8(acc));
    }
  }
}

// The owner's side of a pulled combine (pull_rows, 3-4 ranks; kBias: with biases): warp w of the grid sums tokens
// w, w + W, ... (nothing is reused, so no token waits for another warp's), each once its copies are
// reported landed, with the loads of every copy in flight at once and the top-k weights' loads before the
// rows': the shape of benchmarks/probes/pull_rate.cu, whose loop pulls at the link's rate from 8 SMs on.
// Bulk loads of the copies into shared memory and L2 prefetches of the next token's pulled rows lost to it
// (docs/design.md, "Pulled by the owners").
template <bool kBias>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) pulled_reduce_kernel(StagedReduceArgs a) {
  const auto [me, layout, site, is_source, region] = reduction_start(a);
  const int lane = lane_id();
  const int R = a.num_ranks;
  const int K = a.num_topk;
  const int num_units = a.hidden / 8;
  const bool with_weights = a.combined_topk_weights != nullptr;
  SourceState state;
  bool weights_landed = false;  // lane s: source s's stored weights are reported landed
  if (!send_to_owners(a, layout, me, site)) return;
  bool expired = false;

  const int warps = gridDim.x * (blockDim.x >> 5);
  auto positions = [&](int t) { return lane < R && t < a.num_tokens ? a.send_pos[static_cast<int64_t>(t) * R + lane] : -1; };
  int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int pos_ahead = positions(t);
  for (; t < a.num_tokens; t += warps) {
    const int pos = pos_ahead;
    pos_ahead = positions(t + warps);
    int piece = -1;
    int64_t staged = -1, weights_index = -1;
    uint32_t unlanded = 0;
    if (is_source && pos >= 0) {
      staged = find_staged_row(a, layout, me, state, lane, pos, piece, weights_index, unlanded, site, expired);
      // NOTE: every row fits the region, so the sender's kernel stored all its weights at once.
      if (staged >= 0 && with_weights && !weights_landed)
        weights_landed = wait_until_reported(Landing{&me->staged_weights_landed[lane], a.epoch, 1u, lane}, site, expired);
    }
    if (__any_sync(0xffffffffu, expired)) break;
    // NOTE: orders each lane's acquires before every lane's reads of the rows and weights.
    __syncwarp();

    const int4* src[kMaxPulledRanks];
    float weight[kMaxPulledRanks];
#pragma unroll
    for (int r = 0; r < kMaxPulledRanks; ++r) {
      const auto [row, index, weights_at, base] = rank_copy(r, R, pos, staged, weights_index, region);
      src[r] = nullptr;
      weight[r] = 0.f;
      if (r >= R || row < 0) continue;
      const bool own = r == a.rank;
      src[r] = own ? reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(row) * a.hidden * 2)
                   : reinterpret_cast<const int4*>(base + layout.row_offset(index));
      if (with_weights && lane < K)
        weight[r] = own ? (a.topk_weights == nullptr ? 0.f : a.topk_weights[static_cast<int64_t>(row) * K + lane])
                        : ld_cg_f32(reinterpret_cast<const float*>(base + layout.weights_offset(weights_at, K)) + lane);
    }
    const int64_t row_units = static_cast<int64_t>(t) * num_units;
    sum_pulled_copies<kBias>(src, a.rank, num_units,
                             a.bias_0 == nullptr ? nullptr : static_cast<const int4*>(a.bias_0) + row_units,
                             a.bias_1 == nullptr ? nullptr : static_cast<const int4*>(a.bias_1) + row_units,
                             reinterpret_cast<int4*>(a.combined_x) + row_units);
    if (with_weights && lane < K) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < kMaxPulledRanks; ++r)
        if (src[r] != nullptr) sum += weight[r];
      a.combined_topk_weights[static_cast<int64_t>(t) * K + lane] = sum;
    }
  }
  reset_claims_when_last(me, R);
}

__global__ void staging_wait_kernel(StagingWaitArgs a) {
  const WaitSite site{a.status, a.claim, a.timeout_ns, kOpCombine, a.rank, a.slot, 0};
  Deadline deadline(site);
  while (true) {
    const uint64_t value = ld_acquire_sys(a.word);
    if (value >= a.target) break;
    const bool same_epoch = counter_epoch(value) == counter_epoch(a.target);
    if (deadline.expired(kWaitStagingFree, a.peer, static_cast<int64_t>(a.target & 0xffffffffu),
                         same_epoch ? static_cast<int64_t>(value & 0xffffffffu) : 0))
      break;
  }
}

__global__ void write_word_kernel(uint64_t* address, uint64_t value) {
  __threadfence_system();
  st_release_sys(address, value);
}

}  // namespace

void launch_write_word(uint64_t* address, uint64_t value, cudaStream_t stream) {
  write_word_kernel<<<1, 1, 0, stream>>>(address, value);
  CUDA_CHECK(cudaGetLastError());
}

void load_staged_combine_kernels() {
  cudaFuncAttributes attributes;
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, staged_reduce_kernel<false>));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, staged_reduce_kernel<true>));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, pulled_reduce_kernel<false>));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, pulled_reduce_kernel<true>));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, staging_wait_kernel));
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, write_word_kernel));
}

void launch_staged_reduce(const StagedReduceArgs& args, int num_blocks, cudaStream_t stream) {
  EP_CHECK_ARG(args.num_ranks >= 2 && args.num_ranks <= kMaxNvlPeers,
               "the copy-engine combine needs 2 to " << kMaxNvlPeers << " ranks, got " << args.num_ranks);
  EP_CHECK_ARG(args.hidden > 0 && args.hidden % 8 == 0, "bf16 rows must be a multiple of 16 bytes, hidden = "
                                                           << args.hidden);
  EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "top-k must be at most " << kMaxTopk);
  EP_CHECK_ARG(num_blocks >= 1, "the reduction needs at least one SM");
  const bool bias = args.bias_0 != nullptr || args.bias_1 != nullptr;
  EP_CHECK_ARG(!args.pull_rows || args.num_ranks <= kMaxPulledRanks,
               "pulled rows serve at most " << kMaxPulledRanks << " ranks, got " << args.num_ranks);
  if (args.pull_rows && bias)
    pulled_reduce_kernel<true><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  else if (args.pull_rows)
    pulled_reduce_kernel<false><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  else if (args.num_ranks == 2 && !bias)
    staged_reduce_kernel<true><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  else
    staged_reduce_kernel<false><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

void launch_staging_wait(const StagingWaitArgs& args, cudaStream_t stream) {
  staging_wait_kernel<<<1, 1, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin::intranode
