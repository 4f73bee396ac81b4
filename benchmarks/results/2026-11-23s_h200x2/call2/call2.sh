#!/usr/bin/env bash
# Call 2 (nineteenth session): branch combine-early-rows after call 1: the staging area is refilled by a
# memset after the reduction (not by the SMs), and weights are read wherever combined weights are asked.
# Same tests as call 1 (combine paths, CUDA graph, async, 1000 iterations, timeouts), the bench with
# the reference, and variants: early rows off (the old path) and on, at 24 / 16 / 8 SMs.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=330 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank or back_to_back or graph or async_events" \
  STAGES="build tests timeouts bench variants" \
  VARIANTS="early0|EP_PLUGIN_COMBINE_EARLY_ROWS=0|
early0_sms16|EP_PLUGIN_COMBINE_EARLY_ROWS=0|--num-sms 16
default|EP_PLUGIN_COMBINE_COPY_PIECES=0|
default_sms16|EP_PLUGIN_COMBINE_COPY_PIECES=0|--num-sms 16
pieces4_sms16|EP_PLUGIN_COMBINE_COPY_PIECES=4|--num-sms 16
default_sms8|EP_PLUGIN_COMBINE_COPY_PIECES=0|--num-sms 8" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -16
echo "##### bench"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -80
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
