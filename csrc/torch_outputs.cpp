// ep_plugin._C_torch: the native backend's outputs, allocated by torch's own allocator from C++.
//
// An eager call's host time is mostly Python: each torch.empty from Python costs about 4.5 us on an
// H100 host, and a low-latency dispatch has five outputs. An OutputGroup holds a call's output specs
// once; each call then allocates all of them in one binding call, through the same caching allocator
// (on the current stream), independent of torch's global default device and dtype. Built against the
// installed torch by its own BuildExtension (setup.py): rebuild after upgrading torch.
// NOTE: the few headers it needs, not torch/extension.h (a third of the build time).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// An extent of -1 is the call's row count (OutputGroup::empty's `rows`).
constexpr int64_t kRows = -1;

struct OutputSpec {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // empty: contiguous
  at::ScalarType dtype;
};

using SpecArgument = std::tuple<std::vector<int64_t>, std::optional<std::vector<int64_t>>, at::ScalarType>;

class OutputGroup {
 public:
  OutputGroup(std::vector<OutputSpec> specs, const at::Device& device) : specs_(std::move(specs)), device_(device) {}

  // Uninitialised tensors, one per spec, with every -1 extent set to `rows`.
  std::vector<at::Tensor> empty(int64_t rows) const {
    TORCH_CHECK(rows >= 0, "OutputGroup.empty: rows = ", rows);
    std::vector<at::Tensor> outputs;
    outputs.reserve(specs_.size());
    std::vector<int64_t> sizes;
    for (const OutputSpec& spec : specs_) {
      const auto options = at::TensorOptions().dtype(spec.dtype).device(device_);
      if (!spec.strides.empty()) {
        outputs.push_back(at::empty_strided(spec.sizes, spec.strides, options));
        continue;
      }
      sizes = spec.sizes;
      for (int64_t& extent : sizes)
        if (extent == kRows) extent = rows;
      outputs.push_back(at::empty(sizes, options));
    }
    return outputs;
  }

  std::string describe() const {
    return "OutputGroup(" + std::to_string(specs_.size()) + " outputs on " + device_.str() + ")";
  }

 private:
  std::vector<OutputSpec> specs_;
  at::Device device_;
};

// The specs checked, then the group. NOTE: a factory function, not a bound constructor: on the GPU
// machine's torch 2.11 build an exception thrown out of a pybind11 constructor crashed the process,
// while one thrown out of a function or method becomes a RuntimeError.
OutputGroup make_output_group(const std::vector<SpecArgument>& specs, const at::Device& device) {
  std::vector<OutputSpec> checked;
  for (const auto& [sizes, strides, dtype] : specs) {
    for (int64_t extent : sizes)
      TORCH_CHECK(extent >= 0 || extent == kRows, "OutputGroup: extent ", extent, " (use -1 for the rows)");
    if (strides) {
      TORCH_CHECK(strides->size() == sizes.size(), "OutputGroup: ", strides->size(), " strides for ", sizes.size(),
                  " sizes");
      for (int64_t extent : sizes) TORCH_CHECK(extent != kRows, "OutputGroup: strided outputs have fixed sizes");
    }
    checked.push_back(OutputSpec{sizes, strides.value_or(std::vector<int64_t>{}), dtype});
  }
  return OutputGroup(std::move(checked), device);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ep_plugin's outputs allocated by torch's caching allocator from C++ (csrc/torch_outputs.cpp).";
  pybind11::class_<OutputGroup>(m, "OutputGroup", "A call's outputs on one device (made by output_group).")
      .def("empty", &OutputGroup::empty, pybind11::arg("rows") = 0,
           "Uninitialised tensors, one per spec, with every -1 extent set to `rows`, on the current stream.")
      .def("__repr__", &OutputGroup::describe);
  m.def("output_group", &make_output_group, pybind11::arg("specs"), pybind11::arg("device"),
        "An OutputGroup of `specs`, (sizes, strides or None, dtype) each; an extent of -1 is the row count "
        "given to its empty().");
}
