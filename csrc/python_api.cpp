// ep_plugin._C: a thin pybind11 face over the framework-free core.
//
// Tensors cross as raw device addresses (ints) with their sizes; ep_plugin/backends checks dtypes,
// shapes and devices and allocates outputs with torch. Each operation takes its Args struct
// (kernels/api.cuh), bound here field by field (the eager paths' structs also by one positional
// constructor); the runtime checks every address for presence and alignment, naming the argument,
// before anything is launched.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
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
  args.topk_idx = pointer<const int64_t>(topk_idx, "topk_idx", num_tokens > 0 && num_topk > 0);
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.num_experts = num_experts;
  args.num_ranks = num_ranks;
  args.ranks_per_node = ranks_per_node;
  args.num_tokens_per_rank = pointer<int32_t>(num_tokens_per_rank, "num_tokens_per_rank", false);
  args.num_tokens_per_node = pointer<int32_t>(num_tokens_per_node, "num_tokens_per_node", false);
  args.num_tokens_per_expert = pointer<int32_t>(num_tokens_per_expert, "num_tokens_per_expert");
  args.is_token_in_rank = pointer<bool>(is_token_in_rank, "is_token_in_rank", num_tokens > 0);
  launch_dispatch_layout(args, as_stream(stream));
}

// The layout fast path's launcher (common/layout_launcher.h): launches nothing where the runtime holds a
// device error or an earlier CUDA call left one (the checked path then reports it), so that false always
// means nothing was launched.
bool launch_layout_unchecked(void* runtime_object, const LayoutArgs& args, uintptr_t stream) noexcept {
  try {
    const py::handle runtime(static_cast<PyObject*>(runtime_object));
    if (!runtime.is_none()) runtime.cast<const IntranodeRuntime&>().check_device_error();
    if (cudaPeekAtLastError() != cudaSuccess) return false;
    launch_dispatch_layout(args, as_stream(stream));  // its checks come before the launch
    return true;
  } catch (...) {
    return false;
  }
}

const layout::LayoutLauncher kLayoutLauncher{&launch_layout_unchecked};

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

// An Args field the caller fills: a number, or a device address (an int in Python, 0: null; the runtime
// checks it). Each is a Python attribute and a parameter of the positional constructor (bind_fields).
template <typename Args, typename T>
struct Number {
  using Param = T;
  T Args::*member;
  const char* name;
  void set(Args& args, T value) const { args.*member = value; }
  void bind(py::class_<Args>& cls) const { cls.def_readwrite(name, member); }
};

template <typename Args, typename T>
struct Address {
  using Param = uintptr_t;
  T* Args::*member;
  const char* name;
  void set(Args& args, uintptr_t value) const { args.*member = reinterpret_cast<T*>(value); }
  void bind(py::class_<Args>& cls) const {
    const auto field = member;
    cls.def_property(
        name, [field](const Args& self) { return reinterpret_cast<uintptr_t>(self.*field); },
        [field](Args& self, uintptr_t value) { self.*field = reinterpret_cast<T*>(value); });
  }
};

template <typename Args, typename T>
Number<Args, T> number(T Args::*member, const char* name) {
  return {member, name};
}

template <typename Args, typename T>
Address<Args, T> address(T* Args::*member, const char* name) {
  return {member, name};
}

// Binds `fields` as attributes, and a constructor that takes them all positionally in this order (also
// `Args()`, every field 0). NOTE: the eager paths build their Args so, in one call: setting a dozen fields
// one by one from Python costs 2-4 us, a keyword call as much; the constructor about 1 us.
template <typename Args, typename... Fields>
void bind_fields(py::class_<Args>& cls, Fields... fields) {
  cls.def(py::init([fields...](typename Fields::Param... values) {
            Args args{};
            (fields.set(args, values), ...);
            return args;
          }),
          py::arg(fields.name)..., "Every field the caller fills, positionally in this order.");
  cls.def(py::init<>());
  (fields.bind(cls), ...);
}

