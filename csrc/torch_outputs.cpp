// ep_plugin._C_torch: the native backend's outputs, allocated by torch's own allocator from C++, and
// the eager fast paths of the low-latency calls and of get_dispatch_layout (LowLatencyCalls and
// LayoutCalls, below), which also launch.
//
// An eager call's host time is mostly Python: each torch.empty from Python costs about 4.5 us on an
// H100 host, and a low-latency dispatch has five outputs. An OutputGroup holds a call's output specs
// once; each call then allocates all of them in one binding call, through the same caching allocator
// (on the current stream), independent of torch's global default device and dtype. Outputs that live
// and die together form a block: one allocation, which the block's tensors share (a CUDA allocation
// costs about 3 us even from C++). Built against the installed torch by its own BuildExtension
// (setup.py): rebuild after upgrading torch.
// NOTE: no C++ exception leaves this module. On the GPU machine's torch 2.11 an exception thrown out of
// a binding of this module (a bad spec, a CUDA out-of-memory error) crashed the process, in a
// constructor and in a function alike; exceptions caught inside it are harmless. Each binding returns
// its result or a Failure, which the Python side (ep_plugin/backends/native_common.py) raises.
// NOTE: the few headers it needs, not torch/extension.h (a third of the build time).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "common/dlpack_abi.h"
#include "common/layout_launcher.h"
#include "common/low_latency_launchers.h"

namespace {

// An extent of -1 is the call's row count (OutputGroup::empty's `rows`).
constexpr int64_t kRows = -1;
// Each output of a shared allocation starts at a multiple of this many bytes from the allocation's
// start: a multiple of every element size and of the 16 bytes that vector and TMA accesses need.
constexpr int64_t kAlignBytes = 256;

struct OutputSpec {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // empty: contiguous
  at::ScalarType dtype;
};

using Block = std::vector<OutputSpec>;
using SpecArgument = std::tuple<std::vector<int64_t>, std::optional<std::vector<int64_t>>, at::ScalarType>;

// A call that failed: its kind ("value": a bad argument, "out_of_memory", "runtime") and message.
using Failure = std::tuple<std::string, std::string>;

// `call()`'s result, or the Failure of the exception it threw (caught here, inside this module).
template <typename Call>
auto without_throwing(Call call) -> std::variant<decltype(call()), Failure> {
  try {
    return call();
  } catch (const c10::OutOfMemoryError& error) {
    return Failure{"out_of_memory", error.what_without_backtrace()};
  } catch (const c10::Error& error) {
    return Failure{"runtime", error.what_without_backtrace()};
  } catch (const std::exception& error) {
    return Failure{"runtime", error.what()};
  }
}

// An output's sizes for one call (-1 extents set to `rows`) and its strides (contiguous where none given).
struct Shape {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;

  Shape(const OutputSpec& spec, int64_t rows) : sizes(spec.sizes), strides(spec.strides) {
    for (int64_t& extent : sizes)
      if (extent == kRows) extent = rows;
    if (strides.empty()) {
      strides.resize(sizes.size());
      int64_t stride = 1;
      for (size_t d = sizes.size(); d-- > 0;) {
        strides[d] = stride;
        stride *= std::max<int64_t>(sizes[d], 1);
      }
    }
  }

  // Elements from the first to one past the last (0 for an empty tensor).
  int64_t span() const {
    int64_t last = 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] == 0) return 0;
      last += (sizes[d] - 1) * strides[d];
    }
    return last + 1;
  }
};

