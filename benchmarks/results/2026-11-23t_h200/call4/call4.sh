#!/usr/bin/env bash
# Call 4 (twentieth session, one H200). What sets the direct dispatch's rate per SM, at 1 rank (rows
# copied within the GPU): Nsight Compute on the default build, then the cached dispatch on 8 and 16
# blocks with three shapes of the bulk-copy pipeline (stages x piece bytes per warp: 8 x 1792 (default),
# 4 x 3584, 12 x 1152).
set -u
export MAX_JOBS=16
ALL=$OUT
variants() {  # variants NAME NVCC_FLAGS
  OUT=$ALL/$1 BENCH_RANKS=1 BENCH_TIMEOUT=60 EP_PLUGIN_NVCC_FLAGS="$2" \
    VARIANTS=$'blocks8|EP_PLUGIN_DIRECT_MAX_BLOCKS=8|--num-sms 48\nblocks16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--num-sms 48' \
    STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_$1.txt 2>&1
}
variants default ""
EP_PLUGIN_DIRECT_MAX_BLOCKS=16 timeout -k 5 150 ncu --kernel-name regex:direct_dispatch_kernel --launch-skip 4 \
  --launch-count 1 --set full -o $ALL/ncu_direct python3 -m ep_plugin bench --ranks 1 --num-sms 48 --no-baseline \
  --no-check --warmup 3 --iters 3 > $ALL/ncu.log 2>&1
ncu --import $ALL/ncu_direct.ncu-rep --page details > $ALL/ncu_details.txt 2>&1
variants stages4x3584 "-DEP_PLUGIN_BULK_STAGES=4 -DEP_PLUGIN_BULK_PIECE_BYTES=3584"
variants stages12x1152 "-DEP_PLUGIN_BULK_STAGES=12 -DEP_PLUGIN_BULK_PIECE_BYTES=1152"
for d in default stages4x3584 stages12x1152; do
  echo "##### $d"; cat $ALL/$d/summary.txt | grep -v "^variant"
  grep -h "^=== bench\|^dispatch_cached" $ALL/$d/bench.log | sed 's/.*results_dir.//'
done
echo "##### ncu"; tail -3 $ALL/ncu.log
grep -E "Duration|Throughput|Busy|Issue Slots|Warp Cycles Per|Active Warps|Stall|L2 Hit|DRAM|Shared|Registers|Achieved" $ALL/ncu_details.txt | head -60
cd $ALL && tar -czf all.tgz default stages4x3584 stages12x1152 stdout_*.txt ncu.log ncu_details.txt && rm -rf default stages4x3584 stages12x1152 stdout_*.txt
