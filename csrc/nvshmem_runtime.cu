#include "nvshmem_runtime.cuh"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/binding.h"
#include "common/exception.cuh"
#include "common/host_wait.h"
#include "common/text.h"

namespace ep_plugin {
namespace {

using low_latency::LowLatencyLayout;

// Process-wide NVSHMEM state (NVSHMEM itself is a process-wide singleton).
std::mutex g_nvshmem_mutex;
int g_live_runtimes = 0;   // runtimes holding NVSHMEM initialised
int g_pe = -1;             // rank and PE count of the first initialisation
int g_num_pes = -1;

void initialise_nvshmem(int rank, int num_ranks, const std::string& unique_id) {
  EP_CHECK_ARG(unique_id.size() == sizeof(nvshmemx_uniqueid_t),
               "the NVSHMEM unique id must have " << sizeof(nvshmemx_uniqueid_t) << " bytes, got " << unique_id.size());
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  EP_HOST_ASSERT(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) == 0,
                 "nvshmemx_set_attr_uniqueid_args failed (rank " << rank << " of " << num_ranks << ")");
  // NOTE: what nvshmemx_init_attr does, minus its exit() on failure: a library reports errors.
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  const int status =
      nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (status != 0) {
    Text out;
    out << "NVSHMEM initialisation failed on rank " << rank << " of " << num_ranks << " (status " << status
        << "); run with NVSHMEM_DEBUG=INFO for details " << "[" << where(__FILE__, __LINE__) << "]";
    throw Error(out.str());
  }
}

// Initialises NVSHMEM for this process if no runtime holds it, else checks that the holder used
// the same rank and PE count. Every runtime (low-latency, internode) goes through here.
void acquire_nvshmem(int rank, int num_ranks, const std::string& unique_id, const char* who) {
  std::lock_guard<std::mutex> lock(g_nvshmem_mutex);
  if (g_live_runtimes == 0 && g_pe < 0) {
    initialise_nvshmem(rank, num_ranks, unique_id);
  } else {
    EP_CHECK_ARG(g_pe == rank && g_num_pes == num_ranks,
                 "NVSHMEM was initialised in this process as PE " << g_pe << " of " << g_num_pes
                 << "; " << who << " for rank " << rank << " of " << num_ranks
                 << " needs a new process (NVSHMEM keeps its first bootstrap)");
    if (g_live_runtimes == 0) initialise_nvshmem(rank, num_ranks, unique_id);
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks) {
    Text out;
    out << "NVSHMEM in this process is PE " << nvshmem_my_pe() << " of " << nvshmem_n_pes() << ", but the group "
        << "has this rank as " << rank << " of " << num_ranks << " (was NVSHMEM initialised by another library?)";
    throw Error(out.str());
  }
  g_pe = rank;
  g_num_pes = num_ranks;
  ++g_live_runtimes;
}

// Collective: the last runtime of the process finalises NVSHMEM.
void release_nvshmem() {
  std::lock_guard<std::mutex> lock(g_nvshmem_mutex);
  if (--g_live_runtimes == 0) nvshmem_finalize();
}

const char* op_name(int op) {
  switch (op) {
    case kOpLowLatencyDispatch: return "low_latency_dispatch";
    case kOpLowLatencyCombine: return "low_latency_combine";
    case kOpInternodeNotify: return "the notify step of internode dispatch";
    case kOpInternodeDispatch: return "internode dispatch (network leg)";
    case kOpInternodeCombine: return "internode combine (network leg)";
    default: return "a low-latency kernel";
  }
}

// The partials a combine sends after a dispatch of this RouteMode (as in kErrRouteMismatch reports).
const char* partials_name(int mode) { return mode == low_latency::kBf16Partials ? "bf16" : "fp32"; }

}  // namespace

