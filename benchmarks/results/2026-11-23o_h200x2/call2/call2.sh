#!/usr/bin/env bash
# Call 2: branch dispatch-bulk. Variants (bulk-copy senders against the register path), then the
# native intranode tests and the timeout tests with EP_PLUGIN_DISPATCH_BULK=1.
set -u
export MAX_JOBS=16 EP_PLUGIN_DISPATCH_BULK=1
ALL=$OUT
VARIANTS="bf16_regs|EP_PLUGIN_DISPATCH_BULK=0|
bf16_bulk|EP_PLUGIN_DISPATCH_BULK=1|
fp8_regs|EP_PLUGIN_DISPATCH_BULK=0|--dtype fp8
fp8_bulk|EP_PLUGIN_DISPATCH_BULK=1|--dtype fp8
bf16_16_regs|EP_PLUGIN_DISPATCH_BULK=0|--num-sms 16
bf16_16_bulk|EP_PLUGIN_DISPATCH_BULK=1|--num-sms 16
fp8_16_regs|EP_PLUGIN_DISPATCH_BULK=0|--dtype fp8 --num-sms 16
fp8_16_bulk|EP_PLUGIN_DISPATCH_BULK=1|--dtype fp8 --num-sms 16
bf16_bulk_again|EP_PLUGIN_DISPATCH_BULK=1|
fp8_bulk_again|EP_PLUGIN_DISPATCH_BULK=1|--dtype fp8" \
OUT=$ALL/c DEADLINE_S=565 HANG_RESERVE_S=60 BENCH_TIMEOUT=40 TIMEOUTS_FILES=tests/test_native_intranode.py \
  PYTEST_ARGS="tests/test_native_intranode.py" STAGES="build variants tests timeouts" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### variants"; grep -h "^=== bench\|^dispatch\|^combine" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -60
echo "##### tests"; tail -30 $ALL/c/tests.log; tail -8 $ALL/c/timeouts.log
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
