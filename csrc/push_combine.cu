// IntranodeRuntime::push_combine: the host side of the push combine (kernels/intranode_push_combine.cu).
#include "common/exception.cuh"
#include "kernels/buffer_layout.cuh"
#include "runtime.cuh"

namespace ep_plugin {

void IntranodeRuntime::push_combine(intranode::CombineArgs args, int64_t staging_bytes, cudaStream_t stream) {
  require_connected();
  EP_CHECK_ARG(staging_bytes > 0 && staging_bytes <= staging_bytes_,
               "the push combine needs a staging area of every rank's smallest size (" << staging_bytes
                                                                                       << " bytes), this rank has "
                                                                                       << staging_bytes_);
  args.peer_buffers = peer_buffers_device_;
  args.rank = rank_;
  args.num_ranks = num_ranks_;
  args.status = status_device_;
  args.timeout_ns = timeout_ns_;
  // The ring combine after it runs when the tokens of some rank exceed the area: its rings must fit too.
  const intranode::RingLayout layout{num_ranks_, args.num_channels,
                                     intranode::slots_per_sub_ring(args.recv_tokens_per_channel),
                                     intranode::slot_bytes_for(2LL * args.hidden)};
  require_buffer_fits(layout.total_bytes(), "combine");
  args.only_after_push_fallback = false;
  intranode::launch_push_combine(intranode::PushCombineArgs{args, staging_offset_, staging_bytes, dispatch_bulk_rows_},
                                 stream);
  args.only_after_push_fallback = true;
  intranode::launch_combine(args, stream);
}

}  // namespace ep_plugin
