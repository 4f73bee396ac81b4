#!/usr/bin/env bash
# Call 7 (twenty-second session, one GPU, warm after call 6, whose runner read standard input, which spawned
# ranks cannot import): the route_* cases at 8 ranks under the MPS daemon call 5 started.
set -u
export EP_PLUGIN_RANKS_PER_GPU=8 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=12 CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -c "import ep_plugin._C_nvshmem" || python3 -m pip install -q --no-build-isolation --no-deps -e .
cp benchmarks/results/2026-11-25_h100/call6/route8.py tests/route8.py
cd tests && timeout -k 5 220 python3 route8.py 2>&1 | grep -v "^ep_plugin env" | tail -40 | tee $OUT/route8.txt
