// get_dispatch_layout: per-rank, per-node and per-expert counts and the token -> rank map.
//
// One launch and no prior zeroing: every output entry is written by exactly one block. Each cluster of
// blocks owns a range of one kind of bins and reads every token's ids, so no count is shared between
// clusters:
//   [0, expert_blocks)            experts, LayoutPlan::experts_per_block each: num_tokens_per_expert
//   [.., + rank_blocks)           kGroupsPerBlock ranks each: num_tokens_per_rank and their columns
//                                 of is_token_in_rank
//   [.., + node_blocks)           kGroupsPerBlock nodes each: num_tokens_per_node (when counted)
// The blocks of a cluster (sm_90 on; one block before) split its tokens, each counting into its own
// shared bins, and sum each other's bins through distributed shared memory at the end: a token per
// thread in one pass up to LayoutPlan::cluster_blocks * kLayoutThreads tokens.
#include <algorithm>

#include <cooperative_groups.h>

#include "../common/exception.cuh"
#include "api.cuh"

namespace ep_plugin {
namespace {

constexpr int kLayoutThreads = 1024;  // a token per thread: more threads, fewer passes over the ids
constexpr int kGroupsPerBlock = 32;         // ranks or nodes per block: one bit each in a token's mask
constexpr int kMinExpertsPerBlock = 64;
constexpr int kMaxExpertsPerBlock = 4096;   // the block's expert histogram in shared memory
constexpr int kTargetExpertBlocks = 64;     // more experts per block beyond this (every block reads all ids)
constexpr int kIdsPerLoad = 8;              // a token's ids loaded together, then visited
constexpr int kMaxLayoutRanks = 1024;
constexpr int kMaxClusterBlocks = 8;        // the portable cluster size

struct LayoutPlan {
  int experts_per_block, expert_blocks, rank_blocks, node_blocks;
  int cluster_blocks;  // blocks per cluster: 1 without clusters, or where one block's pass covers the tokens

  static LayoutPlan of(const LayoutArgs& args, bool clusters) {
    LayoutPlan plan{};
    const int passes = (args.num_tokens + kLayoutThreads - 1) / kLayoutThreads;
    plan.cluster_blocks = clusters ? std::clamp(passes, 1, kMaxClusterBlocks) : 1;
    const int wanted = (args.num_experts + kTargetExpertBlocks - 1) / kTargetExpertBlocks;
    plan.experts_per_block = std::min(kMaxExpertsPerBlock, std::max(kMinExpertsPerBlock, wanted));
    plan.expert_blocks = (args.num_experts + plan.experts_per_block - 1) / plan.experts_per_block;
    plan.rank_blocks = (args.num_ranks + kGroupsPerBlock - 1) / kGroupsPerBlock;
    const int num_nodes = args.num_tokens_per_node == nullptr ? 0 : args.num_ranks / args.ranks_per_node;
    plan.node_blocks = (num_nodes + kGroupsPerBlock - 1) / kGroupsPerBlock;
    return plan;
  }
  int clusters() const { return expert_blocks + rank_blocks + node_blocks; }
};

// Calls visit(id) for each of the token's num_topk ids (-1 and other ids outside [0, E) included).
template <typename Visit>
__device__ __forceinline__ void for_each_id(const int64_t* ids, int num_topk, Visit&& visit) {
  for (int k0 = 0; k0 < num_topk; k0 += kIdsPerLoad) {
    int64_t chunk[kIdsPerLoad];
#pragma unroll
    for (int i = 0; i < kIdsPerLoad; ++i) chunk[i] = k0 + i < num_topk ? __ldg(ids + k0 + i) : -1;
#pragma unroll
    for (int i = 0; i < kIdsPerLoad; ++i) visit(chunk[i]);
  }
}

// This block's share of its cluster's items (tokens, then bins): those i with i / kLayoutThreads % count == rank.
struct ClusterShare {
  int count, rank;

