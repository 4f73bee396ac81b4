#!/usr/bin/env bash
# Call 1 (sixteenth session): branch dispatch-direct-outputs: the direct dispatch's case tests (both
# block roles) and the ring cases, then bench variants: rings against direct, BF16/FP8, 24/16 SMs.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="rings_bf16_24||
direct_bf16_24||--config $D
direct_bf16_24_own8|EP_PLUGIN_DIRECT_OWN_BLOCKS=8|--config $D
direct_bf16_24_own6|EP_PLUGIN_DIRECT_OWN_BLOCKS=6|--config $D
direct_bf16_24_own10|EP_PLUGIN_DIRECT_OWN_BLOCKS=10|--config $D
rings_fp8_24||--dtype fp8
direct_fp8_24||--dtype fp8 --config $D
rings_bf16_16||--num-sms 16
direct_bf16_16||--num-sms 16 --config $D
direct_bf16_16_own6|EP_PLUGIN_DIRECT_OWN_BLOCKS=6|--num-sms 16 --config $D
rings_fp8_16||--dtype fp8 --num-sms 16
direct_fp8_16||--dtype fp8 --num-sms 16 --config $D" \
OUT=$ALL/c DEADLINE_S=560 HANG_RESERVE_S=0 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="direct_outputs or test_cases_multi_rank_register" STAGES="build tests variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error\|Error\|timeout" $ALL/c/tests.log | tail -30
echo "##### bench"; grep -h "^ep_plugin bench\|^=== bench\|^verified\|^dispatch\|^combine\|^cached\|variant" $ALL/c/*.log | sed 's/.*results_dir.//' | head -120
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