// The fields the caller fills (api.cuh says what each holds); the runtime fills the rest.
void bind_notify_args(py::module_& m) {
  using intranode::NotifyArgs;
  py::class_<NotifyArgs> cls(m, "NotifyArgs", "Arguments of IntranodeRuntime.notify (api.cuh).");
  bind_fields(cls, address(&NotifyArgs::is_token_in_rank, "is_token_in_rank"),
              address(&NotifyArgs::num_tokens_per_expert, "num_tokens_per_expert"),
              address(&NotifyArgs::topk_idx, "topk_idx"), number(&NotifyArgs::num_tokens, "num_tokens"),
              number(&NotifyArgs::num_topk, "num_topk"), number(&NotifyArgs::num_experts, "num_experts"),
              number(&NotifyArgs::expert_alignment, "expert_alignment"),
              number(&NotifyArgs::num_worst_tokens, "num_worst_tokens"), number(&NotifyArgs::row_layout, "row_layout"),
              number(&NotifyArgs::host_tag, "host_tag"), address(&NotifyArgs::send_pos, "send_pos"),
              address(&NotifyArgs::recv_rank_offsets, "recv_rank_offsets"),
              address(&NotifyArgs::src_num_tokens, "src_num_tokens"),
              address(&NotifyArgs::num_recv_tokens, "num_recv_tokens"));
}

void bind_dispatch_args(py::module_& m) {
  using intranode::DispatchArgs;
  py::class_<DispatchArgs> cls(m, "DispatchArgs",
                               "Arguments of IntranodeRuntime.dispatch / direct_dispatch (api.cuh).");
  bind_fields(cls, number(&DispatchArgs::num_channels, "num_channels"),
              number(&DispatchArgs::recv_tokens_per_channel, "recv_tokens_per_channel"),
              number(&DispatchArgs::send_chunk, "send_chunk"), number(&DispatchArgs::num_tokens, "num_tokens"),
              number(&DispatchArgs::row_bytes, "row_bytes"), number(&DispatchArgs::num_scales, "num_scales"),
              number(&DispatchArgs::scale_token_stride, "scale_token_stride"),
              number(&DispatchArgs::scale_stride, "scale_stride"), number(&DispatchArgs::num_topk, "num_topk"),
              address(&DispatchArgs::topk_idx, "topk_idx"), address(&DispatchArgs::topk_weights, "topk_weights"),
              number(&DispatchArgs::num_local_experts, "num_local_experts"),
              number(&DispatchArgs::num_worst_tokens, "num_worst_tokens"), address(&DispatchArgs::x, "x"),
              address(&DispatchArgs::x_scales, "x_scales"), address(&DispatchArgs::send_pos, "send_pos"),
              address(&DispatchArgs::num_recv_tokens, "num_recv_tokens"));
  // The outputs: set once they are placed (place_direct_outputs, or from Python).
  address(&DispatchArgs::recv_x, "recv_x").bind(cls);
  address(&DispatchArgs::recv_x_scales, "recv_x_scales").bind(cls);
  address(&DispatchArgs::recv_topk_idx, "recv_topk_idx").bind(cls);
  address(&DispatchArgs::recv_topk_weights, "recv_topk_weights").bind(cls);
  address(&DispatchArgs::recv_src_idx, "recv_src_idx").bind(cls);
}

void bind_combine_args(py::module_& m) {
  using intranode::CombineArgs;
  py::class_<CombineArgs> cls(m, "CombineArgs", "Arguments of IntranodeRuntime.combine (api.cuh).");
  bind_fields(cls, number(&CombineArgs::num_channels, "num_channels"),
              number(&CombineArgs::recv_tokens_per_channel, "recv_tokens_per_channel"),
              number(&CombineArgs::send_chunk, "send_chunk"), address(&CombineArgs::x, "x"),
              number(&CombineArgs::hidden, "hidden"), number(&CombineArgs::num_topk, "num_topk"),
              address(&CombineArgs::topk_weights, "topk_weights"), number(&CombineArgs::num_tokens, "num_tokens"),
              address(&CombineArgs::recv_src_idx, "recv_src_idx"),
              address(&CombineArgs::recv_rank_offsets, "recv_rank_offsets"),
              address(&CombineArgs::src_num_tokens, "src_num_tokens"), address(&CombineArgs::send_pos, "send_pos"),
              address(&CombineArgs::bias_0, "bias_0"), address(&CombineArgs::bias_1, "bias_1"),
              address(&CombineArgs::combined_x, "combined_x"),
              address(&CombineArgs::combined_topk_weights, "combined_topk_weights"));
}

