// ep_plugin._C_nvshmem: a thin pybind11 face over the NVSHMEM cores: low-latency mode and the network
// leg of internode normal mode.
//
// A separate module from ep_plugin._C so that the intranode kernels build and import where NVSHMEM
// is absent. Tensors cross as raw device addresses (ints) with their sizes; ep_plugin/backends/
// native.py checks dtypes, shapes and devices and allocates outputs with torch. Here each address is
// checked for presence and alignment, naming the argument, before anything is launched.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "common/binding.h"
#include "common/exception.cuh"
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

void runtime_dispatch(LowLatencyRuntime& runtime, int parity, int phases, int num_max_tokens, int hidden,
                      int num_experts, uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk, bool use_fp8,
                      bool round_scale, bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_count,
                      uintptr_t recv_src_info, uintptr_t recv_layout, uintptr_t cumulative_stats,
                      bool carry_route, bool bf16_partials, uintptr_t route_weights, uintptr_t stream) {
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
  args.carry_route = carry_route;
  args.bf16_partials = bf16_partials;
  args.topk_weights = pointer<const float>(route_weights, "topk_weights", carry_route && send && num_tokens > 0);
  runtime.dispatch(args, parity, as_stream(stream));
}

void runtime_combine(LowLatencyRuntime& runtime, int parity, int phases, int num_max_tokens, int hidden,
                     int num_experts, uintptr_t x, uintptr_t recv_src_info, uintptr_t recv_layout, uintptr_t topk_idx,
                     uintptr_t topk_weights, int num_tokens, int num_topk, uintptr_t out, bool expert_sums,
                     bool bf16_partials, uintptr_t stream) {
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
  args.expert_sums = expert_sums;
  args.bf16_partials = bf16_partials;
  runtime.combine(args, parity, as_stream(stream));
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

// Blocks per half of a network-leg launch: each serves num_channels / num_blocks channels.
int checked_num_blocks(int num_channels, int num_blocks) {
  EP_CHECK_ARG(num_blocks >= 1 && num_channels % num_blocks == 0,
               "num_blocks must divide num_channels (" << num_channels << "), got " << num_blocks);
  return num_blocks;
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

void internode_notify(InternodeRuntime& runtime, int num_channels, int num_tokens, uintptr_t is_token_in_node,
                      int row_bytes, int num_scales, int num_topk, bool has_weights, uintptr_t send_counts,
                      uintptr_t recv_offsets, uintptr_t num_recv, int capacity, int host_tag, uintptr_t stream) {
  internode::NotifyArgs args{};
  args.num_channels = num_channels;
  args.num_tokens = num_tokens;
  args.is_token_in_node = pointer<const bool>(is_token_in_node, "is_token_in_node", num_tokens > 0);
  args.row_bytes = row_bytes;
  args.num_scales = num_scales;
  args.num_topk = num_topk;
  args.has_weights = has_weights ? 1 : 0;
  args.send_counts = pointer<int32_t>(send_counts, "send_counts");
  args.recv_offsets = pointer<int32_t>(recv_offsets, "recv_offsets");
  args.num_recv = pointer<int32_t>(num_recv, "num_recv");
  args.capacity = capacity;
  args.host_tag = host_tag;
  runtime.notify(args, as_stream(stream));
}

void internode_dispatch(InternodeRuntime& runtime, int num_channels, int num_blocks, int ring_slots, int send_chunk,
                        int64_t slot_bytes, int num_tokens, int row_bytes, int num_scales, int num_topk, bool has_weights, uintptr_t x,
                        uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t is_token_in_node,
                        uintptr_t send_pos, uintptr_t recv_offsets, int capacity, uintptr_t recv_x,
                        uintptr_t recv_x_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights,
                        uintptr_t recv_src_idx, uintptr_t stream) {
  internode::DispatchArgs args{};
  args.layout = make_internode_layout(runtime.num_nodes(), num_channels, ring_slots, slot_bytes);
  args.num_blocks = checked_num_blocks(num_channels, num_blocks);
  EP_CHECK_ARG(send_chunk >= 1, "num_max_rdma_chunked_send_tokens must be positive, got " << send_chunk);
  args.send_chunk = send_chunk;
  args.slot = make_dispatch_slot(row_bytes, num_scales, num_topk, has_weights);
  EP_CHECK_ARG(args.slot.bytes() <= slot_bytes, "slot_bytes " << slot_bytes << " < " << args.slot.bytes());
  EP_CHECK_ARG(capacity >= 0, "capacity must be non-negative");
  const bool send = num_tokens > 0, recv = capacity > 0;
  args.num_tokens = num_tokens;
  args.x = pointer<const uint8_t>(x, "x", send, 16);
  args.x_scales = pointer<const float>(x_scales, "x_scales", send && num_scales > 0);
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", send && num_topk > 0);
  args.topk_weights = pointer<const float>(topk_weights, "topk_weights", send && num_topk > 0 && has_weights);
  args.is_token_in_node = pointer<const bool>(is_token_in_node, "is_token_in_node", send);
  args.send_pos = pointer<int32_t>(send_pos, "send_pos", false);
  args.recv_offsets = pointer<const int32_t>(recv_offsets, "recv_offsets");
  args.capacity = capacity;
  args.recv_x = pointer<uint8_t>(recv_x, "recv_x", recv, 16);
  args.recv_x_scales = pointer<float>(recv_x_scales, "recv_x_scales", recv && num_scales > 0);
  args.recv_topk_idx = pointer<int64_t>(recv_topk_idx, "recv_topk_idx", false);
  args.recv_topk_weights = pointer<float>(recv_topk_weights, "recv_topk_weights", false);
  args.recv_src_idx = pointer<int32_t>(recv_src_idx, "recv_src_idx", false);
  runtime.dispatch(args, as_stream(stream));
}

void internode_combine(InternodeRuntime& runtime, int num_channels, int num_blocks, int ring_slots, int send_chunk,
                       int64_t slot_bytes,
                       int hidden,
                       int num_topk, int capacity, uintptr_t partial_x, uintptr_t partial_weights,
                       uintptr_t recv_offsets, int num_tokens, uintptr_t is_token_in_node, uintptr_t send_pos,
                       uintptr_t send_counts, uintptr_t bias_0, uintptr_t bias_1, uintptr_t combined_x,
                       uintptr_t combined_weights, uintptr_t stream) {
  internode::CombineArgs args{};
  args.layout = make_internode_layout(runtime.num_nodes(), num_channels, ring_slots, slot_bytes);
  args.num_blocks = checked_num_blocks(num_channels, num_blocks);
  EP_CHECK_ARG(send_chunk >= 1, "num_max_rdma_chunked_send_tokens must be positive, got " << send_chunk);
  args.send_chunk = send_chunk;
  EP_CHECK_ARG(hidden > 0 && hidden % 8 == 0, "hidden must be a positive multiple of 8, got " << hidden);
  EP_CHECK_ARG(num_topk >= 0 && num_topk <= internode::kMaxTopk, "top-k must be in [0, " << internode::kMaxTopk << "]");
  args.slot = internode::CombineSlot{hidden, num_topk};
  EP_CHECK_ARG(args.slot.bytes() <= slot_bytes, "slot_bytes " << slot_bytes << " < " << args.slot.bytes());
  args.capacity = capacity;
  args.partial_x = pointer<const uint8_t>(partial_x, "partial_x", capacity > 0, 16);
  args.partial_weights = pointer<const float>(partial_weights, "partial_weights", capacity > 0 && num_topk > 0);
  args.recv_offsets = pointer<const int32_t>(recv_offsets, "handle.recv_offsets");
  args.num_tokens = num_tokens;
  args.is_token_in_node = pointer<const bool>(is_token_in_node, "handle.is_token_in_node", num_tokens > 0);
  args.send_pos = pointer<const int32_t>(send_pos, "handle.send_pos", num_tokens > 0);
  args.send_counts = pointer<const int32_t>(send_counts, "handle.send_counts");
  args.bias_0 = pointer<const uint8_t>(bias_0, "bias_0", false, 16);
  args.bias_1 = pointer<const uint8_t>(bias_1, "bias_1", false, 16);
  args.combined_x = pointer<uint8_t>(combined_x, "combined_x", num_tokens > 0, 16);
  args.combined_weights = pointer<float>(combined_weights, "combined_topk_weights", false);
  runtime.combine(args, as_stream(stream));
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
           py::arg("cumulative_local_expert_recv_stats"), py::arg("carry_route"),
           py::arg("bf16_partials"), py::arg("route_weights"), py::arg("stream"))
      .def("combine", &runtime_combine, py::arg("parity"), py::arg("phases"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"), py::arg("x"),
           py::arg("recv_src_info"), py::arg("recv_layout"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("num_tokens"), py::arg("num_topk"), py::arg("out"), py::arg("expert_sums"),
           py::arg("bf16_partials"), py::arg("stream"))
      .def("supports_expert_sums", &LowLatencyRuntime::supports_expert_sums, py::arg("num_max_dispatch_tokens_per_rank"),
           py::arg("hidden"), py::arg("num_experts"));

  // ---- internode normal mode (network leg) ----
  m.attr("INTERNODE_HEADER_BYTES") = internode::kHeaderBytes;
  m.attr("INTERNODE_MAX_NODES") = internode::kMaxNodes;
  m.attr("INTERNODE_MAX_CHANNELS") = internode::kMaxChannels;
  m.attr("INTERNODE_WARPS_PER_BLOCK") = internode::kWarps;
  m.attr("INTERNODE_SLOT_EXTRA_BYTES") = internode::kSlotExtraBytes;
  m.def("internode_size_hint", &internode_size_hint, py::arg("hidden_bytes"), py::arg("num_nodes"),
        py::arg("num_channels"), py::arg("ring_slots"),
        "Symmetric-buffer bytes of internode normal mode for these sizes (pure function, no GPU needed).");
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
      .def("notify", &internode_notify, py::arg("num_channels"), py::arg("num_tokens"), py::arg("is_token_in_node"),
           py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"), py::arg("has_weights"),
           py::arg("send_counts"), py::arg("recv_offsets"), py::arg("num_recv"), py::arg("capacity"),
           py::arg("host_tag"), py::arg("stream"))
      .def("wait_notify", [](InternodeRuntime& self, int tag, uintptr_t stream) {
             py::gil_scoped_release release;
             return self.wait_notify(tag, as_stream(stream));
           }, py::arg("tag"), py::arg("stream"))
      .def("dispatch", &internode_dispatch, py::arg("num_channels"), py::arg("num_blocks"), py::arg("ring_slots"),
           py::arg("send_chunk"), py::arg("slot_bytes"),
           py::arg("num_tokens"), py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"),
           py::arg("has_weights"), py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("is_token_in_node"), py::arg("send_pos"), py::arg("recv_offsets"), py::arg("capacity"),
           py::arg("recv_x"), py::arg("recv_x_scales"), py::arg("recv_topk_idx"), py::arg("recv_topk_weights"),
           py::arg("recv_src_idx"), py::arg("stream"))
      .def("combine", &internode_combine, py::arg("num_channels"), py::arg("num_blocks"), py::arg("ring_slots"),
           py::arg("send_chunk"), py::arg("slot_bytes"),
           py::arg("hidden"), py::arg("num_topk"), py::arg("capacity"), py::arg("partial_x"),
           py::arg("partial_weights"), py::arg("recv_offsets"), py::arg("num_tokens"), py::arg("is_token_in_node"),
           py::arg("send_pos"), py::arg("send_counts"), py::arg("bias_0"), py::arg("bias_1"),
           py::arg("combined_x"), py::arg("combined_weights"), py::arg("stream"));
}
