// What the device tells the host: notify results and error reports, in mapped pinned memory.
// Host-safe (no device code): included by the binding and the runtime.
#pragma once

#include <cstdint>

namespace ep_plugin {

constexpr int kMaxNvlPeers = 8;
constexpr int kMaxLocalExperts = 1024;
// A dispatch's own rows may go by copy engine when this rank's tokens for itself form at most this many
// runs of consecutive tokens (one copy each, about 7 us of host time on the VMs here); notify publishes them.
constexpr int kMaxOwnRuns = 32;

enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrBadExpertId = 2,
  kErrTooManyRecvTokens = 3,
  kErrRouteMismatch = 4,  // low-latency dispatch: ranks disagree on carrying topk_weights
  kErrLayoutMismatch = 5,  // a peer's call has another layout: low-latency dispatch (T_max, hidden, experts,
                           // FP8), intranode notify (row bytes, scales, top-k, weights)
};

enum OpCode : int32_t {
  kOpNotify = 1,
  kOpDispatch = 2,
  kOpCombine = 3,
  kOpLayout = 4,
  kOpLowLatencyDispatch = 5,  // `channel` of the report is the global expert id
  kOpLowLatencyCombine = 6,   // `channel` of the report is the global expert id
  kOpInternodeNotify = 7,     // network leg of internode dispatch: count exchange (`peer` a global rank)
  kOpInternodeDispatch = 8,   // network leg of internode dispatch (`channel` a ring channel)
  kOpInternodeCombine = 9,    // network leg of internode combine (`channel` a ring channel)
};

enum WaitKind : int32_t {
  kWaitBarrier = 1,    // notify: a peer has not written its counts
  kWaitFreeSlot = 2,   // sender: the peer has not consumed the ring
  kWaitData = 3,       // receiver: the peer has not sent the next token
  kWaitDrain = 4,      // sender: the peer has not consumed the last tokens
  kWaitExpertMessages = 5,  // low-latency receiver: the peer's messages (or count) for an expert
  kWaitStagedRows = 6,      // copy-engine combine, owner: a piece of the peer's rows has not landed
  kWaitStagingFree = 7,     // copy-engine combine, sender: the peer still reads its staging area
  kWaitTokenPartials = 8,   // low-latency combine with expert-side sums: a peer's partial for a token
  kWaitPeerOutputs = 9,     // direct dispatch: the peer has not said where its outputs are (not in the call)
  kWaitPeerRows = 10,       // direct dispatch: the peer has not finished writing its rows here
};

struct DeviceStatus {
  // First error report (written once, by the thread that claims the error word in device memory).
  volatile int32_t error_code;
  volatile int32_t error_op;
  volatile int32_t error_wait_kind;
  volatile int32_t error_rank;
  volatile int32_t error_peer;
  volatile int32_t error_channel;
  volatile int32_t error_warp;
  volatile int32_t reserved;
  volatile int64_t error_expected;
  volatile int64_t error_observed;
  // Notify results for the host (non-graph dispatch); `notify_tag` is written last.
  volatile int32_t notify_tag;
  volatile int32_t num_recv_tokens;
  volatile int32_t bad_input_rank;   // -1, or the rank whose input was rejected (low latency: set by a dispatch
                                     // with a bad expert id, cleared by the host once raised)
  volatile int32_t bad_input_code;
  volatile int64_t bad_input_detail[3];
  volatile int32_t num_recv_tokens_per_rank[kMaxNvlPeers];  // rows received from each source rank
  volatile int32_t largest_block_rows;  // the most rows any rank sends any one rank: the same on every rank
  volatile int32_t num_recv_tokens_per_expert[kMaxLocalExperts];
  // The runs of consecutive tokens this rank sends to itself, published by notify after the count (its
  // send_pos scan finds them); `own_runs_tag` is written last. `num_own_runs` -1: more than kMaxOwnRuns.
  volatile int32_t own_runs_tag;
  volatile int32_t num_own_runs;
  volatile int32_t own_run_first[kMaxOwnRuns];  // first token of run i
  volatile int32_t own_run_end[kMaxOwnRuns];    // one past its last token
};

}  // namespace ep_plugin
