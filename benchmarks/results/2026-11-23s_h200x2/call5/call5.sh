#!/usr/bin/env bash
# Call 5 (nineteenth session): a torch.profiler timeline of main's normal-mode rounds at 4096 tokens
# (benchmarks/profile_timeline.py), and per combine the reduction, the sender's wait kernel, the copies
# and the refill memset in GPU time (.device/combine_timeline.py).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 150 python3 benchmarks/profile_timeline.py --out-dir $ALL/timeline --iters 6 > $ALL/timeline.log 2>&1
echo "timeline rc=$?"
python3 .device/combine_timeline.py $ALL/timeline > $ALL/combine_timeline.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
tail -40 $ALL/timeline.log
head -120 $ALL/combine_timeline.txt
cd $ALL && tar -czf all.tgz c stdout.txt timeline.log combine_timeline.txt && rm -rf c stdout.txt
ls -la $ALL/timeline | head
