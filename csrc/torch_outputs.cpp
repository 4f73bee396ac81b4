// ep_plugin._C_torch: the native backend's outputs, allocated by torch's own allocator from C++.
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
#include <c10/core/TensorImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

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
  m.def("output_group", &make_output_group, pybind11::arg("blocks"), pybind11::arg("device"),
        "An OutputGroup of `blocks`: lists of specs, (sizes, strides or None, dtype) each, whose outputs share "
        "one allocation per block; an extent of -1 is the row count given to its empty(); or a failure.");
}