void bind_staged_reduce_args(py::module_& m) {
  using intranode::StagedReduceArgs;
  py::class_<StagedReduceArgs> cls(m, "StagedReduceArgs", "Arguments of IntranodeRuntime.staged_combine (api.cuh).");
  bind_fields(cls, address(&StagedReduceArgs::x, "x"), number(&StagedReduceArgs::hidden, "hidden"),
              number(&StagedReduceArgs::num_topk, "num_topk"), address(&StagedReduceArgs::topk_weights, "topk_weights"),
              number(&StagedReduceArgs::num_tokens, "num_tokens"), address(&StagedReduceArgs::send_pos, "send_pos"),
              address(&StagedReduceArgs::bias_0, "bias_0"), address(&StagedReduceArgs::bias_1, "bias_1"),
              address(&StagedReduceArgs::combined_x, "combined_x"),
              address(&StagedReduceArgs::combined_topk_weights, "combined_topk_weights"),
              number(&StagedReduceArgs::pull_rows, "pull_rows"));
}

int runtime_wait_notify(IntranodeRuntime& runtime, int tag, uintptr_t stream) {
  py::gil_scoped_release release;  // other Python threads may run while the host spins
  return runtime.wait_notify(tag, as_stream(stream));
}

py::tuple runtime_notify_counts(const IntranodeRuntime& runtime, int num_local_experts) {
  const NotifyCounts counts = runtime.notify_counts(num_local_experts);
  return py::make_tuple(counts.num_recv_tokens_per_rank, counts.num_recv_tokens_per_expert, counts.largest_block_rows);
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

// Output `index` of a dispatch (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx) at `data`.
void set_dispatch_output(intranode::DispatchArgs& args, int index, void* data) {
  switch (index) {
    case 0: args.recv_x = data; return;
    case 1: args.recv_x_scales = static_cast<float*>(data); return;
    case 2: args.recv_topk_idx = static_cast<int64_t*>(data); return;
    case 3: args.recv_topk_weights = static_cast<float*>(data); return;
    case 4: args.recv_src_idx = static_cast<int32_t*>(data); return;
    default: EP_CHECK_ARG(false, "dispatch output index must be in [0, 5), got " << index);
  }
}

// A direct dispatch's outputs of `rows` rows in the output region, their addresses set in `args`, in one
// call (the host's step between the received count and the launch). `blocks[b]` lists block b's outputs as
// (output index, bytes per row, 2-D); each block is one allocation. Returns one uint8 capsule per listed
// output, block by block, or None when a block has no room (the blocks taken go back with their capsules,
// and `args` keeps no address of them).
py::object place_direct_outputs(intranode::DispatchArgs& args, const std::shared_ptr<OutputRegionAllocator>& region,
                                int64_t rows, const std::vector<std::vector<std::tuple<int, int64_t, bool>>>& blocks,
                                uintptr_t stream) {
  EP_CHECK_ARG(rows >= 0, "rows must be >= 0, got " << rows);
  py::list capsules;
  std::vector<std::pair<int, void*>> placed;
  for (const auto& block : blocks) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& [index, row_bytes, two_d] : block)
      shapes.push_back(two_d ? std::vector<int64_t>{rows, row_bytes} : std::vector<int64_t>{rows * row_bytes});
    auto tensors = region->allocate(shapes, stream);
    if (!tensors) return py::none();
    const int64_t block_offset = tensors->empty() ? 0 : static_cast<uint8_t*>(tensors->front().data) -
                                                            reinterpret_cast<uint8_t*>(region->address());
    for (size_t i = 0; i < tensors->size(); ++i) {
      capsules.append(region_capsule(region, (*tensors)[i], block_offset));
      placed.emplace_back(std::get<0>(block[i]), (*tensors)[i].data);
    }
  }
  for (const auto& [index, data] : placed) set_dispatch_output(args, index, data);
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

  m.def("pack_row_layout", &intranode::pack_row_layout, py::arg("row_bytes"), py::arg("num_scales"),
        py::arg("num_topk"), py::arg("has_weights"),
        "NotifyArgs.row_layout of a dispatch's rows (every rank's must be equal).");
  bind_notify_args(m);
  bind_dispatch_args(m);
  bind_combine_args(m);
  bind_staged_reduce_args(m);

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

  m.def("get_dispatch_layout", &get_dispatch_layout, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
        py::arg("num_experts"), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("num_tokens_per_rank"),
        py::arg("num_tokens_per_node"), py::arg("num_tokens_per_expert"), py::arg("is_token_in_rank"),
        py::arg("stream"),
        "One kernel launch that writes every entry of the outputs (api.cuh LayoutArgs); num_tokens_per_rank or "
        "num_tokens_per_node 0: not written. By position on the host's hot path (cheaper than by name).");

  // NOTE: const_cast: a capsule holds a void*; the launcher is only read (by ep_plugin._C_torch).
  m.attr("layout_launcher") = py::capsule(const_cast<layout::LayoutLauncher*>(&kLayoutLauncher),
                                          layout::kLayoutLauncherName);

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
  m.def("place_direct_outputs", &place_direct_outputs, py::arg("args"), py::arg("region"), py::arg("rows"),
        py::arg("blocks"), py::arg("stream"),
        "A direct dispatch's outputs in the output region, their addresses set in args: one uint8 capsule per "
        "output of blocks ([[(output index, bytes per row, 2-D), ...] per block]), or None when a block has no room.");

  py::class_<OwnRuns, std::shared_ptr<OwnRuns>>(m, "OwnRuns",
                                                 "The runs of tokens a rank sends to itself in one dispatch (opaque).")
      .def_property_readonly("runs", [](const OwnRuns& self) {
        std::vector<std::tuple<int, int, int>> runs;
        for (size_t i = 0; i < self.first.size(); ++i) runs.emplace_back(self.first[i], self.end[i], self.first_row[i]);
        return runs;
      }, "[(first token, one past the last, recv_x row of the first)] (for tests).")
      .def_property_readonly("engine_runs", [](const OwnRuns& self) {
        std::vector<std::tuple<int, int, int>> runs;
        for (const int i : self.by_engine) runs.emplace_back(self.first[i], self.end[i], self.first_row[i]);
        return runs;
      }, "The runs whose rows the copy engine copied in the last dispatch with them, in token order (for tests).");

  py::class_<IntranodeRuntime>(m, "IntranodeRuntime")
      .def(py::init<int, int, int64_t, double, int64_t, int64_t, int, int>(), py::arg("rank"), py::arg("num_ranks"),
           py::arg("num_nvl_bytes"), py::arg("timeout_s"), py::arg("staging_bytes") = 0, py::arg("output_bytes") = 0,
           py::arg("direct_max_blocks") = 16, py::arg("direct_chunk_tokens") = 1)
      .def_property_readonly("device", &IntranodeRuntime::device)
      .def_property_readonly("num_nvl_bytes", &IntranodeRuntime::num_nvl_bytes)
      .def_property_readonly("staging_bytes", &IntranodeRuntime::staging_bytes)
      .def_property_readonly("output_region_address", &IntranodeRuntime::output_region_address,
                             "Device address of the output region (dispatch outputs that peers write directly).")
      .def_property_readonly("output_region_bytes", &IntranodeRuntime::output_region_bytes)
      .def_property_readonly("dispatch_bulk_rows", &IntranodeRuntime::dispatch_bulk_rows,
                             "Whether the dispatch's senders copy rows by bulk copies (else through registers).")
      .def_property_readonly("direct_max_blocks", &IntranodeRuntime::direct_max_blocks,
                             "Blocks the direct dispatch runs on at most (0: num_sms).")
      .def_property_readonly("direct_chunk_tokens", &IntranodeRuntime::direct_chunk_tokens,
                             "Tokens per chunk the direct dispatch's warps claim.")
      .def("staging_rows", &IntranodeRuntime::staging_rows, py::arg("staging_bytes"), py::arg("hidden"),
           "Rows per peer the copy-engine combine's staging area holds (0: too small, or over this rank's area).")
      .def("ipc_handle", [](const IntranodeRuntime& self) { return py::bytes(self.ipc_handle()); })
      .def("connect", [](IntranodeRuntime& self, const std::vector<py::bytes>& handles) {
        std::vector<std::string> raw(handles.begin(), handles.end());
        self.connect(raw);
      }, py::arg("handles"))
      .def("destroy", &IntranodeRuntime::destroy)
      .def("check_device_error", &IntranodeRuntime::check_device_error)
      .def("notify", [](IntranodeRuntime& self, const intranode::NotifyArgs& args,
                        uintptr_t stream) { self.notify(args, as_stream(stream)); },
           py::arg("args"), py::arg("stream"))
      .def("wait_notify", &runtime_wait_notify, py::arg("tag"), py::arg("stream"),
           "The received row count of the notify published with `tag` (the host waits for it).")
      .def("notify_counts", &runtime_notify_counts, py::arg("num_local_experts"),
           "(rows from each rank, aligned rows per local expert, the most rows any rank received from any one "
           "rank) of the last waited notify.")
      .def("dispatch", [](IntranodeRuntime& self, const intranode::DispatchArgs& args,
                          uintptr_t stream) { self.dispatch(args, as_stream(stream)); },
           py::arg("args"), py::arg("stream"), "The ring dispatch.")
      .def("direct_dispatch", [](IntranodeRuntime& self, const intranode::DispatchArgs& args, int64_t num_recv_rows,
                                 bool has_room, uintptr_t stream, int own_runs_tag,
                                 std::shared_ptr<OwnRuns> own_runs) {
             return self.direct_dispatch(args, num_recv_rows, has_room, as_stream(stream), own_runs_tag,
                                         std::move(own_runs));
           },
           py::arg("args"), py::arg("num_recv_rows"), py::arg("has_room"), py::arg("stream"),
           py::arg("own_runs_tag") = 0, py::arg("own_runs") = nullptr,
           "Senders write every rank's outputs (num_recv_rows rows, in its output region) directly; every rank "
           "of the call must take this path. has_room false: this rank's outputs are elsewhere (its region was "
           "full), and every rank falls back to the rings. The copy engine writes this rank's own rows of its "
           "longest runs where they are few: those of own_runs (a cached dispatch), or of the notify tagged "
           "own_runs_tag. "
           "Returns the runs (OwnRuns, for the handle), or None.")
      .def("direct_fell_back", &IntranodeRuntime::direct_fell_back,
           "Whether this rank's last direct dispatch fell back to the rings (synchronises with the device).")
      .def("combine", [](IntranodeRuntime& self, const intranode::CombineArgs& args,
                         uintptr_t stream) { self.combine(args, as_stream(stream)); },
           py::arg("args"), py::arg("stream"))
      .def("staged_combine",
           [](IntranodeRuntime& self, const intranode::StagedReduceArgs& args, const std::vector<int>& rows_from,
              int64_t staging_bytes, int num_sms, uintptr_t stream, uintptr_t side_stream) {
             self.staged_combine(StagedCombineRequest{args, staging_bytes, rows_from, num_sms}, as_stream(stream),
                                 as_stream(side_stream));
           },
           py::arg("args"), py::arg("rows_from"), py::arg("staging_bytes"), py::arg("num_sms"), py::arg("stream"),
           py::arg("side_stream"),
           "Combine through the copy engines (see IntranodeRuntime::staged_combine); releases the GIL.",
           py::call_guard<py::gil_scoped_release>());
}