int64_t aligned(int64_t bytes) { return (bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// A tensor of `dtype` and `shape` on `base`'s storage from byte `offset`, built as at::empty builds
// its own (no dispatcher call): a separate tensor, not a view of `base` (its own version counter).
at::Tensor tensor_in(const at::Tensor& base, const Shape& shape, at::ScalarType dtype, int64_t offset) {
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                               c10::scalarTypeToTypeMeta(dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(shape.sizes, shape.strides,
                                                      offset / static_cast<int64_t>(c10::elementSize(dtype)));
  return tensor;
}

class OutputGroup {
 public:
  OutputGroup(std::vector<Block> blocks, const at::Device& device) : blocks_(std::move(blocks)), device_(device) {}

  // Uninitialised tensors, one per spec in block order, with every -1 extent set to `rows` (>= 0).
  std::vector<at::Tensor> empty(int64_t rows) const {
    std::vector<at::Tensor> outputs;
    for (const Block& block : blocks_) {
      if (block.size() == 1)
        outputs.push_back(allocate_alone(block.front(), rows));
      else
        allocate_shared(block, rows, outputs);
    }
    return outputs;
  }

  std::string describe() const {
    size_t count = 0;
    for (const Block& block : blocks_) count += block.size();
    return "OutputGroup(" + std::to_string(count) + " outputs in " + std::to_string(blocks_.size()) +
           " allocations on " + device_.str() + ")";
  }

 private:
  at::Tensor allocate_alone(const OutputSpec& spec, int64_t rows) const {
    const auto options = at::TensorOptions().dtype(spec.dtype).device(device_);
    const Shape shape(spec, rows);
    if (!spec.strides.empty()) return at::empty_strided(shape.sizes, shape.strides, options);
    return at::empty(shape.sizes, options);
  }

  void allocate_shared(const Block& block, int64_t rows, std::vector<at::Tensor>& outputs) const {
    std::vector<Shape> shapes;
    std::vector<int64_t> offsets;
    int64_t bytes = 0;
    for (const OutputSpec& spec : block) {
      shapes.emplace_back(spec, rows);
      offsets.push_back(bytes);
      bytes = aligned(bytes + shapes.back().span() * static_cast<int64_t>(c10::elementSize(spec.dtype)));
    }
    const at::Tensor base = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
    for (size_t i = 0; i < block.size(); ++i) outputs.push_back(tensor_in(base, shapes[i], block[i].dtype, offsets[i]));
  }

  std::vector<Block> blocks_;
  at::Device device_;
};

// Why `argument` is not a spec ("" if it is one).
std::string spec_error(const SpecArgument& argument) {
  const auto& [sizes, strides, dtype] = argument;
  for (int64_t extent : sizes)
    if (extent < 0 && extent != kRows) return "OutputGroup: extent " + std::to_string(extent) + " (use -1 for the rows)";
  if (!strides) return "";
  if (strides->size() != sizes.size())
    return "OutputGroup: " + std::to_string(strides->size()) + " strides for " + std::to_string(sizes.size()) + " sizes";
  for (int64_t extent : sizes)
    if (extent == kRows) return "OutputGroup: strided outputs have fixed sizes";
  for (int64_t stride : *strides)
    if (stride < 0) return "OutputGroup: stride " + std::to_string(stride);
  return "";
}

std::variant<OutputGroup, Failure> make_output_group(const std::vector<std::vector<SpecArgument>>& blocks,
                                                     const at::Device& device) {
  std::vector<Block> checked;
  for (const auto& block : blocks) {
    if (block.empty()) return Failure{"value", "OutputGroup: an empty block"};
    checked.emplace_back();
    for (const SpecArgument& spec : block) {
      const std::string error = spec_error(spec);
      if (!error.empty()) return Failure{"value", error};
      const auto& [sizes, strides, dtype] = spec;
      checked.back().push_back(OutputSpec{sizes, strides.value_or(std::vector<int64_t>{}), dtype});
    }
  }
  return OutputGroup(std::move(checked), device);
}

std::variant<std::vector<at::Tensor>, Failure> empty_outputs(const OutputGroup& group, int64_t rows) {
  if (rows < 0) return Failure{"value", "OutputGroup.empty: rows = " + std::to_string(rows)};
  return without_throwing([&] { return group.empty(rows); });
}

// ---- the eager low-latency fast path ----------------------------------------------------------------
// One low-latency plan's calls in one binding call each: check the arguments (booleans only), allocate
// the outputs, launch through _C_nvshmem's launchers (common/low_latency_launchers.h). Anything that
// differs from the common case (a tensor of another dtype, shape, device or layout, a failed allocation
// or launch) returns None having launched nothing; the checked Python path then runs the call and
// raises its error where there is one, so every message lives in one place.
namespace ll = ep_plugin::low_latency;
namespace layout = ep_plugin::layout;
using ep_plugin::LayoutArgs;

// `call()`'s result, or None where it threw: every step that can throw comes before the launch, so a
// None has launched nothing.
template <typename Call>
pybind11::object none_if_thrown(Call call) noexcept {
  try {
    return call();
  } catch (...) {
    PyErr_Clear();  // an error pybind11 left set would fail the None returned
    return pybind11::none();
  }
}

// `object` as a tensor: plain torch.Tensor (or Parameter) only; a subclass takes the checked path.
std::optional<at::Tensor> tensor_of(pybind11::handle object) {
  if (!THPVariable_CheckExact(object.ptr())) return std::nullopt;
  return THPVariable_Unpack(object.ptr());
}

// The shape, dtype, device and (contiguous) layout a kernel reads without a copy.
bool is_plain(const at::Tensor& tensor, const at::Device& device, at::ScalarType dtype,
              std::initializer_list<int64_t> sizes) {
  return tensor.device() == device && tensor.scalar_type() == dtype && tensor.sizes().equals(sizes) &&
         tensor.is_contiguous();
}

struct LowLatencySizes {
  int64_t num_max_tokens, hidden, num_topk, num_local_experts, num_ranks;
  bool use_fp8;
};

class LowLatencyCalls {
 public:
  LowLatencyCalls(pybind11::object dispatch_outputs, pybind11::object combine_output, const ll::LowLatencyLaunchers* launchers,
                  pybind11::object runtime, pybind11::object dispatch_args, pybind11::object combine_args,
                  const at::Device& device, const LowLatencySizes& sizes)
      : dispatch_outputs_(std::move(dispatch_outputs)), combine_output_(std::move(combine_output)),
        launchers_(launchers), runtime_(std::move(runtime)), dispatch_args_(std::move(dispatch_args)),
        combine_args_(std::move(combine_args)), device_(device), sizes_(sizes) {}

  // ([recv_x, (recv_scales,) recv_count, recv_src_info, recv_layout], T) of a launched dispatch, or None.
  // NOTE: T from here: x.shape in Python would pass through a default-device mode (a few us).
  pybind11::object dispatch(pybind11::handle x_object, pybind11::handle topk_idx_object, pybind11::handle stats_object,
                            int parity, uintptr_t stream) const {
    return none_if_thrown([&] { return launch_dispatch(x_object, topk_idx_object, stats_object, parity, stream); });
  }

  // The combined [T, H] bf16 tensor (`out` where given) of a launched combine, or None. `source`: the
  // tensor whose data is sent (x, or the staging buffer with zero_copy); `x` is checked either way.
  pybind11::object combine(pybind11::handle x_object, pybind11::handle source_object, pybind11::handle topk_idx_object,
                           pybind11::handle topk_weights_object, pybind11::handle out_object,
                           pybind11::handle recv_src_info_object, pybind11::handle recv_layout_object, int64_t num_tokens,
                           int parity, uintptr_t stream) const {
    return none_if_thrown([&] {
      return launch_combine(x_object, source_object, topk_idx_object, topk_weights_object, out_object,
                            recv_src_info_object, recv_layout_object, num_tokens, parity, stream);
    });
  }

 private:
  pybind11::object launch_dispatch(pybind11::handle x_object, pybind11::handle topk_idx_object,
                                   pybind11::handle stats_object, int parity, uintptr_t stream) const {
    const auto x = tensor_of(x_object), topk_idx = tensor_of(topk_idx_object);
    if (!x || !topk_idx || x->dim() != 2) return pybind11::none();
    const int64_t num_tokens = x->size(0);
    if (num_tokens < 1 || num_tokens > sizes_.num_max_tokens ||
        !is_plain(*x, device_, at::kBFloat16, {num_tokens, sizes_.hidden}) ||
        !is_plain(*topk_idx, device_, at::kLong, {num_tokens, sizes_.num_topk}))
      return pybind11::none();
    int32_t* stats = nullptr;
    if (!stats_object.is_none()) {
      const auto given = tensor_of(stats_object);
      if (!given || !is_plain(*given, device_, at::kInt, {sizes_.num_local_experts})) return pybind11::none();
      stats = given->data_ptr<int32_t>();
    }
    const std::vector<at::Tensor> made = dispatch_outputs_.cast<const OutputGroup&>().empty(0);
    const size_t first_after_rows = sizes_.use_fp8 ? 2 : 1;  // [rows, (scales,) count, src_info, layout]
    const ll::DispatchCall call{x->data_ptr(), topk_idx->data_ptr<int64_t>(), static_cast<int>(num_tokens),
                                made[0].data_ptr(), sizes_.use_fp8 ? made[1].data_ptr() : nullptr,
                                made[first_after_rows].data_ptr<int32_t>(), made[first_after_rows + 1].data_ptr<int32_t>(),
                                made[first_after_rows + 2].data_ptr<int64_t>(), stats};
    // NOTE: the Python result first: once the kernel is queued, nothing may fail (None would run it twice).
    pybind11::object result = pybind11::make_tuple(pybind11::cast(made), num_tokens);
    if (!launchers_->dispatch(runtime_.ptr(), dispatch_args_.ptr(), call, parity, stream)) return pybind11::none();
    return result;
  }

  pybind11::object launch_combine(pybind11::handle x_object, pybind11::handle source_object,
                                  pybind11::handle topk_idx_object, pybind11::handle topk_weights_object,
                                  pybind11::handle out_object, pybind11::handle recv_src_info_object,
                                  pybind11::handle recv_layout_object, int64_t num_tokens, int parity,
                                  uintptr_t stream) const {
    const auto x = tensor_of(x_object), source = tensor_of(source_object), topk_idx = tensor_of(topk_idx_object),
               topk_weights = tensor_of(topk_weights_object), recv_src_info = tensor_of(recv_src_info_object),
               recv_layout = tensor_of(recv_layout_object);
    if (!x || !source || !topk_idx || !topk_weights || !recv_src_info || !recv_layout || num_tokens < 1) return pybind11::none();
    const int64_t num_slots = sizes_.num_ranks * sizes_.num_max_tokens;
    if (!is_plain(*x, device_, at::kBFloat16, {sizes_.num_local_experts, num_slots, sizes_.hidden}) ||
        !is_plain(*source, device_, at::kBFloat16, {sizes_.num_local_experts, num_slots, sizes_.hidden}) ||
        !is_plain(*topk_idx, device_, at::kLong, {num_tokens, sizes_.num_topk}) ||
        !is_plain(*topk_weights, device_, at::kFloat, {num_tokens, sizes_.num_topk}))
      return pybind11::none();
    at::Tensor combined;
    if (out_object.is_none()) {
      combined = combine_output_.cast<const OutputGroup&>().empty(num_tokens).front();
    } else {
      const auto out = tensor_of(out_object);
      if (!out || !is_plain(*out, device_, at::kBFloat16, {num_tokens, sizes_.hidden})) return pybind11::none();
      combined = *out;
    }
    const ll::CombineCall call{source->data_ptr(), recv_src_info->data_ptr<int32_t>(), recv_layout->data_ptr<int64_t>(),
                               topk_idx->data_ptr<int64_t>(), topk_weights->data_ptr<float>(), combined.data_ptr(),
                               static_cast<int>(num_tokens)};
    pybind11::object result = pybind11::cast(combined);  // NOTE: before the launch, as in dispatch
    if (!launchers_->combine(runtime_.ptr(), combine_args_.ptr(), call, parity, stream)) return pybind11::none();
    return result;
  }

  pybind11::object dispatch_outputs_, combine_output_;  // OutputGroups
  const ll::LowLatencyLaunchers* launchers_;
  pybind11::object runtime_, dispatch_args_, combine_args_;  // _C_nvshmem's LowLatencyRuntime and Args templates
  at::Device device_;
  LowLatencySizes sizes_;
};

std::variant<LowLatencyCalls, Failure> make_low_latency_calls(
    pybind11::object dispatch_outputs, pybind11::object combine_output, pybind11::capsule launchers,
    pybind11::object runtime, pybind11::object dispatch_args, pybind11::object combine_args, const at::Device& device,
    int64_t num_max_tokens, int64_t hidden, int64_t num_topk, int64_t num_local_experts, int64_t num_ranks,
    bool use_fp8) {
  if (!pybind11::isinstance<OutputGroup>(dispatch_outputs) || !pybind11::isinstance<OutputGroup>(combine_output))
    return Failure{"value", "low_latency_calls: dispatch_outputs and combine_output must be OutputGroups"};
  if (!PyCapsule_IsValid(launchers.ptr(), ll::kLowLatencyLaunchersName))
    return Failure{"value", std::string("low_latency_calls: launchers must be the capsule ") + ll::kLowLatencyLaunchersName};
  const auto* table = static_cast<const ll::LowLatencyLaunchers*>(PyCapsule_GetPointer(launchers.ptr(),
                                                                                       ll::kLowLatencyLaunchersName));
  return LowLatencyCalls(std::move(dispatch_outputs), std::move(combine_output), table, std::move(runtime),
                         std::move(dispatch_args), std::move(combine_args), device,
                         LowLatencySizes{num_max_tokens, hidden, num_topk, num_local_experts, num_ranks, use_fp8});
}

// ---- the eager fast path of get_dispatch_layout ---------------------------------------------------
// As LowLatencyCalls: the checks as booleans, the outputs, the launch through _C's launcher
// (common/layout_launcher.h), in one binding call; None (nothing launched) sends the call to the checked path.
struct LayoutSizes {
  int64_t num_experts, num_ranks, ranks_per_node, max_topk;
  bool counts_nodes;  // the outputs include num_tokens_per_node (ranks on several nodes)
};

class LayoutCalls {
 public:
  LayoutCalls(pybind11::object outputs, const layout::LayoutLauncher* launcher, pybind11::object runtime,
              const at::Device& device, const LayoutSizes& sizes)
      : outputs_(std::move(outputs)), launcher_(launcher), runtime_(std::move(runtime)), device_(device), sizes_(sizes) {}

  // (num_tokens_per_rank, num_tokens_per_node or None, num_tokens_per_expert, is_token_in_rank) of a launched
  // layout kernel, or None.
  pybind11::object layout(pybind11::handle topk_idx_object, uintptr_t stream) const {
    return none_if_thrown([&] { return launch(topk_idx_object, stream); });
  }

 private:
  pybind11::object launch(pybind11::handle topk_idx_object, uintptr_t stream) const {
    const auto topk_idx = tensor_of(topk_idx_object);
    if (!topk_idx || topk_idx->dim() != 2) return pybind11::none();
    const int64_t num_tokens = topk_idx->size(0), num_topk = topk_idx->size(1);
    if (num_topk < 1 || num_topk > sizes_.max_topk || num_tokens > INT32_MAX ||
        !is_plain(*topk_idx, device_, at::kLong, {num_tokens, num_topk}))
      return pybind11::none();
    const std::vector<at::Tensor> made = outputs_.cast<const OutputGroup&>().empty(num_tokens);
    const at::Tensor& per_rank = made[0];
    const at::Tensor* per_node = sizes_.counts_nodes ? &made[1] : nullptr;
    const at::Tensor& per_expert = made[sizes_.counts_nodes ? 2 : 1];
    const at::Tensor& in_rank = made.back();
    LayoutArgs args{};
    args.topk_idx = topk_idx->data_ptr<int64_t>();
    args.num_tokens = static_cast<int>(num_tokens);
    args.num_topk = static_cast<int>(num_topk);
    args.num_experts = static_cast<int>(sizes_.num_experts);
    args.num_ranks = static_cast<int>(sizes_.num_ranks);
    args.ranks_per_node = static_cast<int>(sizes_.ranks_per_node);
    args.num_tokens_per_expert = per_expert.data_ptr<int32_t>();
    args.num_tokens_per_rank = per_rank.data_ptr<int32_t>();
    args.num_tokens_per_node = per_node == nullptr ? nullptr : per_node->data_ptr<int32_t>();
    args.is_token_in_rank = in_rank.data_ptr<bool>();
    // NOTE: the Python result first: once the kernel is queued, nothing may fail (None would run it twice).
    pybind11::object result = pybind11::make_tuple(per_rank, per_node == nullptr ? pybind11::none() : pybind11::cast(*per_node),
                                                   per_expert, in_rank);
    if (!launcher_->launch(runtime_.ptr(), args, stream)) return pybind11::none();
    return result;
  }

  pybind11::object outputs_;  // an OutputGroup: per rank, (per node,) per expert, in rank
  const layout::LayoutLauncher* launcher_;
  pybind11::object runtime_;  // _C's IntranodeRuntime, or None
  at::Device device_;
  LayoutSizes sizes_;
};

std::variant<LayoutCalls, Failure> make_layout_calls(pybind11::object outputs, pybind11::capsule launcher,
                                                     pybind11::object runtime, const at::Device& device,
                                                     int64_t num_experts, int64_t num_ranks, int64_t ranks_per_node,
                                                     int64_t max_topk, bool counts_nodes) {
  if (!pybind11::isinstance<OutputGroup>(outputs)) return Failure{"value", "layout_calls: outputs must be an OutputGroup"};
  if (!PyCapsule_IsValid(launcher.ptr(), layout::kLayoutLauncherName))
    return Failure{"value", std::string("layout_calls: launcher must be the capsule ") + layout::kLayoutLauncherName};
  const auto* table = static_cast<const layout::LayoutLauncher*>(PyCapsule_GetPointer(launcher.ptr(),
                                                                                     layout::kLayoutLauncherName));
  return LayoutCalls(std::move(outputs), table, std::move(runtime), device,
                     LayoutSizes{num_experts, num_ranks, ranks_per_node, max_topk, counts_nodes});
}

// ---- the normal-mode dispatch's inputs, read in C++ ------------------------------------------------
// What an intranode dispatch needs of its tensors (addresses, sizes, strides), read in one binding call:
// in Python each of these reads costs about 0.5 us, and a dispatch makes some forty of them with its
// checks. Each tensor must be what the kernels read without a copy; else None, and the checked Python path
// raises naming the argument, or copies it and reads again.
class NormalInputs {
 public:
  NormalInputs(const at::Device& device, int64_t max_topk) : device_(device), max_topk_(max_topk) {}

  // (num_tokens, row_bytes, x, scales, num_scales, scale_token_stride, scale_stride, scales_are_int32) of a
  // dispatch payload: a [T, H] bf16 tensor, or (fp8 [T, H], float32 or int32 scales [T, S] in any layout of
  // positive strides); the addresses as ints (0: none). `exact`: plain torch.Tensors only (a subclass is
  // the checked path's to accept).
  pybind11::object payload(pybind11::handle x, bool exact) const {
    return none_if_thrown([&]() -> pybind11::object {
      const auto read = read_payload(x, exact);
      return read ? payload_tuple(*read) : pybind11::none();
    });
  }

  // (x, hidden, num_topk, topk_weights) of a combine of `num_rows` rows: x [N, H] bf16 and topk_weights None
  // (K = 0) or [N, K] float32.
  pybind11::object combine(pybind11::handle x_object, pybind11::handle weights_object, int64_t num_rows,
                           bool exact) const {
    return none_if_thrown([&]() -> pybind11::object {
      const auto x = tensor_any(x_object, exact);
      if (!x || x->dim() != 2) return pybind11::none();
      const int64_t H = x->size(1);
      if (!is_plain(*x, device_, at::kBFloat16, {num_rows, H}) || (2 * H) % 16 != 0) return pybind11::none();
      int64_t K = 0;
      uintptr_t weights = 0;
      if (!weights_object.is_none()) {
        const auto given = topk_columns(weights_object, num_rows, at::kFloat, exact);
        if (!given) return pybind11::none();
        K = given->size(1);
        weights = address(*given);
      }
      return pybind11::make_tuple(address(*x), H, K, weights);
    });
  }

  // The payload's numbers, then (num_topk, topk_idx, has_weights, topk_weights, num_experts, is_token_in_rank,
  // num_tokens_per_expert) of a dispatch with notify among `num_ranks` ranks; topk_idx and topk_weights may be
  // None (K = 0), and num_tokens_per_rank (then not read).
  pybind11::object dispatch(pybind11::handle x, pybind11::handle topk_idx_object, pybind11::handle topk_weights_object,
                            pybind11::handle per_rank_object, pybind11::handle in_rank_object,
                            pybind11::handle per_expert_object, int64_t num_ranks, bool exact) const {
    return none_if_thrown([&]() -> pybind11::object {
      const auto read = read_payload(x, exact);
      const auto in_rank = tensor_any(in_rank_object, exact), per_expert = tensor_any(per_expert_object, exact);
      if (!read || !in_rank || !per_expert) return pybind11::none();
      const int64_t T = read->num_tokens, R = num_ranks;
      if (!is_plain(*in_rank, device_, at::kBool, {T, R}) || per_expert->dim() != 1 ||
          !is_plain(*per_expert, device_, at::kInt, {per_expert->size(0)}))
        return pybind11::none();
      if (!per_rank_object.is_none()) {
        const auto per_rank = tensor_any(per_rank_object, exact);
        if (!per_rank || per_rank->dim() != 1 || per_rank->device() != device_ || per_rank->scalar_type() != at::kInt ||
            per_rank->size(0) != R)
          return pybind11::none();
      }
      const int64_t num_experts = per_expert->size(0);
      if (num_experts < 1 || num_experts % R != 0) return pybind11::none();
      int64_t K = 0;
      uintptr_t topk_idx = 0, topk_weights = 0;
      bool has_weights = false;
      if (!topk_idx_object.is_none()) {
        const auto ids = topk_columns(topk_idx_object, T, at::kLong, exact);
        if (!ids) return pybind11::none();
        K = ids->size(1);
        topk_idx = address(*ids);
        if (!topk_weights_object.is_none()) {
          const auto weights = tensor_any(topk_weights_object, exact);
          if (!weights || !is_plain(*weights, device_, at::kFloat, {T, K})) return pybind11::none();
          topk_weights = address(*weights);
          has_weights = true;
        }
      } else if (!topk_weights_object.is_none()) {
        return pybind11::none();
      }
      return pybind11::make_tuple(read->num_tokens, read->row_bytes, read->x, read->scales, read->num_scales,
                                  read->scale_token_stride, read->scale_stride, read->scales_are_int32, K, topk_idx,
                                  has_weights, topk_weights, num_experts, address(*in_rank), address(*per_expert));
    });
  }

 private:
  struct Payload {
    int64_t num_tokens, row_bytes;
    uintptr_t x, scales;
    int64_t num_scales, scale_token_stride, scale_stride;
    bool scales_are_int32;
  };

  static std::optional<at::Tensor> tensor_any(pybind11::handle object, bool exact) {
    if (exact) return tensor_of(object);
    if (!THPVariable_Check(object.ptr())) return std::nullopt;
    return THPVariable_Unpack(object.ptr());
  }

  // A tensor's address as the kernels take it (0 for an empty tensor, as address_of in Python).
  static uintptr_t address(const at::Tensor& tensor) {
    return tensor.numel() == 0 ? 0 : reinterpret_cast<uintptr_t>(tensor.data_ptr());
  }

  // A plain [rows, K] tensor of `dtype` on this device with 1 <= K <= max_topk (top-k ids or weights).
  std::optional<at::Tensor> topk_columns(pybind11::handle object, int64_t rows, at::ScalarType dtype, bool exact) const {
    const auto tensor = tensor_any(object, exact);
    if (!tensor || tensor->dim() != 2) return std::nullopt;
    const int64_t K = tensor->size(1);
    if (K < 1 || K > max_topk_ || !is_plain(*tensor, device_, dtype, {rows, K})) return std::nullopt;
    return tensor;
  }

  std::optional<Payload> read_payload(pybind11::handle x, bool exact) const {
    const bool is_pair = PyTuple_Check(x.ptr()) || PyList_Check(x.ptr());
    if (is_pair && PySequence_Size(x.ptr()) != 2) return std::nullopt;
    const auto data = tensor_any(is_pair ? pybind11::handle(PySequence_Fast_GET_ITEM(x.ptr(), 0)) : x, exact);
    if (!data || data->dim() != 2) return std::nullopt;
    const int64_t T = data->size(0), H = data->size(1);
    if (!is_plain(*data, device_, is_pair ? at::kFloat8_e4m3fn : at::kBFloat16, {T, H})) return std::nullopt;
    const int64_t row_bytes = H * static_cast<int64_t>(data->element_size());
    if (row_bytes % 16 != 0) return std::nullopt;
    Payload read{T, row_bytes, address(*data), 0, 0, 0, 0, false};
    if (!is_pair) return read;
    const auto scales = tensor_any(PySequence_Fast_GET_ITEM(x.ptr(), 1), exact);
    if (!scales || scales->dim() != 2 || scales->device() != device_ || scales->size(0) != T || scales->size(1) < 1 ||
        scales->stride(0) < 1 || scales->stride(1) < 1)
      return std::nullopt;
    if (scales->scalar_type() != at::kFloat && scales->scalar_type() != at::kInt) return std::nullopt;
    read.scales = address(*scales);
    read.num_scales = scales->size(1);
    read.scale_token_stride = scales->stride(0);
    read.scale_stride = scales->stride(1);
    read.scales_are_int32 = scales->scalar_type() == at::kInt;
    return read;
  }

  static pybind11::object payload_tuple(const Payload& p) {
    return pybind11::make_tuple(p.num_tokens, p.row_bytes, p.x, p.scales, p.num_scales, p.scale_token_stride,
                                p.scale_stride, p.scales_are_int32);
  }

  at::Device device_;
  int64_t max_topk_;
};

// ---- the output region's tensors ------------------------------------------------------------------
// Tensors of `dtypes` over the uint8 DLPack capsules that ep_plugin._C hands out for the output region
// (compact, row-major), each capsule consumed as torch.from_dlpack consumes one; its last extent in
// elements of the dtype. In one binding call: from Python a capsule's tensor and its view cost about 3 us.
std::variant<std::vector<at::Tensor>, Failure> region_tensors(const std::vector<pybind11::capsule>& capsules,
                                                              const std::vector<at::ScalarType>& dtypes) {
  namespace dl = ep_plugin::dlpack;
  if (capsules.size() != dtypes.size()) return Failure{"value", "region_tensors: one dtype per capsule"};
  for (const pybind11::capsule& capsule : capsules) {
    if (!PyCapsule_IsValid(capsule.ptr(), dl::kCapsuleName))
      return Failure{"value", "region_tensors: a capsule that is not an unused \"dltensor\""};
    const auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), dl::kCapsuleName));
    const dl::Tensor& t = managed->dl_tensor;
    if (t.dtype.code != dl::kUInt || t.dtype.bits != 8 || t.dtype.lanes != 1 || t.strides != nullptr || t.ndim < 1)
      return Failure{"value", "region_tensors: capsules of compact uint8 tensors only"};
  }
  return without_throwing([&] {
    std::vector<at::Tensor> tensors;
    for (size_t i = 0; i < capsules.size(); ++i) {
      auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsules[i].ptr(), dl::kCapsuleName));
      const dl::Tensor& t = managed->dl_tensor;
      std::vector<int64_t> sizes(t.shape, t.shape + t.ndim);
      const int64_t item = static_cast<int64_t>(c10::elementSize(dtypes[i]));
      TORCH_CHECK(sizes.back() % item == 0, "region_tensors: ", sizes.back(), " bytes are not whole elements");
      sizes.back() /= item;
      const at::Device device = t.device.device_type == dl::kCUDA
                                    ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(t.device.device_id))
                                    : at::Device(at::kCPU);
      // NOTE: the target device given, torch does not ask the driver where the pointer lives
      // (cudaPointerGetAttributes, about 1 us an output on the dispatch's return path).
      tensors.push_back(at::from_blob(static_cast<uint8_t*>(t.data) + t.byte_offset, sizes,
                                      [managed](void*) { managed->deleter(managed); },
                                      at::TensorOptions().dtype(dtypes[i]).device(device), device));
      // NOTE: consumed as torch.from_dlpack consumes a capsule: the tensor now returns the memory.
      PyCapsule_SetName(capsules[i].ptr(), dl::kUsedCapsuleName);
      PyCapsule_SetDestructor(capsules[i].ptr(), nullptr);
    }
    return tensors;
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ep_plugin's outputs allocated by torch's caching allocator from C++ (csrc/torch_outputs.cpp). "
            "Each function returns its result or a failure, (kind, message): use it through "
            "ep_plugin.backends.native_common.output_group, which raises the failures.";
  pybind11::class_<OutputGroup>(m, "OutputGroup", "A call's outputs on one device (made by output_group).")
      .def("empty", &empty_outputs, pybind11::arg("rows") = 0,
           "Uninitialised tensors, one per spec in block order, with every -1 extent set to `rows`, on the "
           "current stream; or a failure.")
      .def("__repr__", &OutputGroup::describe);
  pybind11::class_<LowLatencyCalls>(m, "LowLatencyCalls",
                                    "A low-latency plan's eager calls, each checked, allocated and launched in one "
                                    "binding call (made by low_latency_calls).")
      .def("dispatch", &LowLatencyCalls::dispatch, pybind11::arg("x"), pybind11::arg("topk_idx"),
           pybind11::arg("cumulative_local_expert_recv_stats"), pybind11::arg("parity"), pybind11::arg("stream"),
           "The launched dispatch's outputs [recv_x, (recv_scales,) recv_count, recv_src_info, recv_layout] and its "
           "token count, or None (nothing launched: take the checked path).")
      .def("combine", &LowLatencyCalls::combine, pybind11::arg("x"), pybind11::arg("source"), pybind11::arg("topk_idx"),
           pybind11::arg("topk_weights"), pybind11::arg("out"), pybind11::arg("recv_src_info"),
           pybind11::arg("recv_layout"), pybind11::arg("num_tokens"), pybind11::arg("parity"), pybind11::arg("stream"),
           "The launched combine's output, or None (nothing launched: take the checked path).");
  m.def("low_latency_calls", &make_low_latency_calls, pybind11::arg("dispatch_outputs"), pybind11::arg("combine_output"),
        pybind11::arg("launchers"), pybind11::arg("runtime"), pybind11::arg("dispatch_args"),
        pybind11::arg("combine_args"), pybind11::arg("device"), pybind11::arg("num_max_dispatch_tokens_per_rank"),
        pybind11::arg("hidden"), pybind11::arg("num_topk"), pybind11::arg("num_local_experts"),
        pybind11::arg("num_ranks"), pybind11::arg("use_fp8"),
        "The LowLatencyCalls of one low-latency plan (its OutputGroups, _C_nvshmem's launchers capsule, runtime and "
        "Args templates, sizes); or a failure.");
  pybind11::class_<LayoutCalls>(m, "LayoutCalls",
                                "get_dispatch_layout's eager calls for one expert count, each checked, allocated and "
                                "launched in one binding call (made by layout_calls).")
      .def("layout", &LayoutCalls::layout, pybind11::arg("topk_idx"), pybind11::arg("stream"),
           "The launched layout's (num_tokens_per_rank, num_tokens_per_node or None, num_tokens_per_expert, "
           "is_token_in_rank), or None (nothing launched: take the checked path).");
  m.def("layout_calls", &make_layout_calls, pybind11::arg("outputs"), pybind11::arg("launcher"),
        pybind11::arg("runtime"), pybind11::arg("device"), pybind11::arg("num_experts"), pybind11::arg("num_ranks"),
        pybind11::arg("ranks_per_node"), pybind11::arg("max_topk"), pybind11::arg("counts_nodes"),
        "The LayoutCalls of one expert count (its OutputGroup, _C's layout_launcher capsule, the IntranodeRuntime "
        "or None, sizes); or a failure.");
  pybind11::class_<NormalInputs>(m, "NormalInputs",
                                 "The normal-mode dispatch's inputs read in one binding call each (NormalInputs(device, "
                                 "max_topk)).")
      .def(pybind11::init<const at::Device&, int64_t>(), pybind11::arg("device"), pybind11::arg("max_topk"))
      .def("payload", &NormalInputs::payload, pybind11::arg("x"), pybind11::arg("exact"),
           "(num_tokens, row_bytes, x, scales, num_scales, scale_token_stride, scale_stride, scales_are_int32) of a "
           "dispatch payload, or None where it is not what the kernels read without a copy.")
      .def("dispatch", &NormalInputs::dispatch, pybind11::arg("x"), pybind11::arg("topk_idx"),
           pybind11::arg("topk_weights"), pybind11::arg("num_tokens_per_rank"), pybind11::arg("is_token_in_rank"),
           pybind11::arg("num_tokens_per_expert"), pybind11::arg("num_ranks"), pybind11::arg("exact"),
           "The payload's numbers, then (num_topk, topk_idx, has_weights, topk_weights, num_experts, "
           "is_token_in_rank, num_tokens_per_expert) of a dispatch with notify, or None.")
      .def("combine", &NormalInputs::combine, pybind11::arg("x"), pybind11::arg("topk_weights"),
           pybind11::arg("num_rows"), pybind11::arg("exact"),
           "(x, hidden, num_topk, topk_weights) of a combine of num_rows rows, or None.");
  m.def("region_tensors", &region_tensors, pybind11::arg("capsules"), pybind11::arg("dtypes"),
        "Tensors of `dtypes` over ep_plugin._C's uint8 DLPack capsules of the output region (compact), each "
        "capsule consumed; or a failure.");
  m.def("output_group", &make_output_group, pybind11::arg("blocks"), pybind11::arg("device"),
        "An OutputGroup of `blocks`: lists of specs, (sizes, strides or None, dtype) each, whose outputs share "
        "one allocation per block; an extent of -1 is the row count given to its empty(); or a failure.");
}
