#!/usr/bin/env bash
# Call 3: branch dispatch-bulk with bulk copies by default: the native layout and intranode files,
# the timeout tests, the bench with the reference, then the register path in the same call.
set -u
export MAX_JOBS=16
ALL=$OUT
VARIANTS="bf16_regs|EP_PLUGIN_DISPATCH_BULK=0|
fp8_regs|EP_PLUGIN_DISPATCH_BULK=0|--dtype fp8" \
OUT=$ALL/c DEADLINE_S=540 HANG_RESERVE_S=70 BENCH_TIMEOUT=90 TIMEOUTS_FILES=tests/test_native_intranode.py \
  PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py" STAGES="build tests timeouts bench variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -6
echo "##### bench"; grep -h "^ep_plugin bench\|^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -90
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
