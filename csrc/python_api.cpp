// ep_plugin._C: a thin pybind11 face over the framework-free core.
//
// Tensors cross as raw device addresses (ints) with their sizes; ep_plugin/backends/native.py
// checks dtypes, shapes and devices and allocates outputs with torch. Here each address is checked
// for presence and alignment, naming the argument, before anything is launched.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/binding.h"
#include "common/dlpack_abi.h"
#include "common/exception.cuh"
#include "kernels/api.cuh"
#include "kernels/buffer_layout.cuh"
#include "output_region.h"
#include "runtime.cuh"

namespace py = pybind11;
using namespace ep_plugin;

namespace {

void get_dispatch_layout(uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                         int ranks_per_node, uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_node,
                         uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank, uintptr_t stream) {
  LayoutArgs args{};
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", num_tokens > 0);
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.num_experts = num_experts;
  args.num_ranks = num_ranks;
  args.ranks_per_node = ranks_per_node;
  args.num_tokens_per_rank = pointer<int32_t>(num_tokens_per_rank, "num_tokens_per_rank");
  args.num_tokens_per_node = pointer<int32_t>(num_tokens_per_node, "num_tokens_per_rdma_rank", false);
  args.num_tokens_per_expert = pointer<int32_t>(num_tokens_per_expert, "num_tokens_per_expert");
  args.is_token_in_rank = pointer<bool>(is_token_in_rank, "is_token_in_rank", num_tokens > 0);
  launch_dispatch_layout(args, as_stream(stream));
}

void gather_sum_rows(uintptr_t rows, uintptr_t index, uintptr_t out, int64_t num_out_rows, int num_slots,
                     int hidden, int num_sms, uintptr_t stream) {
  GatherSumArgs args{};
  args.rows = pointer<const uint8_t>(rows, "rows", false, 16);
  args.index = pointer<const int32_t>(index, "index", num_out_rows > 0 && num_slots > 0);
  args.out = pointer<uint8_t>(out, "out", num_out_rows > 0, 16);
  args.num_out_rows = num_out_rows;
  args.num_slots = num_slots;
  args.hidden = hidden;
  launch_gather_sum_rows(args, num_sms, as_stream(stream));
}

void runtime_notify(IntranodeRuntime& runtime, uintptr_t is_token_in_rank, uintptr_t num_tokens_per_expert,
                    uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, int expert_alignment,
                    int num_worst_tokens, int row_bytes, int num_scales, bool has_weights, uintptr_t send_pos,
                    uintptr_t recv_rank_offsets, uintptr_t src_num_tokens, uintptr_t num_recv_tokens, int host_tag,
                    uintptr_t stream) {
  intranode::NotifyArgs args{};
  args.is_token_in_rank = pointer<const bool>(is_token_in_rank, "is_token_in_rank", num_tokens > 0);
  args.num_tokens_per_expert = pointer<const int32_t>(num_tokens_per_expert, "num_tokens_per_expert");
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", num_tokens > 0);
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.num_experts = num_experts;
  args.expert_alignment = expert_alignment;
  args.num_worst_tokens = num_worst_tokens;
  args.row_layout = intranode::pack_row_layout(row_bytes, num_scales, num_topk, has_weights);
  args.send_pos = pointer<int32_t>(send_pos, "send_pos", num_tokens > 0);
  args.recv_rank_offsets = pointer<int32_t>(recv_rank_offsets, "recv_rank_offsets");
  args.src_num_tokens = pointer<int32_t>(src_num_tokens, "src_num_tokens");
  args.num_recv_tokens = pointer<int32_t>(num_recv_tokens, "num_recv_tokens");
  args.host_tag = host_tag;
  runtime.notify(args, as_stream(stream));
}

// Returns how many of this rank's tokens had their rows go to the peers by copy engine.
int runtime_dispatch(IntranodeRuntime& runtime, int num_channels, int recv_tokens_per_channel, int send_chunk,
                      int num_tokens,
                      int row_bytes, int num_scales, int num_topk, int num_local_experts, uintptr_t x,
                      uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t send_pos,
                      uintptr_t recv_x, uintptr_t recv_x_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights,
                      uintptr_t recv_src_idx, int num_worst_tokens, uintptr_t num_recv_tokens, uintptr_t stream,
                      bool direct, int64_t num_recv_rows, bool has_room, int64_t staging_bytes,
                      uintptr_t side_stream, uintptr_t recv_rank_offsets, uintptr_t cached_src_idx) {
  intranode::DispatchArgs args{};
  args.num_channels = num_channels;
  args.recv_tokens_per_channel = recv_tokens_per_channel;
  args.send_chunk = send_chunk;
  args.num_tokens = num_tokens;
  args.row_bytes = row_bytes;
  args.num_scales = num_scales;
  args.num_topk = num_topk;
  args.num_local_experts = num_local_experts;
  args.x = pointer<const uint8_t>(x, "x", num_tokens > 0, 16);
  args.x_scales = pointer<const float>(x_scales, "x_scales", false);
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", num_topk > 0 && num_tokens > 0);
  args.topk_weights = pointer<const float>(topk_weights, "topk_weights", false);
  args.send_pos = pointer<const int32_t>(send_pos, "send_pos", num_tokens > 0);
  args.recv_x = pointer<uint8_t>(recv_x, "recv_x", false, 16);
  args.recv_x_scales = pointer<float>(recv_x_scales, "recv_x_scales", num_scales > 0);
  args.recv_topk_idx = pointer<int64_t>(recv_topk_idx, "recv_topk_idx", false);
  args.recv_topk_weights = pointer<float>(recv_topk_weights, "recv_topk_weights", false);
  args.recv_src_idx = pointer<int32_t>(recv_src_idx, "recv_src_idx", false);
  args.num_worst_tokens = num_worst_tokens;
  args.num_recv_tokens = pointer<const int32_t>(num_recv_tokens, "num_recv_tokens");
  args.recv_rank_offsets = pointer<const int32_t>(recv_rank_offsets, "recv_rank_offsets", false);
  args.cached_src_idx = pointer<const int32_t>(cached_src_idx, "cached_src_idx", false);
  if (!direct) {
    EP_CHECK_ARG(staging_bytes == 0, "copy-engine dispatch rows need the direct dispatch (direct=True)");
    runtime.dispatch(args, as_stream(stream));
    return 0;
  }
  const StagedDispatch staged{staging_bytes, as_stream(side_stream)};
  return runtime.direct_dispatch(args, num_recv_rows, has_room, as_stream(stream),
                                 staging_bytes > 0 ? &staged : nullptr);
}

void runtime_combine(IntranodeRuntime& runtime, int num_channels, int recv_tokens_per_channel, int send_chunk,
                     int num_tokens,
                     int hidden, int num_topk, uintptr_t x, uintptr_t topk_weights, uintptr_t recv_src_idx,
                     uintptr_t recv_rank_offsets, uintptr_t src_num_tokens, uintptr_t send_pos, uintptr_t bias_0,
                     uintptr_t bias_1, uintptr_t combined_x, uintptr_t combined_topk_weights, uintptr_t stream,
                     int64_t push_staging_bytes) {
  intranode::CombineArgs args{};
  args.num_channels = num_channels;
  args.recv_tokens_per_channel = recv_tokens_per_channel;
  args.send_chunk = send_chunk;
  args.num_tokens = num_tokens;
  args.hidden = hidden;
  args.num_topk = num_topk;
  args.x = pointer<const uint8_t>(x, "x", false, 16);
  args.topk_weights = pointer<const float>(topk_weights, "topk_weights", false);
  args.recv_src_idx = pointer<const int32_t>(recv_src_idx, "recv_src_idx", false);
  args.recv_rank_offsets = pointer<const int32_t>(recv_rank_offsets, "recv_rank_offsets");
  args.src_num_tokens = pointer<const int32_t>(src_num_tokens, "src_num_tokens");
  args.send_pos = pointer<const int32_t>(send_pos, "send_pos", num_tokens > 0);
  args.bias_0 = pointer<const uint8_t>(bias_0, "bias_0", false, 16);
  args.bias_1 = pointer<const uint8_t>(bias_1, "bias_1", false, 16);
  args.combined_x = pointer<uint8_t>(combined_x, "combined_x", num_tokens > 0, 16);
  args.combined_topk_weights = pointer<float>(combined_topk_weights, "combined_topk_weights", false);
  if (push_staging_bytes > 0) runtime.push_combine(args, push_staging_bytes, as_stream(stream));
  else runtime.combine(args, as_stream(stream));
}

void runtime_staged_combine(IntranodeRuntime& runtime, int num_tokens, int hidden, int num_topk, uintptr_t x,
                            uintptr_t topk_weights, uintptr_t send_pos, uintptr_t bias_0, uintptr_t bias_1,
                            uintptr_t combined_x, uintptr_t combined_topk_weights, const std::vector<int>& rows_from,
                            int64_t staging_bytes, int num_sms, uintptr_t stream, uintptr_t side_stream) {
  StagedCombineRequest request{};
  intranode::StagedReduceArgs& args = request.reduce;
  args.num_tokens = num_tokens;
  args.hidden = hidden;
  args.num_topk = num_topk;
  args.x = pointer<const uint8_t>(x, "x", false, 16);
  args.topk_weights = pointer<const float>(topk_weights, "topk_weights", false);
  args.send_pos = pointer<const int32_t>(send_pos, "send_pos", num_tokens > 0);
  args.bias_0 = pointer<const uint8_t>(bias_0, "bias_0", false, 16);
  args.bias_1 = pointer<const uint8_t>(bias_1, "bias_1", false, 16);
  args.combined_x = pointer<uint8_t>(combined_x, "combined_x", num_tokens > 0, 16);
  args.combined_topk_weights = pointer<float>(combined_topk_weights, "combined_topk_weights", false);
  request.rows_from = rows_from;
  request.staging_bytes = staging_bytes;
  request.num_sms = num_sms;
  runtime.staged_combine(request, as_stream(stream), as_stream(side_stream));
}

py::tuple runtime_wait_notify(IntranodeRuntime& runtime, int tag, int num_local_experts, uintptr_t stream) {
  NotifyResult result;
  {
    py::gil_scoped_release release;  // other Python threads may run while the host spins
    result = runtime.wait_notify(tag, num_local_experts, as_stream(stream));
  }
  return py::make_tuple(result.num_recv_tokens, result.num_recv_tokens_per_rank, result.num_recv_tokens_per_expert);
}

// A region tensor handed to torch: its shape, and the region that takes its block back when torch drops it.
struct RegionTensorOwner {
  dlpack::ManagedTensor managed{};
  std::vector<int64_t> shape;
  std::shared_ptr<OutputRegionAllocator> region;
  int64_t block_offset;
};

// NOTE: runs inside torch's storage destructor: nothing may escape it.
void release_region_tensor(dlpack::ManagedTensor* managed) noexcept {
  auto* owner = static_cast<RegionTensorOwner*>(managed->manager_ctx);
  try {
    owner->region->release_tensor(owner->block_offset);
  } catch (...) {  // the block stays taken; the region is going away with the process
  }
  delete owner;
}

// An unconsumed capsule (its tensor never made) still returns its share of the block.
void destroy_region_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) {
    auto* managed = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
    managed->deleter(managed);
  }
}