void SymmetricBuffer::open(int rank, int num_ranks, int64_t bytes, int64_t header_bytes,
                           const std::string& unique_id, const char* who) {
  acquire_nvshmem(rank, num_ranks, unique_id, who);
  buffer = nvshmem_malloc(static_cast<size_t>(bytes));  // collective: every PE allocates the same size
  if (buffer == nullptr) {
    release_nvshmem();
    Text out;
    out << "nvshmem_malloc(" << bytes << ") failed on rank " << rank << " for " << who
        << ": the NVSHMEM symmetric heap is too small (set NVSHMEM_SYMMETRIC_SIZE before the first NVSHMEM "
        << "Buffer of the process)";
    throw Error(out.str());
  }
  // NOTE: counters and signal words must be zero on every PE before any peer can add to them:
  // zero, wait for the device, then barrier.
  CUDA_CHECK(cudaMemset(buffer, 0, header_bytes));
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_host), sizeof(DeviceStatus), cudaHostAllocMapped));
  std::memset(static_cast<void*>(status_host), 0, sizeof(DeviceStatus));
  status_host->bad_input_rank = -1;
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device), status_host, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
}

void SymmetricBuffer::close(bool collective) {
  cudaDeviceSynchronize();
  if (collective) {
    nvshmem_barrier_all();  // no PE frees while a peer could still write into its buffer
    nvshmem_free(buffer);
    release_nvshmem();
  }
  // Not collective: nvshmem_free and nvshmem_finalize are collectives; the memory stays allocated.
  buffer = nullptr;
  cudaFreeHost(static_cast<void*>(status_host));
  status_host = status_device = nullptr;
}

std::vector<bool> SymmetricBuffer::direct_peers(int num_ranks) const {
  std::vector<bool> direct(num_ranks);
  for (int pe = 0; pe < num_ranks; ++pe) direct[pe] = nvshmem_ptr(buffer, pe) != nullptr;
  return direct;
}

std::string LowLatencyRuntime::create_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  EP_HOST_ASSERT(nvshmemx_get_uniqueid(&id) == 0, "nvshmemx_get_uniqueid failed");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

LowLatencyRuntime::LowLatencyRuntime(int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s,
                                     const std::string& unique_id)
    : rank_(rank), num_ranks_(num_ranks), num_rdma_bytes_(num_rdma_bytes), timeout_s_(timeout_s) {
  EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= low_latency::kMaxRanks,
               "low-latency mode supports 1 to " << low_latency::kMaxRanks << " ranks, got " << num_ranks);
  EP_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank " << rank << " out of range for " << num_ranks << " ranks");
  EP_CHECK_ARG(num_rdma_bytes > low_latency::kHeaderBytes,
               "num_rdma_bytes must exceed the low-latency signal header of " << low_latency::kHeaderBytes
                                                                              << " bytes (got " << num_rdma_bytes
                                                                              << "); see get_low_latency_rdma_size_hint");
  EP_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
  timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  CUDA_CHECK(cudaGetDevice(&device_));
  int num_sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device_));
  num_blocks_ = num_sms;  // one resident block per SM (the fused send + receive needs all of them)
  // NOTE: with fewer than one block per SM, a fused launch of num_sms blocks could never have every
  // block resident and would end in a device timeout; say so here instead.
  const int dispatch_per_sm = low_latency::dispatch_blocks_per_sm();
  const int combine_per_sm = low_latency::combine_blocks_per_sm();
  EP_HOST_ASSERT(dispatch_per_sm >= 1 && combine_per_sm >= 1,
                 "low-latency kernels of " << low_latency::kThreads << " threads do not fit on an SM (blocks per SM: "
                                           << dispatch_per_sm << " dispatch, " << combine_per_sm << " combine)");

  memory_.open(rank, num_ranks, num_rdma_bytes, low_latency::kHeaderBytes, unique_id, "a low-latency Buffer");
  const std::vector<bool> direct = memory_.direct_peers(num_ranks);
  every_peer_direct_ = std::all_of(direct.begin(), direct.end(), [](bool d) { return d; });
  watchdog_ = std::thread([this] { watch_for_device_errors(); });
}

LowLatencyRuntime::~LowLatencyRuntime() {
  try {
    destroy(false);
  } catch (...) {  // NOTE: never throw from a destructor
  }
}

