"""Host time of allocating a dispatch's outputs: the output region (two blocks, csrc allocator) against torch.empty."""
import time

import torch

from ep_plugin.output_region import OutputRegion

dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
backing = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
region = OutputRegion(backing.data_ptr(), backing.numel(), dev)
rows = [((8192, 7168), torch.bfloat16)]
meta = [((8192, 8), torch.int64), ((8192, 8), torch.float32), ((8192,), torch.int32)]


def time_us(fn, n=2000):
    for _ in range(100):
        out = fn()
        del out
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        out = fn()
        del out
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


s = torch.cuda.current_stream().cuda_stream
print(f"torch.empty x4 (alloc + free):          {time_us(lambda: [torch.empty(sh, dtype=d, device=dev) for sh, d in rows + meta]):7.1f} us")
print(f"region.empty_group x2 (alloc + free):   {time_us(lambda: (region.empty_group(rows, s), region.empty_group(meta, s))):7.1f} us")
print(f"torch.cuda.current_stream().cuda_stream: {time_us(lambda: torch.cuda.current_stream().cuda_stream):7.1f} us")
