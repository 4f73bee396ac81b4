#!/usr/bin/env bash
# Call 4 (nineteenth session): branch combine-weights-beside (the weights copy on the signal stream,
# beside the rows). The multi-rank case tests (every combine path), the bench with the reference at
# BF16 24 and 16 SMs, and the weights-first variant (the code of call 3) at 24 SMs.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=250 HANG_RESERVE_S=0 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="test_cases_multi_rank and not direct and not register" \
  STAGES="build tests variants" \
  VARIANTS="beside|EP_PLUGIN_COMBINE_WEIGHTS_BESIDE=1|
first|EP_PLUGIN_COMBINE_WEIGHTS_BESIDE=0|
beside2|EP_PLUGIN_COMBINE_WEIGHTS_BESIDE=1|
first2|EP_PLUGIN_COMBINE_WEIGHTS_BESIDE=0|
beside_sms16|EP_PLUGIN_COMBINE_WEIGHTS_BESIDE=1|--num-sms 16" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log | tail -8
echo "##### bench"; grep -h "^=== bench\|^verified\|^combine" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -40
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
