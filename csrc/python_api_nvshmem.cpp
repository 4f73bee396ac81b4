// ep_plugin._C_nvshmem: a thin pybind11 face over the NVSHMEM cores: low-latency mode and the network
// leg of internode normal mode.
//
// A separate module from ep_plugin._C so that the intranode kernels build and import where NVSHMEM
// is absent. Tensors cross as raw device addresses (ints) with their sizes; ep_plugin/backends checks
// dtypes, shapes and devices and allocates outputs with torch. Each operation takes its Args struct,
// bound here field by field; the runtime checks every address for presence and alignment, naming the
// argument, before anything is launched.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "common/binding.h"
#include "common/exception.cuh"
#include "common/low_latency_launchers.h"
#include "kernels/internode_layout.cuh"
#include "kernels/low_latency_layout.cuh"
#include "nvshmem_runtime.cuh"

namespace py = pybind11;
using namespace ep_plugin;
using low_latency::LowLatencyLayout;

namespace {

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

// Binds field `member` of Args as an integer device address (0: null); the runtime checks it.
template <typename Args, typename T>
void bind_address(py::class_<Args>& cls, const char* name, T* Args::*member) {
  cls.def_property(
      name, [member](const Args& self) { return reinterpret_cast<uintptr_t>(self.*member); },
      [member](Args& self, uintptr_t address) { self.*member = reinterpret_cast<T*>(address); });
}

// The layout's sizes the caller gives (the runtime fills num_ranks and checks them).
template <typename Args>
void bind_layout_sizes(py::class_<Args>& cls) {
  cls.def_property(
         "num_max_dispatch_tokens_per_rank", [](const Args& self) { return self.layout.num_max_tokens; },
         [](Args& self, int value) { self.layout.num_max_tokens = value; })
      .def_property(
          "hidden", [](const Args& self) { return self.layout.hidden; },
          [](Args& self, int value) { self.layout.hidden = value; })
      .def_property(
          "num_experts", [](const Args& self) { return self.layout.num_experts; },
          [](Args& self, int value) { self.layout.num_experts = value; });
}

// The fields the caller fills (low_latency_layout.cuh says what each holds); the runtime fills the rest.
void bind_low_latency_dispatch_args(py::module_& m) {
  using Args = low_latency::DispatchArgs;
  py::class_<Args> cls(m, "DispatchArgs", "Arguments of LowLatencyRuntime.dispatch (low_latency_layout.cuh).");
  cls.def(py::init<>())
      .def_readwrite("phases", &Args::phases)
      .def_readwrite("num_tokens", &Args::num_tokens)
      .def_readwrite("num_topk", &Args::num_topk)
      .def_readwrite("use_fp8", &Args::use_fp8)
      .def_readwrite("round_scale", &Args::round_scale)
      .def_readwrite("use_ue8m0", &Args::use_ue8m0)
      .def_readwrite("carry_route", &Args::carry_route)
      .def_readwrite("bf16_partials", &Args::bf16_partials);
  bind_layout_sizes(cls);
  bind_address(cls, "x", &Args::x);
  bind_address(cls, "topk_idx", &Args::topk_idx);
  bind_address(cls, "recv_x", &Args::recv_x);
  bind_address(cls, "recv_scales", &Args::recv_scales);
  bind_address(cls, "recv_count", &Args::recv_count);
  bind_address(cls, "recv_src_info", &Args::recv_src_info);
  bind_address(cls, "recv_layout", &Args::recv_layout);
  bind_address(cls, "cumulative_local_expert_recv_stats", &Args::cumulative_stats);
  bind_address(cls, "topk_weights", &Args::topk_weights);
  bind_address(cls, "rank_mask", &Args::rank_mask);
}

void bind_low_latency_combine_args(py::module_& m) {
  using Args = low_latency::CombineArgs;
  py::class_<Args> cls(m, "CombineArgs", "Arguments of LowLatencyRuntime.combine (low_latency_layout.cuh).");
  cls.def(py::init<>())
      .def_readwrite("phases", &Args::phases)
      .def_readwrite("num_tokens", &Args::num_tokens)
      .def_readwrite("num_topk", &Args::num_topk)
      .def_readwrite("expert_sums", &Args::expert_sums)
      .def_readwrite("bf16_partials", &Args::bf16_partials);
  bind_layout_sizes(cls);
  bind_address(cls, "x", &Args::x);
  bind_address(cls, "recv_src_info", &Args::recv_src_info);
  bind_address(cls, "recv_layout", &Args::recv_layout);
  bind_address(cls, "topk_idx", &Args::topk_idx);
  bind_address(cls, "topk_weights", &Args::topk_weights);
  bind_address(cls, "out", &Args::out);
  bind_address(cls, "rank_mask", &Args::rank_mask);
}

// ---- internode ----------------------------------------------------------------------------------
internode::InternodeLayout make_internode_layout(int num_nodes, int num_channels, int ring_slots, int64_t slot_bytes) {
  EP_CHECK_ARG(num_nodes >= 1 && num_nodes <= internode::kMaxNodes,
               "num_nodes must be in [1, " << internode::kMaxNodes << "], got " << num_nodes);
  EP_CHECK_ARG(num_channels >= 1 && num_channels <= internode::kMaxChannels,
               "num_channels must be in [1, " << internode::kMaxChannels << "], got " << num_channels);
  EP_CHECK_ARG(ring_slots >= 1, "num_max_rdma_chunked_recv_tokens must be positive, got " << ring_slots);
  EP_CHECK_ARG(slot_bytes > 0 && slot_bytes % 16 == 0, "slot bytes must be a positive multiple of 16");
  return internode::InternodeLayout{num_nodes, num_channels, ring_slots, slot_bytes};
}

int64_t internode_size_hint(int64_t hidden_bytes, int num_nodes, int num_channels, int ring_slots) {
  EP_CHECK_ARG(hidden_bytes > 0, "hidden_bytes must be positive, got " << hidden_bytes);
  return make_internode_layout(num_nodes, num_channels, ring_slots, internode::hint_slot_bytes(hidden_bytes))
      .total_bytes();
}

internode::DispatchSlot make_dispatch_slot(int row_bytes, int num_scales, int num_topk, bool has_weights) {
  EP_CHECK_ARG(row_bytes > 0 && row_bytes % 16 == 0, "rows must be a positive multiple of 16 bytes, got " << row_bytes);
  EP_CHECK_ARG(num_scales >= 0, "num_scales must be non-negative");
  EP_CHECK_ARG(num_topk >= 0 && num_topk <= internode::kMaxTopk,
               "top-k must be in [0, " << internode::kMaxTopk << "], got " << num_topk);
  return internode::DispatchSlot{row_bytes, num_scales, num_topk, has_weights ? 1 : 0};
}

// The network leg's Args: the ring layout's and the slot's sizes the caller gives, field by field.
template <typename Args>
void bind_ring_sizes(py::class_<Args>& cls) {
  cls.def_property(
         "num_channels", [](const Args& self) { return self.layout.num_channels; },
         [](Args& self, int value) { self.layout.num_channels = value; })
      .def_property(
          "ring_slots", [](const Args& self) { return self.layout.ring_slots; },
          [](Args& self, int value) { self.layout.ring_slots = value; })
      .def_property(
          "slot_bytes", [](const Args& self) { return self.layout.slot_bytes; },
          [](Args& self, int64_t value) { self.layout.slot_bytes = value; })
      .def_readwrite("num_blocks", &Args::num_blocks)
      .def_readwrite("send_chunk", &Args::send_chunk);
}

template <typename Args, typename Slot>
void bind_slot_field(py::class_<Args>& cls, const char* name, int Slot::*member) {
  cls.def_property(
      name, [member](const Args& self) { return self.slot.*member; },
      [member](Args& self, int value) { self.slot.*member = value; });
}

void bind_internode_args(py::module_& m) {
  {
    using Args = internode::NotifyArgs;
    py::class_<Args> cls(m, "InternodeNotifyArgs", "Arguments of InternodeRuntime.notify (internode_layout.cuh).");
    cls.def(py::init<>())
        .def_readwrite("num_channels", &Args::num_channels)
        .def_readwrite("num_tokens", &Args::num_tokens)
        .def_readwrite("row_bytes", &Args::row_bytes)
        .def_readwrite("num_scales", &Args::num_scales)
        .def_readwrite("num_topk", &Args::num_topk)
        .def_readwrite("has_weights", &Args::has_weights)
        .def_readwrite("capacity", &Args::capacity)
        .def_readwrite("host_tag", &Args::host_tag);
    bind_address(cls, "is_token_in_node", &Args::is_token_in_node);
    bind_address(cls, "send_counts", &Args::send_counts);
    bind_address(cls, "recv_offsets", &Args::recv_offsets);
    bind_address(cls, "num_recv", &Args::num_recv);
  }
  {
    using Args = internode::DispatchArgs;
    py::class_<Args> cls(m, "InternodeDispatchArgs", "Arguments of InternodeRuntime.dispatch (internode_layout.cuh).");
    cls.def(py::init<>())
        .def_readwrite("num_tokens", &Args::num_tokens)
        .def_readwrite("capacity", &Args::capacity);
    bind_ring_sizes(cls);
    bind_slot_field(cls, "row_bytes", &internode::DispatchSlot::row_bytes);
    bind_slot_field(cls, "num_scales", &internode::DispatchSlot::num_scales);
    bind_slot_field(cls, "num_topk", &internode::DispatchSlot::num_topk);
    bind_slot_field(cls, "has_weights", &internode::DispatchSlot::has_weights);
    bind_address(cls, "x", &Args::x);
    bind_address(cls, "x_scales", &Args::x_scales);
    bind_address(cls, "topk_idx", &Args::topk_idx);
    bind_address(cls, "topk_weights", &Args::topk_weights);
    bind_address(cls, "is_token_in_node", &Args::is_token_in_node);
    bind_address(cls, "send_pos", &Args::send_pos);
    bind_address(cls, "recv_offsets", &Args::recv_offsets);
    bind_address(cls, "recv_x", &Args::recv_x);
    bind_address(cls, "recv_x_scales", &Args::recv_x_scales);
    bind_address(cls, "recv_topk_idx", &Args::recv_topk_idx);
    bind_address(cls, "recv_topk_weights", &Args::recv_topk_weights);
    bind_address(cls, "recv_src_idx", &Args::recv_src_idx);
  }
  {
    using Args = internode::CombineArgs;
    py::class_<Args> cls(m, "InternodeCombineArgs", "Arguments of InternodeRuntime.combine (internode_layout.cuh).");
    cls.def(py::init<>())
        .def_readwrite("capacity", &Args::capacity)
        .def_readwrite("num_tokens", &Args::num_tokens);
    bind_ring_sizes(cls);
    bind_slot_field(cls, "hidden", &internode::CombineSlot::hidden);
    bind_slot_field(cls, "num_topk", &internode::CombineSlot::num_topk);
    bind_address(cls, "partial_x", &Args::partial_x);
    bind_address(cls, "partial_weights", &Args::partial_weights);
    bind_address(cls, "recv_offsets", &Args::recv_offsets);
    bind_address(cls, "is_token_in_node", &Args::is_token_in_node);
    bind_address(cls, "send_pos", &Args::send_pos);
    bind_address(cls, "send_counts", &Args::send_counts);
    bind_address(cls, "bias_0", &Args::bias_0);
    bind_address(cls, "bias_1", &Args::bias_1);
    bind_address(cls, "combined_x", &Args::combined_x);
    bind_address(cls, "combined_topk_weights", &Args::combined_weights);
  }
}

// ---- the launchers of the eager fast path (common/low_latency_launchers.h) ----
// Each copies the template Args, fills the call's addresses and launches send + receive. Nothing
// throws out of them: any failure (a pending report, a check of the runtime) launches nothing and
// returns false, and the checked path runs the call again and raises what stopped it.
template <typename Args, typename Fill>
bool launch_unchecked(void* runtime_object, void* args_object, int parity, uintptr_t stream, Fill fill,
                      void (LowLatencyRuntime::*launch)(Args, int, cudaStream_t)) noexcept {
  try {
    auto& runtime = py::handle(static_cast<PyObject*>(runtime_object)).cast<LowLatencyRuntime&>();
    // NOTE: an error left by an earlier CUDA call would fail the check after the launch, which then
    // did launch: such a call takes the checked path (which reports it), so that a failure here
    // always means nothing was launched.
    if (!runtime.nothing_to_report() || cudaPeekAtLastError() != cudaSuccess) return false;
    Args args = py::handle(static_cast<PyObject*>(args_object)).cast<const Args&>();
    fill(args);
    args.phases = low_latency::kPhaseSend | low_latency::kPhaseRecv;
    (runtime.*launch)(args, parity, as_stream(stream));
    return true;
  } catch (...) {  // the runtime's checks come before its launch, and the launch's own error after it
    return false;
  }
}

bool dispatch_unchecked(void* runtime, void* args, const low_latency::DispatchCall& call, int parity,
                        uintptr_t stream) noexcept {
  return launch_unchecked<low_latency::DispatchArgs>(runtime, args, parity, stream, [&](low_latency::DispatchArgs& a) {
    a.x = call.x;
    a.topk_idx = call.topk_idx;
    a.num_tokens = call.num_tokens;
    a.recv_x = call.recv_x;
    a.recv_scales = call.recv_scales;
    a.recv_count = call.recv_count;
    a.recv_src_info = call.recv_src_info;
    a.recv_layout = call.recv_layout;
    a.cumulative_stats = call.cumulative_stats;
  }, &LowLatencyRuntime::dispatch);
}

bool combine_unchecked(void* runtime, void* args, const low_latency::CombineCall& call, int parity,
                       uintptr_t stream) noexcept {
  return launch_unchecked<low_latency::CombineArgs>(runtime, args, parity, stream, [&](low_latency::CombineArgs& a) {
    a.x = call.x;
    a.recv_src_info = call.recv_src_info;
    a.recv_layout = call.recv_layout;
    a.topk_idx = call.topk_idx;
    a.topk_weights = call.topk_weights;
    a.out = call.out;
    a.num_tokens = call.num_tokens;
  }, &LowLatencyRuntime::combine);
}

const low_latency::LowLatencyLaunchers kLaunchers{&dispatch_unchecked, &combine_unchecked};

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
  bind_low_latency_dispatch_args(m);
  bind_low_latency_combine_args(m);
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
      .def("dispatch", [](LowLatencyRuntime& self, const low_latency::DispatchArgs& args, int parity,
                          uintptr_t stream) { self.dispatch(args, parity, as_stream(stream)); },
           py::arg("args"), py::arg("parity"), py::arg("stream"))
      .def("combine", [](LowLatencyRuntime& self, const low_latency::CombineArgs& args, int parity,
                         uintptr_t stream) { self.combine(args, parity, as_stream(stream)); },
           py::arg("args"), py::arg("parity"), py::arg("stream"))
      .def("supports_expert_sums", &LowLatencyRuntime::supports_expert_sums, py::arg("num_max_dispatch_tokens_per_rank"),
           py::arg("hidden"), py::arg("num_experts"));

