#!/usr/bin/env bash
# Call 3 (twenty-second session, one GPU). Call 2: the low-latency file at 8 ranks sharing the GPU under
# MPS died of an illegal memory access in the cases' launch (every rank aborted; the case unknown). Here:
# each case's name as it starts (EP_TEST_TRACE_CASES=1), launches made synchronous (CUDA_LAUNCH_BLOCKING=1)
# so that the fault names its call, at 8 ranks and then at 4 (is it the rank count or the sharing?).
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ALL=$OUT
mkdir -p $ALL/logs
{ nvidia-smi; python3 -m pip install --no-build-isolation --no-deps -e . ; } > $ALL/logs/build.log 2>&1 || { tail -30 $ALL/logs/build.log; exit 1; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ep_mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" || echo "MPS did not start"
for n in 8 4; do
  EP_PLUGIN_RANKS_PER_GPU=$n CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) EP_TEST_RANKS=$n EP_TEST_TRACE_CASES=1 \
    CUDA_LAUNCH_BLOCKING=1 timeout -k 10 230 python3 -m pytest -x -q -rs tests/test_native_low_latency.py \
    -k "test_native_low_latency and not fp32" > $ALL/logs/ll_$n.log 2>&1
  echo "##### $n ranks: rc=$? after $SECONDS s"
  grep -h "case_runner: pid" $ALL/logs/ll_$n.log | awk '{print $5}' | sort | uniq -c | sort -k1,1n | tail -4
  grep -h "case_runner: pid" $ALL/logs/ll_$n.log | tail -9
  grep -h -m6 -B2 -A12 "Error\|error:" $ALL/logs/ll_$n.log | grep -v "^frame\|process.join" | cut -c1-300 | head -60
  grep -h "passed\|failed" $ALL/logs/ll_$n.log | tail -3
done
echo quit | nvidia-cuda-mps-control
cd $ALL && tar -czf all.tgz logs && rm -rf logs