  __device__ static ClusterShare mine(const LayoutPlan& plan) {
    return {plan.cluster_blocks, static_cast<int>(blockIdx.x) % plan.cluster_blocks};
  }
  __device__ int first() const { return rank * kLayoutThreads; }
  __device__ int stride() const { return count * kLayoutThreads; }
};

// Every block of the cluster has reached this point, and its shared-memory writes before it are visible
// to the cluster.
__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// The cluster's sum of bins[i] over its blocks (each block's own shared `bins`).
// NOTE: kernels built for an older architecture run with clusters of one block (kernel_has_clusters).
__device__ __forceinline__ int cluster_sum(int* bins, int i, const ClusterShare& share) {
#if __CUDA_ARCH__ >= 900
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  int sum = 0;
  for (int block = 0; block < share.count; ++block) sum += cluster.map_shared_rank(bins, block)[i];
  return sum;
#else
  return bins[i];
#endif
}

// num_tokens_per_expert[first, first + count): ids of those experts over all tokens (a token's
// repeated id counts each time). Out-of-range ids are skipped.
__device__ void count_experts(const LayoutArgs& args, const ClusterShare& share, int first, int count, int* bins) {
  const int end = min(first + count, args.num_experts);
  for (int i = threadIdx.x; i < end - first; i += blockDim.x) bins[i] = 0;
  __syncthreads();
  for (int t = share.first() + threadIdx.x; t < args.num_tokens; t += share.stride())
    for_each_id(args.topk_idx + static_cast<int64_t>(t) * args.num_topk, args.num_topk, [&](int64_t id) {
      if (id >= first && id < end) atomicAdd(&bins[id - first], 1);
    });
  cluster_barrier();
  // Each block writes a share of the range's counts.
  for (int i = share.first() + threadIdx.x; i < end - first; i += share.stride())
    args.num_tokens_per_expert[first + i] = cluster_sum(bins, i, share);
  cluster_barrier();  // NOTE: no block leaves while its peers read its bins
}

// out[first, first + kGroupsPerBlock) (clipped to num_groups): tokens with an id in each group, a group
// being experts_per_group consecutive experts (a rank's or a node's); out nullptr: not written. kWriteRows:
// the groups are ranks, and each token's entries of is_token_in_rank for them are written too.
template <bool kWriteRows>
__device__ void count_groups(const LayoutArgs& args, const ClusterShare& share, int first, int num_groups,
                             int experts_per_group, int32_t* out, int* bins) {
  const int count = min(kGroupsPerBlock, num_groups - first);
  const int64_t first_expert = static_cast<int64_t>(first) * experts_per_group;
  const int64_t end_expert = first_expert + static_cast<int64_t>(count) * experts_per_group;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < kGroupsPerBlock) bins[threadIdx.x] = 0;
  int lane_group_tokens = 0;  // lane j: tokens of this warp's in group first + j
  // NOTE: whole warps iterate together (the ballots below), lanes past the last token with no hit.
  for (int warp_first = share.first() + threadIdx.x - lane; warp_first < args.num_tokens;
       warp_first += share.stride()) {
    const int t = warp_first + lane;
    uint32_t hit = 0;
    if (t < args.num_tokens) {
      for_each_id(args.topk_idx + static_cast<int64_t>(t) * args.num_topk, args.num_topk, [&](int64_t id) {
        if (id >= first_expert && id < end_expert)
          hit |= 1u << (static_cast<int>(id - first_expert) / experts_per_group);
      });
      if constexpr (kWriteRows) {
        bool* row = args.is_token_in_rank + static_cast<int64_t>(t) * args.num_ranks + first;
        for (int j = 0; j < count; ++j) row[j] = (hit >> j) & 1u;
      }
    }
    for (int j = 0; j < count; ++j) {
      const int warp_tokens = __popc(__ballot_sync(0xffffffffu, (hit >> j) & 1u));
      if (lane == j) lane_group_tokens += warp_tokens;
    }
  }
  __syncthreads();
  if (lane < count && lane_group_tokens != 0) atomicAdd(&bins[lane], lane_group_tokens);
  cluster_barrier();
  if (out != nullptr && share.rank == 0 && threadIdx.x < count)
    out[first + threadIdx.x] = cluster_sum(bins, threadIdx.x, share);
  cluster_barrier();  // NOTE: no block leaves while block 0 reads its bins
}

__global__ void __launch_bounds__(kLayoutThreads) dispatch_layout_kernel(LayoutArgs args, LayoutPlan plan) {
  __shared__ int bins[kMaxExpertsPerBlock];
  const ClusterShare share = ClusterShare::mine(plan);
  int block = blockIdx.x / plan.cluster_blocks;  // the cluster's: its blocks are consecutive
  if (block < plan.expert_blocks) {
    count_experts(args, share, block * plan.experts_per_block, plan.experts_per_block, bins);
    return;
  }
  block -= plan.expert_blocks;
  const int experts_per_rank = args.num_experts / args.num_ranks;
  if (block < plan.rank_blocks) {
    count_groups<true>(args, share, block * kGroupsPerBlock, args.num_ranks, experts_per_rank,
                       args.num_tokens_per_rank, bins);
    return;
  }
  block -= plan.rank_blocks;
  count_groups<false>(args, share, block * kGroupsPerBlock, args.num_ranks / args.ranks_per_node,
                      experts_per_rank * args.ranks_per_node, args.num_tokens_per_node, bins);
}

// Whether the kernel as this GPU runs it was built for sm_90 or newer (a build for an older architecture
// runs there from its PTX, without clusters); once per process, which drives one GPU.
bool kernel_has_clusters() {
  static const bool has = [] {
    cudaFuncAttributes attributes{};
    CUDA_CHECK(cudaFuncGetAttributes(&attributes, dispatch_layout_kernel));
    return attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90;
  }();
  return has;
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
  // NOTE: launched at T = 0 too: the counts are written (zeros) only by the kernel.
  const LayoutPlan plan = LayoutPlan::of(args, kernel_has_clusters());
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(plan.clusters() * plan.cluster_blocks);
  config.blockDim = dim3(kLayoutThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = plan.cluster_blocks;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  if (plan.cluster_blocks > 1) {
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&config, dispatch_layout_kernel, args, plan));
}

}  // namespace ep_plugin