void LowLatencyRuntime::watch_for_device_errors() {
  while (!stop_watchdog_.load()) {
    if (memory_.status_host->error_code != kErrNone) {
      std::fprintf(stderr, "ep_plugin: a low-latency kernel stopped on rank %d: %s\n", rank_,
                   describe_device_error().c_str());
      std::fflush(stderr);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void LowLatencyRuntime::destroy(bool collective) {
  if (memory_.status_host == nullptr) return;
  stop_watchdog_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  memory_.close(collective);
}

void LowLatencyRuntime::require_alive() const {
  EP_HOST_ASSERT(memory_.is_open(), "the low-latency runtime has been destroyed");
  check_device_error();
}

std::vector<bool> LowLatencyRuntime::direct_peers() const {
  require_alive();
  return memory_.direct_peers(num_ranks_);
}

void LowLatencyRuntime::check_layout(const LowLatencyLayout& layout, const char* op) const {
  EP_CHECK_ARG(layout.num_ranks == num_ranks_,
               op << ": the layout is for " << layout.num_ranks << " ranks, the buffer for " << num_ranks_);
  EP_CHECK_ARG(layout.num_max_tokens >= 1 && layout.num_max_tokens <= low_latency::kMaxTokens,
               op << ": num_max_dispatch_tokens_per_rank must be in [1, " << low_latency::kMaxTokens << "], got "
                  << layout.num_max_tokens);
  EP_CHECK_ARG(layout.hidden > 0 && layout.hidden % 8 == 0,
               op << ": hidden must be a positive multiple of 8 (16-byte bf16 rows), got " << layout.hidden);
  EP_CHECK_ARG(layout.num_experts > 0 && layout.num_experts % num_ranks_ == 0 &&
                   layout.num_experts <= low_latency::kMaxExperts,
               op << ": num_experts must be a multiple of " << num_ranks_ << " and at most "
                  << low_latency::kMaxExperts << ", got " << layout.num_experts);
  const int64_t needed = layout.total_bytes();
  EP_CHECK_ARG(layout.round_bytes() <= low_latency::round_stride(num_rdma_bytes_),
               op << " needs num_rdma_bytes >= " << needed << " for T_max=" << layout.num_max_tokens << ", hidden="
                  << layout.hidden << ", num_experts=" << layout.num_experts << ", but the buffer has "
                  << num_rdma_bytes_ << " (Buffer.get_low_latency_rdma_size_hint)");
}

void LowLatencyRuntime::raise_bad_input() {
  DeviceStatus& s = *memory_.status_host;
  if (s.bad_input_rank < 0) return;
  Text out;
  out << "rank " << s.bad_input_rank << ": topk_idx[" << s.bad_input_detail[0] << ", " << s.bad_input_detail[1]
      << "] = " << s.bad_input_detail[2] << " in its previous low_latency_dispatch is not an expert id (expected -1 "
      << "or a value in [0, num_experts)); that dispatch and its combine treated it as -1 (the token skipped that "
      << "expert). This low_latency_dispatch sent nothing; the Buffer stays usable";
  s.bad_input_rank = -1;  // raised once: the next dispatch runs
  throw InvalidArgument(out.str());
}

void LowLatencyRuntime::dispatch(low_latency::DispatchArgs args, int parity, cudaStream_t stream) {
  require_alive();
  if (args.phases & low_latency::kPhaseSend) raise_bad_input();
  args.layout.num_ranks = num_ranks_;
  check_layout(args.layout, "low_latency_dispatch");
  const bool send = (args.phases & low_latency::kPhaseSend) != 0, tokens = send && args.num_tokens > 0;
  EP_CHECK_ARG(args.phases != 0 && (args.phases & ~(low_latency::kPhaseSend | low_latency::kPhaseRecv)) == 0,
               "low_latency_dispatch: phases must be PHASE_SEND, PHASE_RECV or both, got " << args.phases);
  check_pointer(args.x, "x", tokens, 16);
  check_pointer(args.topk_idx, "topk_idx", tokens);
  check_pointer(args.recv_x, "recv_x", true, 16);
  check_pointer(args.recv_scales, "recv_scales", args.use_fp8, 4);
  check_pointer(args.recv_count, "recv_count");
  check_pointer(args.recv_src_info, "recv_src_info");
  check_pointer(args.recv_layout, "recv_layout");
  check_pointer(args.cumulative_stats, "cumulative_local_expert_recv_stats", false);
  check_pointer(args.topk_weights, "topk_weights", args.carry_route && tokens);
  check_pointer(args.rank_mask, "rank_mask", false);
  EP_CHECK_ARG(parity == 0 || parity == 1, "parity must be 0 or 1");
  EP_CHECK_ARG(args.num_tokens >= 0 && args.num_tokens <= args.layout.num_max_tokens,
               "x has " << args.num_tokens << " tokens, more than num_max_dispatch_tokens_per_rank = "
                        << args.layout.num_max_tokens);
  EP_CHECK_ARG(args.num_topk >= 1 && args.num_topk <= low_latency::kMaxTopk,
               "top-k must be in [1, " << low_latency::kMaxTopk << "], got " << args.num_topk);
  EP_CHECK_ARG(!args.use_ue8m0 || (args.use_fp8 && args.round_scale), "use_ue8m0 needs use_fp8 and round_scale");
  EP_CHECK_ARG(!args.carry_route || expert_sums_allowed(args.layout),
               "low_latency_dispatch: topk_weights (expert-side sums) needs every peer reachable by NVLink, at most "
                   << low_latency::kMaxExpertSumRanks << " ranks and T_max * ranks <= " << low_latency::kMaxExperts);
  args.round = low_latency::round_pointers(memory_.buffer, num_rdma_bytes_, parity);
  args.rank = rank_;
  args.num_blocks = num_blocks_;
  args.status = memory_.status_device;
  args.error_claim = &low_latency::round_pointers(memory_.buffer, num_rdma_bytes_, 0).state->error_claim;
  args.timeout_ns = timeout_ns_;
  low_latency::launch_dispatch(args, stream);
}

void LowLatencyRuntime::combine(low_latency::CombineArgs args, int parity, cudaStream_t stream) {
  require_alive();
  args.layout.num_ranks = num_ranks_;
  check_layout(args.layout, "low_latency_combine");
  const bool recv = (args.phases & low_latency::kPhaseRecv) != 0, tokens = recv && args.num_tokens > 0;
  EP_CHECK_ARG(args.phases != 0 && (args.phases & ~(low_latency::kPhaseSend | low_latency::kPhaseRecv)) == 0,
               "low_latency_combine: phases must be PHASE_SEND, PHASE_RECV or both, got " << args.phases);
  check_pointer(args.x, "x", true, 16);
  check_pointer(args.recv_src_info, "handle.recv_src_info");
  check_pointer(args.recv_layout, "handle.recv_layout");
  check_pointer(args.topk_idx, "topk_idx", tokens);
  check_pointer(args.topk_weights, "topk_weights", tokens);
  check_pointer(args.out, "out", tokens, 16);
  check_pointer(args.rank_mask, "rank_mask", false);
  EP_CHECK_ARG(parity == 0 || parity == 1, "parity must be 0 or 1");
  EP_CHECK_ARG(args.num_tokens >= 0 && args.num_tokens <= args.layout.num_max_tokens,
               "combine for " << args.num_tokens << " tokens, more than num_max_dispatch_tokens_per_rank = "
                              << args.layout.num_max_tokens);
  EP_CHECK_ARG(args.num_topk >= 1 && args.num_topk <= low_latency::kMaxTopk,
               "top-k must be in [1, " << low_latency::kMaxTopk << "], got " << args.num_topk);
  args.round = low_latency::round_pointers(memory_.buffer, num_rdma_bytes_, parity);
  args.rank = rank_;
  args.num_blocks = num_blocks_;
  args.status = memory_.status_device;
  args.error_claim = &low_latency::round_pointers(memory_.buffer, num_rdma_bytes_, 0).state->error_claim;
  args.timeout_ns = timeout_ns_;
  args.x_is_staging = reinterpret_cast<uintptr_t>(args.x) == combine_buffer_address(parity, args.layout);
  EP_CHECK_ARG(!args.expert_sums || expert_sums_allowed(args.layout),
               "low_latency_combine: expert-side sums need every peer reachable by NVLink");
  low_latency::launch_combine(args, stream);
}

bool LowLatencyRuntime::expert_sums_allowed(const LowLatencyLayout& layout) const {
  return every_peer_direct_ && layout.admits_expert_sums();
}

bool LowLatencyRuntime::supports_expert_sums(int num_max_tokens, int hidden, int num_experts) const {
  return expert_sums_allowed(LowLatencyLayout{num_max_tokens, hidden, num_ranks_, num_experts});
}

uintptr_t LowLatencyRuntime::combine_buffer_address(int parity, const LowLatencyLayout& layout) const {
  require_alive();
  check_layout(layout, "get_next_low_latency_combine_buffer");
  EP_CHECK_ARG(parity == 0 || parity == 1, "parity must be 0 or 1");
  const low_latency::RoundPointers round = low_latency::round_pointers(memory_.buffer, num_rdma_bytes_, parity);
  return reinterpret_cast<uintptr_t>(round.data + layout.dispatch_recv_offset());
}

void LowLatencyRuntime::clean(cudaStream_t stream) {
  require_alive();
  CUDA_CHECK(cudaMemsetAsync(memory_.buffer, 0, low_latency::kHeaderBytes, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::string LowLatencyRuntime::describe_device_error() const {
  const DeviceStatus& s = *memory_.status_host;
  Text out;
  if (s.error_code == kErrTimeout && s.error_wait_kind == kWaitTokenPartials) {
    out << "timeout in " << op_name(s.error_op) << " after " << timeout_s_ << " s: rank " << s.error_rank
        << " waited for peer " << s.error_peer << "'s partial sum for token " << s.error_channel << " (warp "
        << s.error_warp << "); pieces expected " << s.error_expected << ", arrived " << s.error_observed
        << ". Every rank must make the same sequence of low-latency calls, and call each receive hook.";
  } else if (s.error_code == kErrRouteMismatch && (s.error_observed != 0) != (s.error_expected != 0)) {
    out << "rank " << s.error_rank << " got a dispatch from peer " << s.error_peer << " that "
        << (s.error_observed ? "carried" : "did not carry") << " topk_weights while its own "
        << (s.error_expected ? "did" : "did not") << ": every rank must pass topk_weights to "
        << "low_latency_dispatch, or none";
  } else if (s.error_code == kErrRouteMismatch) {
    out << "rank " << s.error_rank << " got a dispatch from peer " << s.error_peer << " whose combine sends "
        << partials_name(s.error_observed) << " partials while its own sends " << partials_name(s.error_expected)
        << ": low_latency.expert_sums_partials must be the same on every rank";
  } else if (s.error_code == kErrLayoutMismatch) {
    out << "rank " << s.error_rank << " got a dispatch from peer " << s.error_peer << " (expert " << s.error_channel
        << ") laid out for another call (layout tag " << s.error_observed << " against its own " << s.error_expected
        << "): num_max_dispatch_tokens_per_rank, the hidden size, num_experts and "
        << "use_fp8 must be the same on every rank, and every rank must make the same sequence of low-latency calls";
  } else if (s.error_code == kErrTimeout) {
    out << "timeout in " << op_name(s.error_op) << " after " << timeout_s_ << " s: rank " << s.error_rank
        << " waited for peer " << s.error_peer << " (expert " << s.error_channel << ", warp " << s.error_warp
        << ") for its messages of that expert; announced count " << s.error_expected << " (-1: none yet), arrived "
        << s.error_observed << ". Every rank must make the same sequence of low-latency calls, and call each "
        << "receive hook.";
  } else if (s.error_code == kErrTooManyRecvTokens) {
    out << "rank " << s.error_rank << " sent more than num_max_dispatch_tokens_per_rank = " << s.error_expected
        << " messages to expert " << s.error_channel << " (a token selected one expert twice?); the extra messages "
        << "were dropped";
  } else {
    out << "device error code " << s.error_code;
  }
  return out.str();
}

bool LowLatencyRuntime::nothing_to_report() const {
  return memory_.is_open() && memory_.status_host->error_code == kErrNone && memory_.status_host->bad_input_rank < 0;
}

void LowLatencyRuntime::check_device_error() const {
  if (memory_.status_host != nullptr && memory_.status_host->error_code != kErrNone)
    throw Error("ep_plugin: a low-latency kernel stopped on rank " + std::to_string(rank_) + ": " +
                describe_device_error());
}

// ---- InternodeRuntime ------------------------------------------------------------------------------
InternodeRuntime::InternodeRuntime(int rank, int num_ranks, int ranks_per_node, int64_t num_rdma_bytes,
                                   double timeout_s, const std::string& unique_id, bool force_puts)
    : puts_only_(force_puts), num_ranks_(num_ranks), num_rdma_bytes_(num_rdma_bytes), timeout_s_(timeout_s) {
  EP_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank " << rank << " out of range for " << num_ranks << " ranks");
  EP_CHECK_ARG(ranks_per_node >= 1 && num_ranks % ranks_per_node == 0,
               "ranks_per_node (" << ranks_per_node << ") must divide the " << num_ranks << " ranks of the group");
  EP_CHECK_ARG(num_ranks / ranks_per_node <= internode::kMaxNodes,
               "internode mode supports at most " << internode::kMaxNodes << " nodes, got "
                                                  << num_ranks / ranks_per_node);
  EP_CHECK_ARG(num_rdma_bytes > internode::kHeaderBytes,
               "num_rdma_bytes must exceed the internode header of " << internode::kHeaderBytes << " bytes (got "
                                                                     << num_rdma_bytes
                                                                     << "); see Config.get_rdma_buffer_size_hint");
  EP_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
  timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  place_.rank = rank;
  place_.ranks_per_node = ranks_per_node;
  place_.node = rank / ranks_per_node;
  place_.local = rank % ranks_per_node;
  place_.num_nodes = num_ranks / ranks_per_node;

  memory_.open(rank, num_ranks, num_rdma_bytes, internode::kHeaderBytes, unique_id, "an internode Buffer");
}

InternodeRuntime::~InternodeRuntime() {
  try {
    destroy(false);
  } catch (...) {  // NOTE: never throw from a destructor
  }
}

void InternodeRuntime::destroy(bool collective) {
  if (memory_.status_host == nullptr) return;
  memory_.close(collective);
}

void InternodeRuntime::require_alive() const {
  EP_HOST_ASSERT(memory_.is_open(), "the internode runtime has been destroyed");
  check_device_error();
}

std::vector<bool> InternodeRuntime::direct_peers() const {
  require_alive();
  return memory_.direct_peers(num_ranks_);
}

internode::Common InternodeRuntime::common(int kind) const {
  internode::Common c{};
  c.ptr = internode::make_pointers(memory_.buffer, num_rdma_bytes_, kind);
  c.place = place_;
  c.status = memory_.status_device;
  c.error_claim = &c.ptr.state->error_claim;
  c.timeout_ns = timeout_ns_;
  c.puts_only = puts_only_;
  return c;
}

void InternodeRuntime::check_ring_use(const internode::InternodeLayout& layout, int num_blocks, int send_chunk) const {
  EP_CHECK_ARG(num_blocks >= 1 && layout.num_channels % num_blocks == 0,
               "num_blocks must divide num_channels (" << layout.num_channels << "), got " << num_blocks);
  EP_CHECK_ARG(send_chunk >= 1, "num_max_rdma_chunked_send_tokens must be positive, got " << send_chunk);
}

void InternodeRuntime::check_layout(const internode::InternodeLayout& layout, const char* op) const {
  EP_CHECK_ARG(layout.num_nodes == place_.num_nodes,
               op << ": the layout is for " << layout.num_nodes << " nodes, the buffer for " << place_.num_nodes);
  EP_CHECK_ARG(layout.num_channels >= 1 && layout.num_channels <= internode::kMaxChannels,
               op << ": channels must be in [1, " << internode::kMaxChannels << "], got " << layout.num_channels);
  EP_CHECK_ARG(layout.ring_slots >= 1, op << ": num_max_rdma_chunked_recv_tokens must be positive");
  EP_CHECK_ARG(layout.slot_bytes > 0 && layout.slot_bytes % 16 == 0, op << ": slot bytes must be a multiple of 16");
  EP_CHECK_ARG(layout.fits(num_rdma_bytes_),
               op << " needs num_rdma_bytes >= " << layout.total_bytes() << " (" << layout.num_channels
                  << " channels, " << layout.num_nodes << " nodes, " << layout.ring_slots << " ring slots of "
                  << layout.slot_bytes << " bytes), but the buffer has " << num_rdma_bytes_
                  << " (Config.get_rdma_buffer_size_hint with ranks_per_node)");
}

void InternodeRuntime::notify(internode::NotifyArgs args, cudaStream_t stream) {
  require_alive();
  EP_CHECK_ARG(args.num_tokens >= 0, "num_tokens must be non-negative");
  EP_CHECK_ARG(args.host_tag >= 0 && args.capacity >= 0, "bad notify tag or capacity");
  check_pointer(args.is_token_in_node, "is_token_in_node", args.num_tokens > 0);
  check_pointer(args.send_counts, "send_counts");
  check_pointer(args.recv_offsets, "recv_offsets");
  check_pointer(args.num_recv, "num_recv");
  args.c = common(internode::kKindDispatch);
  memory_.status_host->bad_input_rank = -1;  // the previous notify has finished (its result was awaited)
  internode::launch_notify(args, stream);
}

int InternodeRuntime::wait_notify(int tag, cudaStream_t stream) {
  EP_HOST_ASSERT(tag > 0, "notify tags are positive");
  // The device gives up after timeout_s; the host allows a little more so the device's report wins.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_ + 5.0);
  int spins = 0;
  while (memory_.status_host->notify_tag != tag) {
    check_device_error();
    if (++spins % 1024 == 0) {
      const cudaError_t state = cudaStreamQuery(stream);
      if (state != cudaSuccess && state != cudaErrorNotReady) {
        check_device_error();
        throw Error(std::string("ep_plugin: internode dispatch failed on rank ") + std::to_string(place_.rank) +
                    ": " + cudaGetErrorName(state) + " (" + cudaGetErrorString(state) + ")");
      }
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline) {
        Text out;
        out << "rank " << place_.rank << ": the notify step of internode dispatch did not finish within "
            << timeout_s_ << " s (a peer never reached the same dispatch call?)";
        throw TimeoutError(out.str());
      }
      yield_if_waiting_long(start, now);
    }
  }
  const int bad_rank = memory_.status_host->bad_input_rank;
  if (bad_rank >= 0) {
    Text out;
    out << "internode dispatch rejected on rank " << place_.rank << ": rank " << bad_rank
        << " dispatches rows of a different layout (x, x_scales, topk_idx and topk_weights must have the same "
        << "widths, dtypes and presence on every rank, and every rank the same config.num_sms); no data was sent";
    throw InvalidArgument(out.str());
  }
  return memory_.status_host->num_recv_tokens;
}

void InternodeRuntime::dispatch(internode::DispatchArgs args, cudaStream_t stream) {
  require_alive();
  args.layout.num_nodes = place_.num_nodes;
  check_layout(args.layout, "internode dispatch");
  check_ring_use(args.layout, args.num_blocks, args.send_chunk);
  const internode::DispatchSlot& slot = args.slot;
  EP_CHECK_ARG(slot.row_bytes > 0 && slot.row_bytes % 16 == 0,
               "rows must be a positive multiple of 16 bytes, got " << slot.row_bytes);
  EP_CHECK_ARG(slot.num_scales >= 0, "num_scales must be non-negative");
  EP_CHECK_ARG(slot.num_topk >= 0 && slot.num_topk <= internode::kMaxTopk,
               "top-k must be in [0, " << internode::kMaxTopk << "], got " << slot.num_topk);
  EP_CHECK_ARG(slot.bytes() <= args.layout.slot_bytes, "slot_bytes " << args.layout.slot_bytes << " < " << slot.bytes());
  EP_CHECK_ARG(args.capacity >= 0, "capacity must be non-negative");
  const bool send = args.num_tokens > 0, recv = args.capacity > 0;
  check_pointer(args.x, "x", send, 16);
  check_pointer(args.x_scales, "x_scales", send && slot.num_scales > 0);
  check_pointer(args.topk_idx, "topk_idx", send && slot.num_topk > 0);
  check_pointer(args.topk_weights, "topk_weights", send && slot.num_topk > 0 && slot.has_weights);
  check_pointer(args.is_token_in_node, "is_token_in_node", send);
  check_pointer(args.send_pos, "send_pos", false);
  check_pointer(args.recv_offsets, "recv_offsets");
  check_pointer(args.recv_x, "recv_x", recv, 16);
  check_pointer(args.recv_x_scales, "recv_x_scales", recv && slot.num_scales > 0);
  check_pointer(args.recv_topk_idx, "recv_topk_idx", false);
  check_pointer(args.recv_topk_weights, "recv_topk_weights", false);
  check_pointer(args.recv_src_idx, "recv_src_idx", false);
  args.c = common(internode::kKindDispatch);
  internode::launch_dispatch(args, stream);
}

void InternodeRuntime::combine(internode::CombineArgs args, cudaStream_t stream) {
  require_alive();
  args.layout.num_nodes = place_.num_nodes;
  check_layout(args.layout, "internode combine");
  check_ring_use(args.layout, args.num_blocks, args.send_chunk);
  const int hidden = args.slot.hidden, num_topk = args.slot.num_topk;
  EP_CHECK_ARG(hidden > 0 && hidden % 8 == 0, "hidden must be a positive multiple of 8, got " << hidden);
  EP_CHECK_ARG(num_topk >= 0 && num_topk <= internode::kMaxTopk, "top-k must be in [0, " << internode::kMaxTopk << "]");
  EP_CHECK_ARG(args.slot.bytes() <= args.layout.slot_bytes,
               "slot_bytes " << args.layout.slot_bytes << " < " << args.slot.bytes());
  const bool forward = args.capacity > 0, tokens = args.num_tokens > 0;
  check_pointer(args.partial_x, "partial_x", forward, 16);
  check_pointer(args.partial_weights, "partial_weights", forward && num_topk > 0);
  check_pointer(args.recv_offsets, "handle.recv_offsets");
  check_pointer(args.is_token_in_node, "handle.is_token_in_node", tokens);
  check_pointer(args.send_pos, "handle.send_pos", tokens);
  check_pointer(args.send_counts, "handle.send_counts");
  check_pointer(args.bias_0, "bias_0", false, 16);
  check_pointer(args.bias_1, "bias_1", false, 16);
  check_pointer(args.combined_x, "combined_x", tokens, 16);
  check_pointer(args.combined_weights, "combined_topk_weights", false);
  args.c = common(internode::kKindCombine);
  internode::launch_combine(args, stream);
}

void InternodeRuntime::barrier(cudaStream_t stream) {
  require_alive();
  nvshmemx_barrier_all_on_stream(stream);
}

std::string InternodeRuntime::describe_device_error() const {
  const DeviceStatus& s = *memory_.status_host;
  Text out;
  if (s.error_code == kErrTimeout) {
    const char* what = s.error_wait_kind == kWaitBarrier    ? "its token counts"
                       : s.error_wait_kind == kWaitFreeSlot ? "a free ring slot (the peer did not consume)"
                       : s.error_wait_kind == kWaitData     ? "the next row"
                                                            : "progress";
    out << "timeout in " << op_name(s.error_op) << " after " << timeout_s_ << " s: rank " << s.error_rank
        << " waited for peer " << s.error_peer << " (channel " << s.error_channel << ", warp " << s.error_warp
        << ") for " << what << "; expected counter " << s.error_expected << ", observed " << s.error_observed
        << ". Every rank must make the same sequence of dispatch/combine calls with the same configs.";
  } else if (s.error_code == kErrTooManyRecvTokens) {
    out << "rank " << s.error_rank << " receives " << s.error_observed << " rows over the network but only "
        << s.error_expected << " fit (num_worst_tokens * ranks_per_node); rows past that were dropped";
  } else {
    out << "device error code " << s.error_code;
  }
  return out.str();
}

void InternodeRuntime::check_device_error() const {
  if (memory_.status_host != nullptr && memory_.status_host->error_code != kErrNone)
    throw Error("ep_plugin: an internode kernel stopped on rank " + std::to_string(place_.rank) + ": " +
                describe_device_error());
}

}  // namespace ep_plugin
