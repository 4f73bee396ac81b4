// The layout kernel's arguments, and how ep_plugin._C_torch launches that kernel of ep_plugin._C in the
// binding call that allocates its outputs (the eager fast path of get_dispatch_layout,
// ep_plugin/backends/intranode.py).
//
// As in low_latency_launchers.h, the two modules do not link each other: _C hands out the launcher in a
// PyCapsule named kLayoutLauncherName, and the runtime crosses as a Python object (void*: this header
// needs no Python or CUDA header) that only _C looks into.
#pragma once

#include <cstdint>

namespace ep_plugin {

struct LayoutArgs {
  const int64_t* topk_idx;          // [T, K]
  int num_tokens, num_topk, num_experts, num_ranks, ranks_per_node;
  // Every entry of the outputs is written by the kernel (no zeroing before it).
  int32_t* num_tokens_per_expert;   // [E]: ids of each expert (out-of-range ids skipped)
  int32_t* num_tokens_per_rank;     // [R]: tokens with an id on each rank, or nullptr: not written
  int32_t* num_tokens_per_node;     // [R / ranks_per_node], or nullptr: not counted
  bool* is_token_in_rank;           // [T, R]
};

namespace layout {

constexpr const char* kLayoutLauncherName = "ep_plugin._C.layout_launcher";

// One launch of the layout kernel on `stream`; true if launched. `runtime`: the buffer's IntranodeRuntime
// or None (a runtime that holds a device error launches nothing).
struct LayoutLauncher {
  bool (*launch)(void* runtime, const LayoutArgs& args, uintptr_t stream) noexcept;
};

}  // namespace layout
}  // namespace ep_plugin
