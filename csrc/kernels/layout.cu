// get_dispatch_layout: per-rank, per-node and per-expert counts and the token -> rank map.
#include "../common/exception.cuh"
#include "api.cuh"

namespace ep_plugin {
namespace {

constexpr int kLayoutThreads = 256;
constexpr int kMaxSharedExperts = 8192;  // per-block expert histogram in shared memory
constexpr int kMaxLayoutRanks = 1024;

// One thread per token; block-local histograms flushed with one atomic per bin.
__global__ void __launch_bounds__(kLayoutThreads) dispatch_layout_kernel(LayoutArgs args) {
  __shared__ int expert_hist[kMaxSharedExperts];
  __shared__ int rank_hist[kMaxLayoutRanks];
  __shared__ int node_hist[kMaxLayoutRanks];
  const bool experts_in_shared = args.num_experts <= kMaxSharedExperts;
  const int num_nodes = args.num_ranks / args.ranks_per_node;
  const int experts_per_rank = args.num_experts / args.num_ranks;

  for (int i = threadIdx.x; i < args.num_experts && experts_in_shared; i += blockDim.x) expert_hist[i] = 0;
  for (int i = threadIdx.x; i < args.num_ranks; i += blockDim.x) rank_hist[i] = 0;
  for (int i = threadIdx.x; i < num_nodes; i += blockDim.x) node_hist[i] = 0;
  __syncthreads();

  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token < args.num_tokens) {
    const int64_t* ids = args.topk_idx + static_cast<int64_t>(token) * args.num_topk;
    // This thread writes its token's whole row (no memset): false first, then true for each rank seen.
    bool* in_rank = args.is_token_in_rank + static_cast<int64_t>(token) * args.num_ranks;
    for (int r = 0; r < args.num_ranks; ++r) in_rank[r] = false;
    for (int k = 0; k < args.num_topk; ++k) {
      const int64_t expert = ids[k];
      // Out-of-range ids are rejected before launch (Python) and by the notify step; skip them here.
      if (expert < 0 || expert >= args.num_experts) continue;
      if (experts_in_shared) atomicAdd(&expert_hist[expert], 1);
      else atomicAdd(&args.num_tokens_per_expert[expert], 1);
      const int rank = static_cast<int>(expert / experts_per_rank);
      const int node = rank / args.ranks_per_node;
      bool rank_seen = false, node_seen = false;
      for (int j = 0; j < k; ++j) {
        const int64_t other = ids[j];
        if (other < 0 || other >= args.num_experts) continue;
        const int other_rank = static_cast<int>(other / experts_per_rank);
        rank_seen |= other_rank == rank;
        node_seen |= other_rank / args.ranks_per_node == node;
      }
      if (!rank_seen) {
        atomicAdd(&rank_hist[rank], 1);
        in_rank[rank] = true;
      }
      if (!node_seen) atomicAdd(&node_hist[node], 1);
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < args.num_experts && experts_in_shared; i += blockDim.x)
    if (expert_hist[i] != 0) atomicAdd(&args.num_tokens_per_expert[i], expert_hist[i]);
  for (int i = threadIdx.x; i < args.num_ranks; i += blockDim.x)
    if (rank_hist[i] != 0) atomicAdd(&args.num_tokens_per_rank[i], rank_hist[i]);
  if (args.num_tokens_per_node != nullptr)
    for (int i = threadIdx.x; i < num_nodes; i += blockDim.x)
      if (node_hist[i] != 0) atomicAdd(&args.num_tokens_per_node[i], node_hist[i]);
}

}  // namespace

void launch_dispatch_layout(const LayoutArgs& args, cudaStream_t stream) {
  EP_CHECK_ARG(args.num_ranks >= 1 && args.num_ranks <= kMaxLayoutRanks,
               "get_dispatch_layout supports 1 to " << kMaxLayoutRanks << " ranks, got " << args.num_ranks);
  EP_CHECK_ARG(args.ranks_per_node >= 1 && args.num_ranks % args.ranks_per_node == 0,
               "ranks_per_node (" << args.ranks_per_node << ") must divide the rank count (" << args.num_ranks << ")");
  EP_CHECK_ARG(args.num_experts > 0 && args.num_experts % args.num_ranks == 0,
               "num_experts (" << args.num_experts << ") must be a positive multiple of the rank count ("
                               << args.num_ranks << ")");
  EP_CHECK_ARG(args.num_topk >= 0 && args.num_tokens >= 0, "negative top-k or token count");
  const int num_nodes = args.num_tokens_per_node == nullptr ? 0 : args.num_ranks / args.ranks_per_node;
  CUDA_CHECK(cudaMemsetAsync(args.num_tokens_per_expert, 0,
                             sizeof(int32_t) * (args.num_experts + args.num_ranks + num_nodes), stream));
  if (args.num_tokens == 0) return;
  const int blocks = (args.num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  dispatch_layout_kernel<<<blocks, kLayoutThreads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep_plugin
