// Low-latency dispatch: every (token, selected expert) pair becomes one message in that expert's
// region on its rank; the receiver packs each expert's messages into its slots of recv_x. A
// message is an index entry (t * kMaxTopk + k) in the region's slot; the token's payload crosses
// to a rank once, however many of its experts live there.
//
// Send (block b: tokens b, b + B, ..., up to kMaxTokensPerStep at a time; counts of experts
// e = b mod B), in two groups of warps that run side by side:
//   1. the count group counts this rank's messages to each of the block's experts and announces
//      the counts;
//   2. the send group casts each token t of a step once into this round's token payload (FP8 with
//      scales, or bf16) and counts, for each top-k column k, the earlier entries of topk_idx that
//      select the same expert: the slot of (t, k) in its region (a region holds its tokens in
//      (token, k) order);
//   3. per destination rank of the token, one warp stores the payload there once, then the index
//      entry of each column k whose expert e lives there into region (e, this rank) at its slot,
//      and adds 1 to that region's signal word: straight stores + release over NVLink, puts (the
//      entries with their signals) over the network.
// Receive (block b: local experts b, b + B, ...):
//   warp 0 waits until the word of every source rank is complete (count announced, that many
//   messages arrived), resets it, and lays the sources out one after another (slot order: source
//   rank, then token, then k, as the reference backend defines it); then the warps take the slots
//   in turn, copy each slot's payload into recv_x / recv_scales and record where it came from (for
//   combine).
//
// Shrink mode (a rank mask, low_latency_layout.cuh): the count group and the send group skip masked
// destination ranks; the receive counts a masked source as 0 messages.
//
// With topk_weights (expert-side sums, see low_latency_layout.cuh) each payload also carries the
// token's route (ids, weights), the counts say so (kRouteBit), and the receive fills route_table.
//
// Without a hook both phases run in one launch (every block resident: num_blocks <= SMs), so a
// block only waits after it has sent everything it owns.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../common/exception.cuh"
#include "low_latency_layout.cuh"

namespace ep_plugin::low_latency {
namespace {

// The send phase splits the block: warps [0, kSendWarps) cast and send tokens while the last
// kCountWarps count and announce this rank's messages per expert, each group with its own barrier.
constexpr int kCountWarps = 2;  // 448 send threads: one cast pass for hidden 7168
constexpr int kSendWarps = kWarps - kCountWarps;
constexpr int kSendThreads = kSendWarps * 32;
constexpr int kCountThreads = kCountWarps * 32;
constexpr int kSendBarrier = 1;   // named barriers (0 is __syncthreads)
constexpr int kCountBarrier = 2;

__device__ __forceinline__ void sync_threads(int barrier, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(num_threads) : "memory");
}

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

// ---- FP8 cast (ep_plugin/fp8.py is the definition; every operation below is rounded as there) ----
__device__ __forceinline__ float round_up_to_power_of_two(float scale) {
  uint32_t bits = __float_as_uint(scale);
  if (bits & 0x007FFFFFu) bits = (bits & 0x7F800000u) + 0x00800000u;
  return __uint_as_float(bits);
}

__device__ __forceinline__ void bf16x8_to_float(const int4& packed, float* out) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// 8 channels -> 8 e4m3 bytes: clamp(x / scale) rounded to nearest even, saturating.
__device__ __forceinline__ int2 quantize8(const float* v, float scale) {
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int i = 4 * w + 2 * p;
      const float a = fminf(fmaxf(__fdiv_rn(v[i], scale), -kFp8Max), kFp8Max);
      const float b = fminf(fmaxf(__fdiv_rn(v[i + 1], scale), -kFp8Max), kFp8Max);
      const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
      word |= static_cast<uint32_t>(pair) << (16 * p);  // .x in the low byte: channel order kept
    }
    words[w] = word;
  }
  return make_int2(static_cast<int>(words[0]), static_cast<int>(words[1]));
}

