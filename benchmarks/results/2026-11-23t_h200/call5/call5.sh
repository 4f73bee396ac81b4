#!/usr/bin/env bash
# Call 5 (twentieth session, one H200, the last device seconds). The bulk pipeline with 3 stages x 4784
# bytes (a 7168-hidden row in 3 pieces): the cached dispatch at 1 rank on 8 and 16 blocks, and on 16
# blocks with 2 ranks sharing the GPU under MPS.
set -u
export MAX_JOBS=16
ALL=$OUT
export EP_PLUGIN_NVCC_FLAGS="-DEP_PLUGIN_BULK_STAGES=3 -DEP_PLUGIN_BULK_PIECE_BYTES=4784"
OUT=$ALL/one BENCH_RANKS=1 BENCH_TIMEOUT=40 \
  VARIANTS=$'blocks8|EP_PLUGIN_DIRECT_MAX_BLOCKS=8|--num-sms 48\nblocks16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--num-sms 48' \
  STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_one.txt 2>&1
OUT=$ALL/two BENCH_RANKS=2 BENCH_TIMEOUT=40 VARIANTS=$'blocks16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--num-sms 48' \
  STAGES="share variants" bash benchmarks/gpu_session.sh > $ALL/stdout_two.txt 2>&1
for d in one two; do echo "##### $d"; cat $ALL/$d/summary.txt | grep -v "^variant"
  grep -h "^=== bench\|^verified\|^dispatch_cached" $ALL/$d/bench.log | sed 's/.*results_dir.//'; done
cd $ALL && tar -czf all.tgz one two stdout_*.txt && rm -rf one two stdout_*.txt
