#!/usr/bin/env bash
# Call 1: main (build, full native files, timeouts, bench with the reference), then the
# dispatch-sender-split branch (its changed files overlaid on a copy): case tests at P=58, variants.
set -u
ALL=$OUT; ROOT=$PWD; T0=$SECONDS; LIMIT=${CALL_LIMIT:-585}
export MAX_JOBS=16
OUT=$ALL/main DEADLINE_S=330 BENCH_TIMEOUT=90 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py \
  PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py" STAGES="build tests timeouts bench" \
  bash benchmarks/gpu_session.sh > $ALL/main_stdout.txt 2>&1
echo "main part done at $((SECONDS - T0)) s"
rm -rf /tmp/splitsrc && mkdir -p /tmp/splitsrc && tar -C "$ROOT" --exclude=./build --exclude='*.so' -cf - . | tar -C /tmp/splitsrc -xf - \
  && cp -r "$ROOT/.device/split/." /tmp/splitsrc/
cd /tmp/splitsrc
left=$(( LIMIT - (SECONDS - T0) ))
OUT=$ALL/split_tests TEST_TIMEOUT=120 DEADLINE_S=$((left - 5)) BUDGET_S=$((left - 20)) EP_PLUGIN_DISPATCH_SENDER_PERCENT=58 PYTEST_K=test_cases \
  PYTEST_ARGS="tests/test_native_intranode.py" STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/split_tests_stdout.txt 2>&1
echo "split tests done at $((SECONDS - T0)) s"
left=$(( LIMIT - (SECONDS - T0) ))
VARIANTS="bf16_base||
bf16_p58|EP_PLUGIN_DISPATCH_SENDER_PERCENT=58|
fp8_base||--dtype fp8
fp8_p58|EP_PLUGIN_DISPATCH_SENDER_PERCENT=58|--dtype fp8
bf16_16_base||--num-sms 16
bf16_16_p58|EP_PLUGIN_DISPATCH_SENDER_PERCENT=58|--num-sms 16
bf16_p54|EP_PLUGIN_DISPATCH_SENDER_PERCENT=54|
bf16_p62|EP_PLUGIN_DISPATCH_SENDER_PERCENT=62|
fp8_16_base||--dtype fp8 --num-sms 16
fp8_16_p58|EP_PLUGIN_DISPATCH_SENDER_PERCENT=58|--dtype fp8 --num-sms 16
bf16_16_p62|EP_PLUGIN_DISPATCH_SENDER_PERCENT=62|--num-sms 16
fp8_p54|EP_PLUGIN_DISPATCH_SENDER_PERCENT=54|--dtype fp8
bf16_base_again||" \
OUT=$ALL/split_variants BUDGET_S=$((left - 16)) BENCH_TIMEOUT=40 STAGES="variants" bash benchmarks/gpu_session.sh > $ALL/split_variants_stdout.txt 2>&1
echo "variants done at $((SECONDS - T0)) s"
for d in main split_tests split_variants; do echo "##### $d"; cat $ALL/$d/summary.txt; done
echo "##### main bench"; grep -h -A12 "^ep_plugin bench" $ALL/main/bench.log | grep -v "^--$" | head -80
echo "##### variants"; grep -h "^=== bench\|^dispatch\|^combine" $ALL/split_variants/bench.log | sed 's/.*results_dir.//' | head -80
cd $ALL && tar -czf all.tgz main split_tests split_variants *_stdout.txt && rm -rf main split_tests split_variants *_stdout.txt