// Casts token `token` into `payload`: H e4m3 bytes, then one float scale per 128 channels at
// fp8_scales_offset(). Thread i handles channels [16 u, 16 u + 16) for u = i, i + kSendThreads, ...;
// the 8 threads of a 128-channel block are 8 aligned lanes of one warp and share its amax.
__device__ void cast_token_fp8(const DispatchArgs& a, int token, uint8_t* payload) {
  const LowLatencyLayout& layout = a.layout;
  const int hidden = layout.hidden;
  const int4* row = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + token * layout.row_bytes());
  float* scales = reinterpret_cast<float*>(payload + layout.fp8_scales_offset());
  const int num_units = (hidden + 15) / 16;
  // NOTE: the trip count is the same for every thread: the shuffles below need whole warps.
  for (int base = 0; base < num_units; base += kSendThreads) {
    const int unit = base + static_cast<int>(threadIdx.x);
    const int first = unit * 16;
    // hidden is a multiple of 8: a unit holds 16, 8 or 0 channels.
    const int valid = first + 16 <= hidden ? 16 : (first < hidden ? hidden - first : 0);
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.0f;
    if (valid >= 8) bf16x8_to_float(ld_nc_v4(row + 2 * unit), v);
    if (valid == 16) bf16x8_to_float(ld_nc_v4(row + 2 * unit + 1), v + 8);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
    if (a.round_scale) scale = round_up_to_power_of_two(scale);
    if (valid >= 8) *reinterpret_cast<int2*>(payload + first) = quantize8(v, scale);
    if (valid == 16) *reinterpret_cast<int2*>(payload + first + 8) = quantize8(v + 8, scale);
    if (valid > 0 && unit % 8 == 0) scales[unit / 8] = scale;
  }
}

// The route after the row: the token's top-k ids (int32, -1 where not routed) and weights.
// The send group; threads [0, num_topk).
__device__ void write_route(const DispatchArgs& a, int token, uint8_t* payload) {
  const int k = static_cast<int>(threadIdx.x);
  if (k >= a.num_topk) return;
  int32_t* ids = reinterpret_cast<int32_t*>(payload + a.layout.route_offset(a.use_fp8));
  float* weights = reinterpret_cast<float*>(ids + kMaxTopk);
  const int64_t entry = static_cast<int64_t>(token) * a.num_topk + k;
  const int64_t id = __ldg(a.topk_idx + entry);
  ids[k] = id >= 0 && id < a.layout.num_experts ? static_cast<int32_t>(id) : -1;
  weights[k] = __ldg(a.topk_weights + entry);
}

__device__ void copy_token_bf16(const DispatchArgs& a, int token, uint8_t* payload) {
  const int4* row = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + token * a.layout.row_bytes());
  int4* out = reinterpret_cast<int4*>(payload);
  const int num_units = static_cast<int>(a.layout.row_bytes() / 16);
  for (int u = threadIdx.x; u < num_units; u += kSendThreads) out[u] = ld_nc_v4(row + u);
}

// ---- routing ------------------------------------------------------------------------------------
__device__ __forceinline__ bool is_expert(int64_t id, int num_experts) { return id >= 0 && id < num_experts; }

constexpr int kCountsPerPass = 1024;  // experts one block counts per pass over topk_idx

// One thread: topk_idx[entry] is neither -1 nor an expert id. Records (rank, token, k, value) in the
// status for the host, which raises it at this rank's next low_latency_dispatch and clears it
// (LowLatencyRuntime::raise_bad_input). The first record stays until then (graph replays add none).
// The kernels treat the id as -1 everywhere, so the peers' counts still match.
__device__ __noinline__ void record_bad_expert_id(const DispatchArgs& a, int64_t entry) {
  DeviceStatus* status = a.status;
  if (status->bad_input_rank >= 0) return;
  status->bad_input_code = kErrBadExpertId;
  status->bad_input_detail[0] = entry / a.num_topk;
  status->bad_input_detail[1] = entry % a.num_topk;
  status->bad_input_detail[2] = __ldg(a.topk_idx + entry);
  __threadfence_system();  // NOTE: the details reach the host before the rank that marks them valid
  status->bad_input_rank = a.rank;
}

