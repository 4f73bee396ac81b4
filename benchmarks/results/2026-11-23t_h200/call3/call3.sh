#!/usr/bin/env bash
# Call 3 (twentieth session, one H200). What limits the direct dispatch without NVLink: its block count
# swept at 1 rank (rows copied within the GPU only) and at 2 ranks sharing the GPU under MPS; and the
# copy-first combine alone under MPS.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/one BENCH_RANKS=1 BENCH_TIMEOUT=60 \
  VARIANTS=$'blocks8|EP_PLUGIN_DIRECT_MAX_BLOCKS=8|--num-sms 48\nblocks16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--num-sms 48\nblocks32|EP_PLUGIN_DIRECT_MAX_BLOCKS=32|--num-sms 48\nblocks48|EP_PLUGIN_DIRECT_MAX_BLOCKS=48|--num-sms 48' \
  STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_one.txt 2>&1
OUT=$ALL/two BENCH_RANKS=2 BENCH_TIMEOUT=60 \
  VARIANTS=$'blocks8|EP_PLUGIN_DIRECT_MAX_BLOCKS=8|--num-sms 48\nblocks16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--num-sms 48\nblocks32|EP_PLUGIN_DIRECT_MAX_BLOCKS=32|--num-sms 48\nmain||\ncopy_first|EP_PLUGIN_COMBINE_COPY_FIRST=1|\nmain_again||' \
  STAGES="share variants" bash benchmarks/gpu_session.sh > $ALL/stdout_two.txt 2>&1
for d in one two; do
  echo "##### $d: summary"; cat $ALL/$d/summary.txt
  echo "##### $d: variants"; grep -h "^=== bench\|^verified\|^dispatch\|^combine" $ALL/$d/bench.log | sed 's/.*results_dir.//'
done
cd $ALL && tar -czf all.tgz one two stdout_one.txt stdout_two.txt && rm -rf one two stdout_one.txt stdout_two.txt
