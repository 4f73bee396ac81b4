// Low-latency dispatch: every (token, selected expert) pair becomes one message in that expert's
// region on its rank; the receiver packs each expert's messages into its slots of recv_x.
//
// Send (block b: tokens b, b + B, ...; counts of experts e = b mod B):
//   1. the whole block casts token t once into this round's token payload (FP8 with scales, or bf16);
//   2. warp w sends the message of top-k column k = w (w + kWarps, ...) to expert e's region
//      (e, this rank) on rank e / E_local, at slot = number of earlier (token, k) entries that
//      selected e (so a region holds its tokens in (token, k) order), and adds 1 to the region's
//      signal word: straight stores + release over NVLink, put-with-signal over the network;
//   3. for its experts, the block counts this rank's messages and announces the count.
// Receive (block b: local experts b, b + B, ...):
//   warp 0 waits until the word of every source rank is complete (count announced, that many
//   messages arrived), resets it, and lays the sources out one after another (slot order: source
//   rank, then token, then k, as the reference backend defines it); then all warps copy the
//   messages into recv_x / recv_scales and record where each came from (for combine).
//
// Without a hook both phases run in one launch (every block resident: num_blocks <= SMs), so a
// block only waits after it has sent everything it owns.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../common/exception.cuh"
#include "low_latency_layout.cuh"