// Announces how many messages this rank sends to each expert e = blockIdx.x (mod num_blocks).
// The count group (warps [kSendWarps, kWarps)): one pass over topk_idx per kCountsPerPass experts,
// counted in shared memory.
// NOTE: a count may land before its messages: the receiver compares arrivals with it.
// Block 0's first pass also finds the first entry of topk_idx that is neither -1 nor an expert id.
__device__ void announce_expert_counts(const DispatchArgs& a) {
  __shared__ int counts[kCountsPerPass];
  __shared__ unsigned long long first_bad_entry;
  const LowLatencyLayout& layout = a.layout;
  const int num_experts = layout.num_experts, num_local = layout.num_local_experts();
  const int64_t num_entries = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  const int block = blockIdx.x, stride = a.num_blocks;
  const int thread = static_cast<int>(threadIdx.x) - kSendThreads;
  for (int first = 0; first * stride + block < num_experts; first += kCountsPerPass) {
    const bool check_ids = block == 0 && first == 0;
    for (int j = thread; j < kCountsPerPass; j += kCountThreads) counts[j] = 0;
    if (thread == 0) first_bad_entry = static_cast<unsigned long long>(num_entries);
    sync_threads(kCountBarrier, kCountThreads);
#pragma unroll 4
    for (int64_t i = thread; i < num_entries; i += kCountThreads) {
      const int64_t id = __ldg(a.topk_idx + i);
      if (!is_expert(id, num_experts)) {
        if (check_ids && id != -1) atomicMin(&first_bad_entry, static_cast<unsigned long long>(i));
        continue;
      }
      if (static_cast<int>(id) % stride != block) continue;
      const int j = static_cast<int>(id) / stride - first;
      if (j >= 0 && j < kCountsPerPass) atomicAdd(&counts[j], 1);
    }
    sync_threads(kCountBarrier, kCountThreads);
    if (check_ids && thread == 0 && first_bad_entry < static_cast<unsigned long long>(num_entries))
      record_bad_expert_id(a, static_cast<int64_t>(first_bad_entry));
    for (int j = thread; j < kCountsPerPass && (first + j) * stride + block < num_experts; j += kCountThreads) {
      const int expert = (first + j) * stride + block;
      // Only a token that selects one expert twice can push a count past T_max; what is sent stops there.
      const int count = min(counts[j], layout.num_max_tokens);
      const int dst = expert / num_local, local = expert % num_local;
      if (is_rank_masked(a.rank_mask, dst)) continue;  // shrink mode: nothing goes to a masked rank
      announce_count(a.round.dispatch_signals + static_cast<int64_t>(local) * layout.num_ranks + a.rank,
                     count_signal(static_cast<uint32_t>(count), route_mode(a.carry_route, a.bf16_partials),
                                  layout.tag(a.use_fp8)),
                     dst);
    }
    sync_threads(kCountBarrier, kCountThreads);  // counts[] is zeroed again by the next pass
  }
}

constexpr int kMaxTokensPerStep = 4;  // tokens a block casts and sends together

// The tokens a block handles in one step: tokens[g] = first + g * num_blocks for g < count.
struct TokenStep {
  int first, count;
  __device__ int token(int g, int num_blocks) const { return first + g * num_blocks; }
};

// slots[g][k] = the entries of topk_idx before (token g, k) that select the same expert as
// (token g, k): the message's slot in its region, which keeps a region in (token, k) order.
// The send group; experts[g] holds token g's row, slots[] is zero on entry.
__device__ void count_earlier_selections(const DispatchArgs& a, const TokenStep& step,
                                         const int64_t (*experts)[kMaxTopk], int (*slots)[kMaxTopk]) {
  const int num_topk = a.num_topk;
  const int64_t end = static_cast<int64_t>(step.token(step.count - 1, a.num_blocks) + 1) * num_topk;
  for (int64_t i = threadIdx.x; i < end; i += kSendThreads) {
    const int64_t id = __ldg(a.topk_idx + i);
    if (!is_expert(id, a.layout.num_experts)) continue;
    for (int g = 0; g < step.count; ++g) {
      const int64_t row = static_cast<int64_t>(step.token(g, a.num_blocks)) * num_topk;
      for (int k = 0; k < num_topk; ++k)
        if (experts[g][k] == id && i < row + k) atomicAdd(&slots[g][k], 1);
    }
  }
}

// ---- send ---------------------------------------------------------------------------------------
// One lane: a region already holds T_max messages (only a token that selects one expert twice
// gets here).
__device__ void report_region_full(const DispatchArgs& a, int expert, int dst, int slot) {
  record_error(a.status, a.error_claim, kErrTooManyRecvTokens, kOpLowLatencyDispatch, 0, a.rank, dst, expert,
               static_cast<int>(threadIdx.x / 32), a.layout.num_max_tokens, slot + 1);
}

