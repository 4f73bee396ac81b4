#!/usr/bin/env bash
# Call 2 (twenty-sixth session, 2x H200): where the host's time per call goes (benchmarks/profile_host.py: host time
# of layout / dispatch / cached dispatch / combine, then cProfile of the same rounds) at 128 and 4096 tokens; then
# FP8 at 24 SMs three more times (the bench's host column beside the GPU's), SM clocks logged.
set -u
export MAX_JOBS=16 CLOCK_LOG=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ALL=$OUT
V="fp8_e||--dtype fp8 --iters 30
fp8_f||--dtype fp8 --iters 30
fp8_g||--dtype fp8 --iters 30"
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
for t in 128 4096; do
  timeout 120 python3 benchmarks/profile_host.py --tokens $t --iters 200 --top 40 > $ALL/host_$t.log 2>&1
  echo "profile_host $t tokens: rc=$?" >> $ALL/c/summary.txt
done
OUT=$ALL/v BENCH_TIMEOUT=60 VARIANTS="$V" STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/v/summary.txt
grep -h "^=== bench\|^dispatch\|^combine" $ALL/v/bench.log | sed 's/.*results_dir.//' | cut -c1-150
for t in 128 4096; do echo "##### host $t"; grep -A3 "^host us" $ALL/host_$t.log; grep -B2 -A45 "by own time" $ALL/host_$t.log | cut -c1-140 | head -50; done
cd $ALL && tar -czf all.tgz c v stdout.txt 2>/dev/null; cp v/bench.log bench.log; cp v/clocks.log clocks.log; rm -rf c v stdout.txt
