// ep_plugin._C_nvshmem: a thin pybind11 face over the low-latency (NVSHMEM) core.
//
// A separate module from ep_plugin._C so that the intranode kernels build and import where NVSHMEM
// is absent. Tensors cross as raw device addresses (ints) with their sizes; ep_plugin/backends/
// native.py checks dtypes, shapes and devices and allocates outputs with torch. Here each address is
// checked for presence and alignment, naming the argument, before anything is launched.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "common/exception.cuh"
#include "kernels/low_latency_layout.cuh"
#include "nvshmem_runtime.cuh"

namespace py = pybind11;
using namespace ep_plugin;
using low_latency::LowLatencyLayout;

namespace {

template <typename T>
T* pointer(uintptr_t address, const char* name, bool required = true, int alignment = alignof(T)) {
  EP_CHECK_ARG(!required || address != 0, name << " is required (got a null address)");
  EP_CHECK_ARG(address % alignment == 0, name << " must be " << alignment << "-byte aligned");
  return reinterpret_cast<T*>(address);
}

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

LowLatencyLayout make_layout(int num_max_tokens, int hidden, int num_ranks, int num_experts) {
  EP_CHECK_ARG(num_max_tokens >= 1, "num_max_dispatch_tokens_per_rank must be positive, got " << num_max_tokens);
  EP_CHECK_ARG(hidden > 0 && hidden % 8 == 0, "hidden must be a positive multiple of 8, got " << hidden);
  EP_CHECK_ARG(num_ranks >= 1, "num_ranks must be positive, got " << num_ranks);
  EP_CHECK_ARG(num_experts > 0 && num_experts % num_ranks == 0,
               "num_experts (" << num_experts << ") must be a positive multiple of num_ranks (" << num_ranks << ")");
  return LowLatencyLayout{num_max_tokens, hidden, num_ranks, num_experts};
}

int64_t size_hint(int num_max_tokens, int hidden, int num_ranks, int num_experts) {
  return make_layout(num_max_tokens, hidden, num_ranks, num_experts).total_bytes();
}

void runtime_dispatch(LowLatencyRuntime& runtime, int parity, int phases, int num_max_tokens, int hidden,
                      int num_experts, uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk, bool use_fp8,
                      bool round_scale, bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_count,
                      uintptr_t recv_src_info, uintptr_t recv_layout, uintptr_t cumulative_stats, uintptr_t stream) {
  low_latency::DispatchArgs args{};
  args.layout = make_layout(num_max_tokens, hidden, runtime.num_ranks(), num_experts);
  args.phases = phases;
  const bool send = (phases & low_latency::kPhaseSend) != 0;
  args.x = pointer<const uint8_t>(x, "x", send && num_tokens > 0, 16);
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", send && num_tokens > 0);
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.use_fp8 = use_fp8;
  args.round_scale = round_scale;
  args.use_ue8m0 = use_ue8m0;
  args.recv_x = pointer<uint8_t>(recv_x, "recv_x", true, 16);
  args.recv_scales = pointer<uint8_t>(recv_scales, "recv_scales", use_fp8, 4);
  args.recv_count = pointer<int32_t>(recv_count, "recv_count");
  args.recv_src_info = pointer<int32_t>(recv_src_info, "recv_src_info");
  args.recv_layout = pointer<int64_t>(recv_layout, "recv_layout");
  args.cumulative_stats = pointer<int32_t>(cumulative_stats, "cumulative_local_expert_recv_stats", false);
  runtime.dispatch(args, parity, as_stream(stream));
}

void runtime_combine(LowLatencyRuntime& runtime, int parity, int phases, int num_max_tokens, int hidden,
                     int num_experts, uintptr_t x, uintptr_t recv_src_info, uintptr_t recv_layout, uintptr_t topk_idx,
                     uintptr_t topk_weights, int num_tokens, int num_topk, uintptr_t out, uintptr_t stream) {
  low_latency::CombineArgs args{};
  args.layout = make_layout(num_max_tokens, hidden, runtime.num_ranks(), num_experts);
  args.phases = phases;
  const bool recv = (phases & low_latency::kPhaseRecv) != 0;
  args.x = pointer<const uint8_t>(x, "x", true, 16);
  args.recv_src_info = pointer<const int32_t>(recv_src_info, "handle.recv_src_info");
  args.recv_layout = pointer<const int64_t>(recv_layout, "handle.recv_layout");
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", recv && num_tokens > 0);
  args.topk_weights = pointer<const float>(topk_weights, "topk_weights", recv && num_tokens > 0);
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.out = pointer<uint8_t>(out, "out", recv && num_tokens > 0, 16);
  runtime.combine(args, parity, as_stream(stream));
}

}  // namespace