// Sends token `token` to rank `dst`, once, with an index entry and a signal for each of its
// columns k >= first_k whose expert lives there. Warp-collective; lane k handles column k.
// NVLink (or this rank): the payload is stored straight into dst's token_recv area (this rank's
// receivers read it where the cast left it); then each column's index entry, then a release-add on
// the word of (its expert, this rank). Network: the payload is put once, fenced, then each index
// entry is put with its signal.
__device__ void send_token_to_rank(const DispatchArgs& a, const uint8_t* payload, int token, int first_k, int dst,
                                   const int64_t* experts, const int* slots) {
  const LowLatencyLayout& layout = a.layout;
  const int lane = lane_id();
  const int num_local = layout.num_local_experts();
  uint8_t* round_data = a.round.data;  // symmetric addresses below
  // This lane's column: an entry to deliver if its expert lives on dst and its slot fits.
  const int k = lane;
  bool deliver = false;
  int local = 0, slot = 0;
  if (k >= first_k && k < a.num_topk) {
    const int64_t expert = experts[k];
    if (is_expert(expert, layout.num_experts) && expert / num_local == dst) {
      local = static_cast<int>(expert % num_local);
      slot = slots[k];
      deliver = slot < layout.num_max_tokens;
      if (!deliver) report_region_full(a, static_cast<int>(expert), dst, slot);
    }
  }
  const int32_t entry = token * kMaxTopk + k;
  uint8_t* index_entry = round_data + layout.recv_index_offset(local, a.rank, slot);
  uint64_t* signal = a.round.dispatch_signals + static_cast<int64_t>(local) * layout.num_ranks + a.rank;
  const int64_t payload_bytes = layout.used_payload_bytes(a.use_fp8, a.carry_route);
  uint8_t* peer_base = static_cast<uint8_t*>(nvshmem_ptr(round_data, dst));
  if (peer_base != nullptr) {
    if (dst != a.rank)
      warp_copy_bytes<Load::kPlain>(peer_base + layout.token_recv_offset(a.rank, token), payload, payload_bytes);
    if (deliver) *reinterpret_cast<int32_t*>(peer_base + (index_entry - round_data)) = entry;
    // NOTE: the warp barrier orders every lane's payload stores before each lane's release, and
    // the release (system scope) makes them and the lane's index entry visible before the add.
    __syncwarp();
    if (deliver) red_add_release_sys(reinterpret_cast<uint64_t*>(peer_base + (reinterpret_cast<uint8_t*>(signal) -
                                                                              round_data)), 1);
    __syncwarp();
  } else {
    __syncwarp();
    nvshmemx_putmem_nbi_warp(round_data + layout.token_recv_offset(a.rank, token), payload,
                             static_cast<size_t>(payload_bytes), dst);
    // NOTE: the fence orders the payload's delivery before the index entries' (and their signals).
    __syncwarp();
    if (lane == 0) nvshmem_fence();
    __syncwarp();
    if (deliver) {
      int32_t* staged = reinterpret_cast<int32_t*>(round_data + layout.staged_index_offset()) + entry;
      *staged = entry;
      __threadfence_system();  // the transport reads the staged entry from memory
      nvshmem_putmem_signal_nbi(index_entry, staged, sizeof(int32_t), signal, 1, NVSHMEM_SIGNAL_ADD, dst);
    }
    __syncwarp();
  }
}

