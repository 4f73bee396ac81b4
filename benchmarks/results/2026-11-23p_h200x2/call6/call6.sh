#!/usr/bin/env bash
# Call 6 (sixteenth session): main after the review that removed the direct dispatch's lost diagnostics:
# the ring and direct case tests, the timeout tests, one bench run of each path per dtype.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="rings_bf16_24||
direct_bf16_24||--config $D
rings_fp8_24||--dtype fp8
direct_fp8_24||--dtype fp8 --config $D" \
OUT=$ALL/c DEADLINE_S=330 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="direct_outputs or test_cases_multi_rank" STAGES="build tests timeouts variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -8
echo "##### bench"; grep -h "^ep_plugin bench\|^verified\|^dispatch\|^combine\|variant" $ALL/c/*.log | sed 's/.*results_dir.//' | head -50
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