py::capsule region_capsule(const std::shared_ptr<OutputRegionAllocator>& region, const OutputRegionAllocator::Tensor& t,
                           int64_t block_offset) {
  auto* owner = new RegionTensorOwner{{}, t.shape, region, block_offset};
  dlpack::Tensor& dl = owner->managed.dl_tensor;
  dl.data = t.data;
  dl.device = region->device() >= 0 ? dlpack::Device{dlpack::kCUDA, region->device()} : dlpack::Device{dlpack::kCPU, 0};
  dl.ndim = static_cast<int32_t>(owner->shape.size());
  dl.dtype = dlpack::DataType{dlpack::kUInt, 8, 1};
  dl.shape = owner->shape.data();
  owner->managed.manager_ctx = owner;
  owner->managed.deleter = release_region_tensor;
  PyObject* capsule = PyCapsule_New(&owner->managed, dlpack::kCapsuleName, destroy_region_capsule);
  if (capsule == nullptr) {
    release_region_tensor(&owner->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

// DLPack capsules of uint8 tensors with `byte_shapes`, in one block of the region; None when it is full.
py::object allocate_in_region(const std::shared_ptr<OutputRegionAllocator>& region,
                              const std::vector<std::vector<int64_t>>& byte_shapes, uintptr_t stream) {
  auto tensors = region->allocate(byte_shapes, stream);
  if (!tensors) return py::none();
  const int64_t block_offset = tensors->empty() ? 0 : static_cast<uint8_t*>(tensors->front().data) -
                                                          reinterpret_cast<uint8_t*>(region->address());
  py::list capsules;
  for (const auto& tensor : *tensors) capsules.append(region_capsule(region, tensor, block_offset));
  return std::move(capsules);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ep_plugin native kernels (framework-free core; tensors pass as device addresses)";

  py::register_exception<ep_plugin::TimeoutError>(m, "DeviceTimeoutError", PyExc_TimeoutError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const ep_plugin::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.attr("MAX_NVL_PEERS") = kMaxNvlPeers;
  m.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  m.attr("MAX_CHANNELS") = intranode::kMaxChannels;
  m.attr("MAX_TOPK") = intranode::kMaxTopk;
  m.attr("WARPS_PER_CHANNEL") = intranode::kWarpsPerChannel;
  m.attr("SLOT_META_BYTES") = intranode::kSlotMetaBytes;
  m.attr("SLOT_PAYLOAD_OFFSET") = intranode::kSlotPayloadOffset;
  m.attr("NVL_HEADER_BYTES") = intranode::kHeaderBytes;
  m.attr("STAGING_ROWS_PER_PIECE") = intranode::kStagingRowsPerPiece;
  m.attr("MAX_STAGING_SLOTS") = intranode::kMaxStagingSlots;

  m.def("nvl_buffer_size_hint", &intranode::nvl_buffer_size_hint, py::arg("payload_bytes"), py::arg("num_ranks"),
        py::arg("num_sms"), py::arg("recv_tokens_per_channel"),
        "Bytes of NVLink buffer for rows of payload_bytes (pure function, no GPU needed).");

  m.def(
      "staging_rows",
      [](int num_ranks, int64_t staging_bytes, int hidden) {
        return intranode::StagingLayout::fit(num_ranks, 0, staging_bytes, 2LL * hidden).rows_capacity();
      },
      py::arg("num_ranks"), py::arg("staging_bytes"), py::arg("hidden"),
      "Rows per peer a copy-engine staging area of staging_bytes holds (pure function, no GPU needed).");

  // ---- push combine ----
  m.attr("PUSH_CHUNK_TOKENS") = intranode::kPushChunkTokens;
  m.def(
      "push_staging_tokens",
      [](int num_ranks, int64_t staging_bytes, int hidden) {
        return intranode::PushStagingLayout::fit(num_ranks, 0, staging_bytes, 2LL * hidden).capacity;
      },
      py::arg("num_ranks"), py::arg("staging_bytes"), py::arg("hidden"),
      "Owner tokens a push combine's staging area of staging_bytes holds (pure function, no GPU needed).");

  m.def("get_dispatch_layout", &get_dispatch_layout, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
        py::arg("num_experts"), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("num_tokens_per_rank"),
        py::arg("num_tokens_per_node"), py::arg("num_tokens_per_expert"), py::arg("is_token_in_rank"),
        py::arg("stream"));

  m.def("gather_sum_rows", &gather_sum_rows, py::arg("rows"), py::arg("index"), py::arg("out"),
        py::arg("num_out_rows"), py::arg("num_slots"), py::arg("hidden"), py::arg("num_sms"), py::arg("stream"),
        "out[n] = sum of rows[index[n, s]] over s with index >= 0 (bf16 rows, fp32 sums).");

  // The allocator's bookkeeping alone, markers as ints (tests; no CUDA).
  using Ranges = RegionRanges<int64_t>;
  py::class_<Ranges>(m, "RegionRanges")
      .def(py::init<int64_t>(), py::arg("size"))
      .def("allocate", [](Ranges& self, int64_t nbytes) -> py::object {
        auto found = self.allocate(nbytes);
        if (!found) return py::none();
        py::dict pending;
        for (const auto& [stream, entry] : found->pending) pending[py::int_(stream)] = entry.marker;
        return py::make_tuple(found->offset, pending);
      }, py::arg("nbytes"), "(offset, {stream: marker of its latest release}) or None when no free range holds it.")
      .def("release", &Ranges::release, py::arg("offset"), py::arg("nbytes"), py::arg("stream"), py::arg("marker"))
      .def("free_bytes", &Ranges::free_bytes)
      .def("largest_free", &Ranges::largest_free);
  m.attr("REGION_ALIGNMENT") = kRegionAlignment;

  py::class_<OutputRegionAllocator, std::shared_ptr<OutputRegionAllocator>>(m, "OutputRegionAllocator")
      .def(py::init<uintptr_t, int64_t, int>(), py::arg("address"), py::arg("size"), py::arg("device"),
           "The output region at address (size bytes) of CUDA device `device`, or of host memory with -1.")
      .def("allocate", &allocate_in_region, py::arg("byte_shapes"), py::arg("stream"),
           "DLPack capsules of uint8 tensors of byte_shapes (each 256-byte aligned) in one block, on `stream`; "
           "None when no free range holds them. The block returns when every tensor made from them is gone.")
      .def("largest_free", &OutputRegionAllocator::largest_free)
      .def("describe", &OutputRegionAllocator::describe);

  py::class_<IntranodeRuntime>(m, "IntranodeRuntime")
      .def(py::init<int, int, int64_t, double, int64_t, int64_t>(), py::arg("rank"), py::arg("num_ranks"),
           py::arg("num_nvl_bytes"), py::arg("timeout_s"), py::arg("staging_bytes") = 0, py::arg("output_bytes") = 0)
      .def_property_readonly("device", &IntranodeRuntime::device)
      .def_property_readonly("num_nvl_bytes", &IntranodeRuntime::num_nvl_bytes)
      .def_property_readonly("staging_bytes", &IntranodeRuntime::staging_bytes)
      .def_property_readonly("output_region_address", &IntranodeRuntime::output_region_address,
                             "Device address of the output region (dispatch outputs that peers write directly).")
      .def_property_readonly("output_region_bytes", &IntranodeRuntime::output_region_bytes)
      .def_property_readonly("dispatch_bulk_rows", &IntranodeRuntime::dispatch_bulk_rows,
                             "Whether the dispatch's senders copy rows by bulk copies (else through registers).")
      .def_property_readonly("direct_chunk_tokens", &IntranodeRuntime::direct_chunk_tokens,
                             "Tokens per chunk the direct dispatch's warps claim (0: fixed equal shares).")
      .def_property_readonly("dispatch_ce_share", &IntranodeRuntime::dispatch_ce_share,
                             "Percent of a rank's tokens (its last ones) whose rows go to the peers by copy engine "
                             "with copy-engine dispatch rows (EP_PLUGIN_DISPATCH_CE_SHARE, default 100).")
      .def("staging_rows", &IntranodeRuntime::staging_rows, py::arg("staging_bytes"), py::arg("hidden"),
           "Rows per peer the copy-engine combine's staging area holds (0: too small, or over this rank's area).")
      .def("ipc_handle", [](const IntranodeRuntime& self) { return py::bytes(self.ipc_handle()); })
      .def("connect", [](IntranodeRuntime& self, const std::vector<py::bytes>& handles) {
        std::vector<std::string> raw(handles.begin(), handles.end());
        self.connect(raw);
      }, py::arg("handles"))
      .def("destroy", &IntranodeRuntime::destroy)
      .def("check_device_error", &IntranodeRuntime::check_device_error)
      .def("notify", &runtime_notify, py::arg("is_token_in_rank"), py::arg("num_tokens_per_expert"),
           py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
           py::arg("expert_alignment"), py::arg("num_worst_tokens"), py::arg("row_bytes"), py::arg("num_scales"),
           py::arg("has_weights"), py::arg("send_pos"), py::arg("recv_rank_offsets"), py::arg("src_num_tokens"),
           py::arg("num_recv_tokens"), py::arg("host_tag"), py::arg("stream"))
      .def("wait_notify", &runtime_wait_notify, py::arg("tag"), py::arg("num_local_experts"), py::arg("stream"))
      .def("dispatch", &runtime_dispatch, py::arg("num_channels"), py::arg("recv_tokens_per_channel"),
           py::arg("send_chunk"), py::arg("num_tokens"), py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"),
           py::arg("num_local_experts"), py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("send_pos"), py::arg("recv_x"), py::arg("recv_x_scales"),
           py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_src_idx"),
           py::arg("num_worst_tokens"), py::arg("num_recv_tokens"), py::arg("stream"), py::arg("direct") = false,
           py::arg("num_recv_rows") = 0, py::arg("has_room") = true, py::arg("staging_bytes") = 0,
           py::arg("side_stream") = 0, py::arg("recv_rank_offsets") = 0, py::arg("cached_src_idx") = 0,
           "direct: senders write every rank's outputs (num_recv_rows rows, in its output region) directly; every "
           "rank of the call must pass the same. has_room false: this rank's outputs are elsewhere (its region "
           "was full), and every rank falls back to the rings. staging_bytes > 0 (direct only, every rank alike): "
           "the rows cross NVLink by copy engine through the staging areas (recv_rank_offsets [R + 1], and "
           "cached_src_idx for a cached dispatch; side_stream refills the area). Returns how many of this rank's "
           "tokens (its last ones) had their rows go to the peers by copy engine.")
      .def("direct_fell_back", &IntranodeRuntime::direct_fell_back,
           "Whether this rank's last direct dispatch fell back to the rings (synchronises with the device).")
      .def("combine", &runtime_combine, py::arg("num_channels"), py::arg("recv_tokens_per_channel"),
           py::arg("send_chunk"), py::arg("num_tokens"), py::arg("hidden"), py::arg("num_topk"), py::arg("x"), py::arg("topk_weights"),
           py::arg("recv_src_idx"), py::arg("recv_rank_offsets"), py::arg("src_num_tokens"), py::arg("send_pos"),
           py::arg("bias_0"), py::arg("bias_1"), py::arg("combined_x"), py::arg("combined_topk_weights"),
           py::arg("stream"), py::arg("push_staging_bytes") = 0,
           "The SM combine through rings; push_staging_bytes > 0 (every rank's smallest staging area, every "
           "rank alike): the push combine (IntranodeRuntime::push_combine).")
      .def("staged_combine", &runtime_staged_combine, py::arg("num_tokens"), py::arg("hidden"), py::arg("num_topk"),
           py::arg("x"), py::arg("topk_weights"), py::arg("send_pos"), py::arg("bias_0"), py::arg("bias_1"),
           py::arg("combined_x"), py::arg("combined_topk_weights"), py::arg("rows_from"), py::arg("staging_bytes"),
           py::arg("num_sms"), py::arg("stream"), py::arg("side_stream"),
           "Combine through the copy engines (see IntranodeRuntime::staged_combine); releases the GIL.",
           py::call_guard<py::gil_scoped_release>());
}
