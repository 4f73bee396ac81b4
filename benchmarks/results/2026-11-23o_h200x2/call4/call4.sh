#!/usr/bin/env bash
# Call 4: branch dispatch-bulk-receivers. Variants first (receivers by bulk copies against main's
# default in the same build), then the 2-rank case tests with EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1.
set -u
export MAX_JOBS=16
ALL=$OUT
VARIANTS="bf16_main||
bf16_recv|EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1|
fp8_main||--dtype fp8
fp8_recv|EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1|--dtype fp8
bf16_16_main||--num-sms 16
bf16_16_recv|EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1|--num-sms 16
fp8_16_recv|EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1|--dtype fp8 --num-sms 16
bf16_recv_again|EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1|" \
OUT=$ALL/c BUDGET_S=200 BENCH_TIMEOUT=30 STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/t TEST_TIMEOUT=70 EP_PLUGIN_DISPATCH_BULK_RECEIVERS=1 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank and not other and not register" STAGES="tests" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt
echo "##### variants"; grep -h "^=== bench\|^dispatch\|^combine" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -60
echo "##### tests"; tail -5 $ALL/t/tests.log
cd $ALL && tar -czf all.tgz c t stdout.txt && rm -rf c t stdout.txt