__device__ void dispatch_send(const DispatchArgs& a) {
  __shared__ int64_t step_experts[kMaxTokensPerStep][kMaxTopk];
  __shared__ int step_slots[kMaxTokensPerStep][kMaxTopk];
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32;
  const int num_experts = layout.num_experts, num_local = layout.num_local_experts();
  const int num_topk = a.num_topk, num_blocks = a.num_blocks;
  uint8_t* payloads = a.round.data + layout.token_payloads_offset();

  if (warp >= kSendWarps) {
    announce_expert_counts(a);
    return;
  }
  // Tokens b, b + B, ... in steps of up to kMaxTokensPerStep: one cast and count pass per step,
  // then the warps send all of the step's tokens at once.
  for (int first = blockIdx.x; first < a.num_tokens; first += kMaxTokensPerStep * num_blocks) {
    const TokenStep step{first, min(kMaxTokensPerStep, (a.num_tokens - first + num_blocks - 1) / num_blocks)};
    sync_threads(kSendBarrier, kSendThreads);  // the previous step's senders have read step_experts / step_slots
    for (int i = threadIdx.x; i < step.count * num_topk; i += kSendThreads) {
      const int g = i / num_topk, k = i % num_topk;
      step_experts[g][k] = __ldg(a.topk_idx + static_cast<int64_t>(step.token(g, num_blocks)) * num_topk + k);
      step_slots[g][k] = 0;
    }
    sync_threads(kSendBarrier, kSendThreads);  // step_experts is read by the count below
    // The count and the cast are independent: one barrier after both (the count's loads are issued
    // while the cast's stores drain).
    for (int g = 0; g < step.count; ++g) {
      const int token = step.token(g, num_blocks);
      uint8_t* payload = payloads + static_cast<int64_t>(token) * layout.payload_bytes();
      if (a.use_fp8) {
        cast_token_fp8(a, token, payload);
      } else {
        copy_token_bf16(a, token, payload);
      }
      if (a.carry_route) write_route(a, token, payload);
    }
    count_earlier_selections(a, step, step_experts, step_slots);
    // NOTE: every thread's part of the payloads is written, and every slot counted, before any warp
    // reads them to send.
    sync_threads(kSendBarrier, kSendThreads);
    // Warps take (token, column k) in turn and serve k's rank when k is that rank's first column.
    for (int item = warp; item < step.count * num_topk; item += kSendWarps) {
      const int g = item / num_topk, k = item % num_topk;
      const int64_t* experts = step_experts[g];
      const int64_t expert = experts[k];
      if (!is_expert(expert, num_experts)) continue;
      const int dst = static_cast<int>(expert / num_local);
      bool first_column = true;
      for (int j = 0; j < k && first_column; ++j)
        first_column = !(is_expert(experts[j], num_experts) && experts[j] / num_local == dst);
      const int token = step.token(g, num_blocks);
      if (first_column && !is_rank_masked(a.rank_mask, dst))
        send_token_to_rank(a, payloads + static_cast<int64_t>(token) * layout.payload_bytes(), token, k, dst, experts,
                           step_slots[g]);
    }
  }
}

// ---- receive ------------------------------------------------------------------------------------
// Expert-side sums: enters message (src, token, column k) into the token's RouteRecord: its row; and,
// from the message of the token's first column here, the mask of its columns here and the weights.
// Warp-collective.
__device__ void record_route(const DispatchArgs& a, int src, int token, int k, int32_t row, const uint8_t* payload) {
  const LowLatencyLayout& layout = a.layout;
  const int lane = lane_id();
  const int32_t* ids = reinterpret_cast<const int32_t*>(payload + layout.route_offset(a.use_fp8));
  const float* weights = reinterpret_cast<const float*>(ids + kMaxTopk);
  int id = -1;
  if (lane < a.num_topk) id = ld_cg_s32(ids + lane);
  const uint32_t local_mask = __ballot_sync(0xffffffffu, id >= 0 && id / layout.num_local_experts() == a.rank);
  RouteRecord* record = reinterpret_cast<RouteRecord*>(a.round.data + layout.route_table_offset()) +
                        static_cast<int64_t>(src) * layout.num_max_tokens + token;
  if (lane == 0) record->rows[k] = row;
  if (__ffs(local_mask) - 1 != k) return;
  if (lane == 0) {
    record->local_mask = local_mask;
    // The combine's send takes its work from this list (RoundState::num_pairs entries).
    const uint32_t position = atomicAdd(&a.round.state->num_pairs, 1u);
    reinterpret_cast<int32_t*>(a.round.data + layout.pair_list_offset())[position] = src * layout.num_max_tokens + token;
  }
  if (lane < a.num_topk) record->weights[lane] = ld_cg_f32(weights + lane);
}