PYBIND11_MODULE(_C_nvshmem, m) {
  m.doc() = "ep_plugin low-latency kernels over NVSHMEM (framework-free core; tensors pass as device addresses)";

  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const ep_plugin::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const ep_plugin::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  m.attr("MAX_TOPK") = low_latency::kMaxTopk;
  m.attr("MAX_EXPERTS") = low_latency::kMaxExperts;
  m.attr("MAX_RANKS") = low_latency::kMaxRanks;
  m.attr("MAX_TOKENS") = low_latency::kMaxTokens;
  m.attr("HEADER_BYTES") = low_latency::kHeaderBytes;
  m.attr("PHASE_SEND") = static_cast<int>(low_latency::kPhaseSend);
  m.attr("PHASE_RECV") = static_cast<int>(low_latency::kPhaseRecv);

  m.def("size_hint", &size_hint, py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
        py::arg("num_experts"), "Symmetric-buffer bytes for these sizes (pure function, no GPU needed).");
  m.def("create_unique_id", [] { return py::bytes(LowLatencyRuntime::create_unique_id()); },
        "A fresh NVSHMEM unique id (create on rank 0, send to every rank).");

  py::class_<LowLatencyRuntime>(m, "LowLatencyRuntime")
      .def(py::init([](int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s, const py::bytes& unique_id) {
             std::string id = unique_id;
             py::gil_scoped_release release;  // a collective: other Python threads may run meanwhile
             return new LowLatencyRuntime(rank, num_ranks, num_rdma_bytes, timeout_s, id);
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("num_rdma_bytes"), py::arg("timeout_s"),
           py::arg("unique_id"))
      .def_property_readonly("num_rdma_bytes", &LowLatencyRuntime::num_rdma_bytes)
      .def_property_readonly("num_blocks", &LowLatencyRuntime::num_blocks)
      .def("direct_peers", &LowLatencyRuntime::direct_peers)
      .def("check_device_error", &LowLatencyRuntime::check_device_error)
      .def("clean", [](LowLatencyRuntime& self, uintptr_t stream) { self.clean(as_stream(stream)); },
           py::arg("stream"))
      .def("destroy", [](LowLatencyRuntime& self, bool collective) {
             py::gil_scoped_release release;
             self.destroy(collective);
           }, py::arg("collective"))
      .def("combine_buffer_address", [](const LowLatencyRuntime& self, int parity, int num_max_tokens, int hidden,
                                        int num_experts) {
             return self.combine_buffer_address(parity, make_layout(num_max_tokens, hidden, self.num_ranks(),
                                                                    num_experts));
           }, py::arg("parity"), py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"),
           py::arg("num_experts"))
      .def("dispatch", &runtime_dispatch, py::arg("parity"), py::arg("phases"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"), py::arg("x"),
           py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("use_fp8"),
           py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("recv_x"), py::arg("recv_scales"),
           py::arg("recv_count"), py::arg("recv_src_info"), py::arg("recv_layout"),
           py::arg("cumulative_local_expert_recv_stats"), py::arg("stream"))
      .def("combine", &runtime_combine, py::arg("parity"), py::arg("phases"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"), py::arg("x"),
           py::arg("recv_src_info"), py::arg("recv_layout"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("num_tokens"), py::arg("num_topk"), py::arg("out"), py::arg("stream"));
}