namespace ep_plugin::low_latency {
namespace {

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
// fp8_scales_offset(). Thread i handles channels [16 u, 16 u + 16) for u = i, i + kThreads, ...;
// the 8 threads of a 128-channel block are 8 aligned lanes of one warp and share its amax.
__device__ void cast_token_fp8(const DispatchArgs& a, int token, uint8_t* payload) {
  const LowLatencyLayout& layout = a.layout;
  const int hidden = layout.hidden;
  const int4* row = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + token * layout.row_bytes());
  float* scales = reinterpret_cast<float*>(payload + layout.fp8_scales_offset());
  const int num_units = (hidden + 15) / 16;
  // NOTE: the trip count is the same for every thread: the shuffles below need whole warps.
  for (int base = 0; base < num_units; base += kThreads) {
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

__device__ void copy_token_bf16(const DispatchArgs& a, int token, uint8_t* payload) {
  const int4* row = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + token * a.layout.row_bytes());
  int4* out = reinterpret_cast<int4*>(payload);
  const int num_units = static_cast<int>(a.layout.row_bytes() / 16);
  for (int u = threadIdx.x; u < num_units; u += kThreads) out[u] = ld_nc_v4(row + u);
}

// ---- routing ------------------------------------------------------------------------------------
// Entries of topk_idx (row-major, before `end`) equal to `expert`. Warp-collective.
__device__ __forceinline__ int count_entries(const int64_t* topk_idx, int64_t end, int64_t expert) {
  int count = 0;
  for (int64_t i = lane_id(); i < end; i += 32) count += __ldg(topk_idx + i) == expert ? 1 : 0;
  return __reduce_add_sync(0xffffffffu, count);
}

__device__ __forceinline__ bool is_expert(int64_t id, int num_experts) { return id >= 0 && id < num_experts; }

// ---- send ---------------------------------------------------------------------------------------
__device__ void report_region_full(const DispatchArgs& a, int expert, int dst, int slot) {
  if (lane_id() == 0)
    record_error(a.status, a.error_claim, kErrTooManyRecvTokens, kOpLowLatencyDispatch, 0, a.rank, dst, expert,
                 static_cast<int>(threadIdx.x / 32), a.layout.num_max_tokens, slot + 1);
}

// Sends the message (token, k) -> `expert` on `dst`. Warp-collective.
__device__ void send_message(const DispatchArgs& a, const uint8_t* payload, int token, int k, int expert,
                             int slot) {
  const LowLatencyLayout& layout = a.layout;
  const int num_local = layout.num_local_experts();
  const int dst = expert / num_local, local = expert % num_local;
  const int64_t payload_bytes = layout.used_payload_bytes(a.use_fp8);
  uint8_t* recv_area = a.round.data + layout.dispatch_recv_offset();
  uint8_t* dst_msg = recv_area + layout.recv_message_offset(local, a.rank, slot);  // symmetric address
  uint64_t* signal = a.round.dispatch_signals + static_cast<int64_t>(local) * layout.num_ranks + a.rank;
  const MessageHeader header{token, k, {0, 0}};
  uint8_t* peer_msg = static_cast<uint8_t*>(nvshmem_ptr(dst_msg, dst));
  if (peer_msg != nullptr) {
    if (lane_id() == 0) st_na_v4(reinterpret_cast<int4*>(peer_msg), *reinterpret_cast<const int4*>(&header));
    warp_copy<false>(peer_msg + kMsgHeaderBytes, payload, payload_bytes);
    publish_direct(signal, dst);
  } else {
    // A network peer: stage header + payload in symmetric memory, one staged message per (t, k).
    uint8_t* staged = a.round.data + layout.staged_messages_offset() +
                      (static_cast<int64_t>(token) * kMaxTopk + k) * layout.msg_bytes();
    if (lane_id() == 0) *reinterpret_cast<int4*>(staged) = *reinterpret_cast<const int4*>(&header);
    warp_copy<false>(staged + kMsgHeaderBytes, payload, payload_bytes);
    put_with_signal(dst_msg, staged, kMsgHeaderBytes + payload_bytes, signal, dst);
  }
}

__device__ void dispatch_send(const DispatchArgs& a) {
  const LowLatencyLayout& layout = a.layout;
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int num_experts = layout.num_experts, num_local = layout.num_local_experts();
  const int num_topk = a.num_topk;
  uint8_t* payloads = a.round.data + layout.token_payloads_offset();

  for (int token = blockIdx.x; token < a.num_tokens; token += a.num_blocks) {
    uint8_t* payload = payloads + static_cast<int64_t>(token) * layout.payload_bytes();
    if (a.use_fp8) {
      cast_token_fp8(a, token, payload);
    } else {
      copy_token_bf16(a, token, payload);
    }
    // NOTE: every thread's part of the payload is written before any warp reads it to send.
    __syncthreads();
    for (int k = warp; k < num_topk; k += kWarps) {
      const int64_t expert = __ldg(a.topk_idx + static_cast<int64_t>(token) * num_topk + k);
      if (!is_expert(expert, num_experts)) continue;
      const int slot = count_entries(a.topk_idx, static_cast<int64_t>(token) * num_topk + k, expert);
      if (slot >= layout.num_max_tokens) {  // only a token that selects one expert twice gets here
        report_region_full(a, static_cast<int>(expert), static_cast<int>(expert / num_local), slot);
        continue;
      }
      send_message(a, payload, token, k, static_cast<int>(expert), slot);
    }
  }

  // Counts: this block announces experts e = blockIdx.x (mod num_blocks), one warp each.
  const int64_t num_entries = static_cast<int64_t>(a.num_tokens) * num_topk;
  for (int expert = blockIdx.x + warp * a.num_blocks; expert < num_experts; expert += kWarps * a.num_blocks) {
    int count = count_entries(a.topk_idx, num_entries, expert);
    if (count > layout.num_max_tokens) count = layout.num_max_tokens;  // what was sent (see above)
    if (lane == 0) {
      const int dst = expert / num_local, local = expert % num_local;
      announce_count(a.round.dispatch_signals + static_cast<int64_t>(local) * layout.num_ranks + a.rank,
                     static_cast<uint32_t>(count), dst);
    }
  }
}

// ---- receive ------------------------------------------------------------------------------------
// Copies message `index` of region (local, src) into slot `slot` of the outputs. Warp-collective.
__device__ void unpack_message(const DispatchArgs& a, int local, int src, int index, int slot) {
  const LowLatencyLayout& layout = a.layout;
  const int lane = lane_id();
  const int num_slots = layout.num_slots();
  const int64_t row = static_cast<int64_t>(local) * num_slots + slot;
  const uint8_t* msg = a.round.data + layout.dispatch_recv_offset() + layout.recv_message_offset(local, src, index);
  const uint8_t* payload = msg + kMsgHeaderBytes;
  if (lane == 0) {
    const int4 raw = ld_cg_v4(reinterpret_cast<const int4*>(msg));
    const MessageHeader& header = *reinterpret_cast<const MessageHeader*>(&raw);
    a.recv_src_info[row] = (src << kSourceRowBits) | (header.src_token * kMaxTopk + header.topk_slot);
  }
  if (!a.use_fp8) {
    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.recv_x) + row * layout.row_bytes());
    const int64_t units = layout.row_bytes() / 16;
    for (int64_t u = lane; u < units; u += 32) out[u] = ld_cg_v4(reinterpret_cast<const int4*>(payload) + u);
    return;
  }
  const int hidden = layout.hidden;
  uint8_t* out = static_cast<uint8_t*>(a.recv_x) + row * hidden;
  if (hidden % 16 == 0) {  // rows of recv_x are 16-byte aligned
    for (int u = lane; u < hidden / 16; u += 32)
      reinterpret_cast<int4*>(out)[u] = ld_cg_v4(reinterpret_cast<const int4*>(payload) + u);
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
      int carry = 0;
      for (int first = 0; first < num_ranks; first += 32) {
        const int src = first + lane;
        int count = 0;
        if (src < num_ranks) {
          uint64_t* word = a.round.dispatch_signals + static_cast<int64_t>(local) * num_ranks + src;
          count = static_cast<int>(signal_expected(wait_signal(word, site, src)));
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
    for (int src = 0; src < num_ranks; ++src) {
      const int count = region_count[src], begin = region_begin[src];
      for (int i = warp; i < count; i += kWarps) unpack_message(a, local, src, i, begin + i);
    }
    __syncthreads();  // the tables are rewritten for the next expert
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  if (args.phases & kPhaseSend) dispatch_send(args);
  if (args.phases & kPhaseRecv) dispatch_recv(args);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  EP_HOST_ASSERT(args.num_blocks > 0, "low-latency dispatch needs at least one block");
  EP_HOST_ASSERT(args.phases != 0, "low-latency dispatch launched with no phase");
  dispatch_kernel<<<args.num_blocks, kThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

int dispatch_blocks_per_sm() {
  int blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, dispatch_kernel, kThreads, 0));
  return blocks;
}

}  // namespace ep_plugin::low_latency