// Copies the message at position `index` of region (local, src) into slot `slot` of the outputs.
// Warp-collective.
__device__ void unpack_message(const DispatchArgs& a, int local, int src, int index, int slot) {
  const LowLatencyLayout& layout = a.layout;
  const int lane = lane_id();
  const int num_slots = layout.num_slots();
  const int64_t row = static_cast<int64_t>(local) * num_slots + slot;
  const int entry = ld_cg_s32(reinterpret_cast<const int*>(a.round.data + layout.recv_index_offset(local, src, index)));
  const int token = entry / kMaxTopk;
  // This rank's own tokens are read where the cast left them; a peer's from where it stored them.
  const uint8_t* payload = a.round.data + (src == a.rank ? layout.token_payloads_offset() + token * layout.payload_bytes()
                                                         : layout.token_recv_offset(src, token));
  if (lane == 0) a.recv_src_info[row] = (src << kSourceRowBits) | entry;
  if (a.carry_route) record_route(a, src, token, entry % kMaxTopk, static_cast<int32_t>(row), payload);
  if (!a.use_fp8) {
    warp_copy_bytes<Load::kL2Only>(static_cast<uint8_t*>(a.recv_x) + row * layout.row_bytes(), payload,
                                   layout.row_bytes());
    return;
  }
  const int hidden = layout.hidden;
  uint8_t* out = static_cast<uint8_t*>(a.recv_x) + row * hidden;
  if (hidden % 16 == 0) {  // rows of recv_x are 16-byte aligned
    warp_copy_bytes<Load::kL2Only>(out, payload, hidden);
  } else {                 // 8-byte aligned rows
    for (int u = lane; u < hidden / 8; u += 32)
      reinterpret_cast<int2*>(out)[u] = ld_cg_v2(reinterpret_cast<const int2*>(payload) + u);
  }
  // Scales are column-major in the last two dimensions: [local][block][slot].
  const float* scales = reinterpret_cast<const float*>(payload + layout.fp8_scales_offset());
  const int num_scales = layout.num_scales();
  if (!a.use_ue8m0) {
    float* out_scales = static_cast<float*>(a.recv_scales);
    for (int b = lane; b < num_scales; b += 32)
      out_scales[(static_cast<int64_t>(local) * num_scales + b) * num_slots + slot] = ld_cg_f32(scales + b);
  } else {
    // UE8M0: the exponent byte of each (power-of-two) scale, four blocks per int32, block 4w lowest.
    const int num_words = layout.num_ue8m0_words();
    int32_t* out_words = static_cast<int32_t*>(a.recv_scales);
    for (int w = lane; w < num_words; w += 32) {
      uint32_t word = 0;
      for (int q = 0; q < 4 && 4 * w + q < num_scales; ++q)
        word |= ((__float_as_uint(ld_cg_f32(scales + 4 * w + q)) >> 23) & 0xFFu) << (8 * q);
      out_words[(static_cast<int64_t>(local) * num_words + w) * num_slots + slot] = static_cast<int32_t>(word);
    }
  }
}

// One lane: source `src` announced another RouteMode than this rank's (routes or not, fp32 or bf16
// partials). The combine could not agree on its protocol: report both modes and stop.
__device__ void report_route_mismatch(const DispatchArgs& a, int src, int expert, uint64_t word) {
  record_error(a.status, a.error_claim, kErrRouteMismatch, kOpLowLatencyDispatch, 0, a.rank, src, expert,
               static_cast<int>(threadIdx.x / 32), route_mode(a.carry_route, a.bf16_partials), signal_route_mode(word));
  asm volatile("trap;");
}

// One lane: source `src` announced its messages for another layout (T_max, hidden, experts or FP8);
// its index entries and payloads are not where this rank's layout looks. Report both tags and stop.
__device__ void report_layout_mismatch(const DispatchArgs& a, int src, int expert, uint64_t word) {
  record_error(a.status, a.error_claim, kErrLayoutMismatch, kOpLowLatencyDispatch, 0, a.rank, src, expert,
               static_cast<int>(threadIdx.x / 32), a.layout.tag(a.use_fp8), signal_layout_tag(word));
  asm volatile("trap;");
}

// The source whose region holds `slot`: the last one that begins at or before it (an empty
// region begins where the next one does, so the last such region is never empty).
__device__ __forceinline__ int region_of_slot(const int* region_begin, int num_ranks, int slot) {
  int low = 0, high = num_ranks - 1;
  while (low < high) {
    const int mid = (low + high + 1) / 2;
    if (region_begin[mid] <= slot) low = mid; else high = mid - 1;
  }
  return low;
}

// Expert-side sums: once every block has appended its pairs, the last one publishes their count for
// the combine and resets the counters. Called by every thread of every receive block.
// NOTE: fences around the counter: every block's appends happen before its increment, and the last
// block reads num_pairs after it has seen every increment.
__device__ void publish_pair_count(const DispatchArgs& a) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  RoundState* state = a.round.state;
  __threadfence();
  if (atomicAdd(&state->dispatch_blocks_done, 1u) != static_cast<uint32_t>(a.num_blocks - 1)) return;
  __threadfence();
  state->listed_pairs = ld_volatile_u32(&state->num_pairs);
  state->num_pairs = 0;
  state->dispatch_blocks_done = 0;
}

