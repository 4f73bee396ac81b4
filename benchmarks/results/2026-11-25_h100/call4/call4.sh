#!/usr/bin/env bash
# Call 4 (twenty-second session, one GPU). Call 3: at 8 and at 4 ranks sharing the GPU under MPS every rank ran
# all low-latency cases, and the illegal memory access surfaced only at the end (ctx.destroy's synchronize), so
# the failing case's outcome was lost with the rank. Here each case's outcome goes to stderr as it ends.
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ALL=$OUT
mkdir -p $ALL/logs
python3 -c "import ep_plugin._C_nvshmem" 2>/dev/null || python3 -m pip install --no-build-isolation --no-deps -e . > $ALL/logs/build.log 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ep_mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" || echo "MPS did not start"
n=8
EP_PLUGIN_RANKS_PER_GPU=$n CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) EP_TEST_RANKS=$n EP_TEST_TRACE_CASES=1 \
  CUDA_LAUNCH_BLOCKING=1 timeout -k 10 200 python3 -m pytest -x -q -rs tests/test_native_low_latency.py \
  -k "test_native_low_latency and not fp32" > $ALL/logs/ll_$n.log 2>&1
echo "##### $n ranks: rc=$? after $SECONDS s"
grep -h "case_runner: pid" $ALL/logs/ll_$n.log | grep -v "starting\|: passed" | cut -c1-300 | head -40
grep -h "case_runner: pid" $ALL/logs/ll_$n.log | grep -c ": passed"
echo quit | nvidia-cuda-mps-control
cd $ALL && tar -czf all.tgz logs && rm -rf logs
