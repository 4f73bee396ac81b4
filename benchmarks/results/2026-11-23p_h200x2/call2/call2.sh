#!/usr/bin/env bash
# Call 2 (sixteenth session): the direct dispatch with fewer sender warps per block (EP_PLUGIN_DIRECT_WARPS),
# two region blocks per dispatch; the direct case tests again.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="rings_bf16_24||
direct_bf16_24||--config $D
direct_bf16_24_w8|EP_PLUGIN_DIRECT_WARPS=8|--config $D
direct_bf16_24_w10|EP_PLUGIN_DIRECT_WARPS=10|--config $D
direct_bf16_24_w12|EP_PLUGIN_DIRECT_WARPS=12|--config $D
direct_fp8_24_w8|EP_PLUGIN_DIRECT_WARPS=8|--dtype fp8 --config $D
direct_fp8_24_w12|EP_PLUGIN_DIRECT_WARPS=12|--dtype fp8 --config $D
direct_bf16_16||--num-sms 16 --config $D
direct_bf16_16_w8|EP_PLUGIN_DIRECT_WARPS=8|--num-sms 16 --config $D
direct_bf16_16_w12|EP_PLUGIN_DIRECT_WARPS=12|--num-sms 16 --config $D
direct_fp8_16_w12|EP_PLUGIN_DIRECT_WARPS=12|--dtype fp8 --num-sms 16 --config $D" \
OUT=$ALL/c DEADLINE_S=560 HANG_RESERVE_S=0 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="direct_outputs" STAGES="build tests variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error\|Error\|timeout" $ALL/c/tests.log | tail -30
echo "##### bench"; grep -h "^ep_plugin bench\|^=== bench\|^verified\|^dispatch\|^combine\|^cached\|variant" $ALL/c/*.log | sed 's/.*results_dir.//' | head -120
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