template <bool kShrink>
__device__ void dispatch_recv(const DispatchArgs& a) {
  __shared__ int region_count[kMaxRanks];
  __shared__ int region_begin[kMaxRanks];
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int num_ranks = layout.num_ranks, num_local = layout.num_local_experts();

  for (int local = blockIdx.x; local < num_local; local += a.num_blocks) {
    const int expert = a.rank * num_local + local;
    if (warp == 0) {
      const WaitSite site{a.status, a.error_claim, a.timeout_ns, kOpLowLatencyDispatch, a.rank, expert, 0};
      const int own_mode = route_mode(a.carry_route, a.bf16_partials);
      const uint32_t own_tag = layout.tag(a.use_fp8);
      int carry = 0;
      for (int first = 0; first < num_ranks; first += 32) {
        const int src = first + lane;
        int count = 0;  // a masked source (shrink mode) counts as 0 messages
        uint64_t* word = a.round.dispatch_signals + static_cast<int64_t>(local) * num_ranks + src;
        const uint64_t value = src < num_ranks ? wait_signal_unless_masked<kShrink>(word, site, src, a.rank_mask) : 0;
        if (value != 0) {
          count = static_cast<int>(signal_expected(value));
          if (signal_layout_tag(value) != own_tag) report_layout_mismatch(a, src, expert, value);
          if (signal_route_mode(value) != own_mode) report_route_mismatch(a, src, expert, value);
          // NOTE: reset once consumed. The sender adds to this word again only in the dispatch two
          // rounds later, which it issues after its combine of this round has received from this
          // rank, i.e. causally after this kernel ended.
          st_volatile_u64(word, 0);
        }
        int inclusive = count;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
          const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
          if (lane >= offset) inclusive += other;
        }
        if (src < num_ranks) {
          const int begin = carry + inclusive - count;
          region_count[src] = count;
          region_begin[src] = begin;
          a.recv_layout[static_cast<int64_t>(local) * num_ranks + src] =
              (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(count);
        }
        carry += __shfl_sync(0xffffffffu, inclusive, 31);
      }
      if (lane == 0) {
        a.recv_count[local] = carry;
        if (a.cumulative_stats != nullptr) a.cumulative_stats[local] += carry;
      }
    }
    // NOTE: warp 0's acquire loads, then this barrier, order the messages' bytes before the copies
    // (which read through L2 only: ld.cg).
    __syncthreads();
    // Slots [0, total) hold the sources' regions one after another; warps take slots in turn.
    const int total = region_begin[num_ranks - 1] + region_count[num_ranks - 1];
    for (int slot = warp; slot < total; slot += kWarps) {
      const int src = region_of_slot(region_begin, num_ranks, slot);
      unpack_message(a, local, src, slot - region_begin[src], slot);
    }
    __syncthreads();  // the tables are rewritten for the next expert
  }
  if (a.carry_route) publish_pair_count(a);
}

// kShrink: launched with a rank mask (args.rank_mask != nullptr).
template <bool kShrink>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  if (args.phases & kPhaseSend) {
    dispatch_send(args);
  }
  if (args.phases & kPhaseRecv) dispatch_recv<kShrink>(args);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  EP_HOST_ASSERT(args.num_blocks > 0, "low-latency dispatch needs at least one block");
  EP_HOST_ASSERT(args.phases != 0, "low-latency dispatch launched with no phase");
  if (args.rank_mask != nullptr) {
    dispatch_kernel<true><<<args.num_blocks, kThreads, 0, stream>>>(args);
  } else {
    dispatch_kernel<false><<<args.num_blocks, kThreads, 0, stream>>>(args);
  }
  CUDA_CHECK(cudaGetLastError());
}

int dispatch_blocks_per_sm() {
  int blocks = 0, shrink_blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, dispatch_kernel<false>, kThreads, 0));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shrink_blocks, dispatch_kernel<true>, kThreads, 0));
  return blocks < shrink_blocks ? blocks : shrink_blocks;
}

}  // namespace ep_plugin::low_latency