  // NOTE: const_cast: a capsule holds a void*; the table is only read (by ep_plugin._C_torch).
  m.attr("low_latency_launchers") = py::capsule(const_cast<low_latency::LowLatencyLaunchers*>(&kLaunchers),
                                                low_latency::kLowLatencyLaunchersName);

  // ---- internode normal mode (network leg) ----
  m.attr("INTERNODE_HEADER_BYTES") = internode::kHeaderBytes;
  m.attr("INTERNODE_MAX_NODES") = internode::kMaxNodes;
  m.attr("INTERNODE_MAX_CHANNELS") = internode::kMaxChannels;
  m.attr("INTERNODE_WARPS_PER_BLOCK") = internode::kWarps;
  m.attr("INTERNODE_SLOT_EXTRA_BYTES") = internode::kSlotExtraBytes;
  m.def("internode_size_hint", &internode_size_hint, py::arg("hidden_bytes"), py::arg("num_nodes"),
        py::arg("num_channels"), py::arg("ring_slots"),
        "Symmetric-buffer bytes of internode normal mode for these sizes (pure function, no GPU needed).");
  bind_internode_args(m);
  m.def("internode_dispatch_slot_bytes", [](int row_bytes, int num_scales, int num_topk, bool has_weights) {
          return make_dispatch_slot(row_bytes, num_scales, num_topk, has_weights).bytes();
        }, py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"), py::arg("has_weights"));
  m.def("internode_combine_slot_bytes", [](int hidden, int num_topk) {
          return internode::CombineSlot{hidden, num_topk}.bytes();
        }, py::arg("hidden"), py::arg("num_topk"));

  py::class_<InternodeRuntime>(m, "InternodeRuntime")
      .def(py::init([](int rank, int num_ranks, int ranks_per_node, int64_t num_rdma_bytes, double timeout_s,
                       const py::bytes& unique_id, bool force_puts) {
             std::string id = unique_id;
             py::gil_scoped_release release;  // a collective: other Python threads may run meanwhile
             return new InternodeRuntime(rank, num_ranks, ranks_per_node, num_rdma_bytes, timeout_s, id, force_puts);
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("num_rdma_bytes"),
           py::arg("timeout_s"), py::arg("unique_id"), py::arg("force_puts") = false)
      .def_property_readonly("num_rdma_bytes", &InternodeRuntime::num_rdma_bytes)
      .def_property_readonly("num_nodes", &InternodeRuntime::num_nodes)
      .def("direct_peers", &InternodeRuntime::direct_peers)
      .def_property_readonly("puts_only", &InternodeRuntime::puts_only)
      .def("check_device_error", &InternodeRuntime::check_device_error)
      .def("destroy", [](InternodeRuntime& self, bool collective) {
             py::gil_scoped_release release;
             self.destroy(collective);
           }, py::arg("collective"))
      .def("barrier", [](InternodeRuntime& self, uintptr_t stream) { self.barrier(as_stream(stream)); },
           py::arg("stream"))
      .def("notify", [](InternodeRuntime& self, const internode::NotifyArgs& args,
                        uintptr_t stream) { self.notify(args, as_stream(stream)); },
           py::arg("args"), py::arg("stream"))
      .def("wait_notify", [](InternodeRuntime& self, int tag, uintptr_t stream) {
             py::gil_scoped_release release;
             return self.wait_notify(tag, as_stream(stream));
           }, py::arg("tag"), py::arg("stream"))
      .def("dispatch", [](InternodeRuntime& self, const internode::DispatchArgs& args,
                          uintptr_t stream) { self.dispatch(args, as_stream(stream)); },
           py::arg("args"), py::arg("stream"))
      .def("combine", [](InternodeRuntime& self, const internode::CombineArgs& args,
                         uintptr_t stream) { self.combine(args, as_stream(stream)); },
           py::arg("args"), py::arg("stream"));
}
