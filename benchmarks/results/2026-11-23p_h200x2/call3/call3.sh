#!/usr/bin/env bash
# Call 3 (sixteenth session): the direct dispatch on fewer blocks than num_sms (EP_PLUGIN_DIRECT_MAX_BLOCKS), and
# the host time of allocating outputs in the region.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="rings_bf16_24||
rings_fp8_24||--dtype fp8
direct_bf16_24_b16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--config $D
direct_bf16_24_b16_w12|EP_PLUGIN_DIRECT_MAX_BLOCKS=16 EP_PLUGIN_DIRECT_WARPS=12|--config $D
direct_bf16_24_b12|EP_PLUGIN_DIRECT_MAX_BLOCKS=12|--config $D
direct_bf16_24_b20|EP_PLUGIN_DIRECT_MAX_BLOCKS=20|--config $D
direct_fp8_24_b16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--dtype fp8 --config $D
direct_fp8_24_b12|EP_PLUGIN_DIRECT_MAX_BLOCKS=12|--dtype fp8 --config $D
direct_fp8_24_b20|EP_PLUGIN_DIRECT_MAX_BLOCKS=20|--dtype fp8 --config $D
direct_bf16_16_w12|EP_PLUGIN_DIRECT_WARPS=12|--num-sms 16 --config $D
direct_fp8_16||--dtype fp8 --num-sms 16 --config $D" \
OUT=$ALL/c DEADLINE_S=560 HANG_RESERVE_S=0 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="direct_outputs" STAGES="build variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### host time of output allocation"; python3 .device/host_alloc.py 2>&1 | tee $ALL/host_alloc.txt
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error\|Error\|timeout" $ALL/c/tests.log | tail -30
echo "##### bench"; grep -h "^ep_plugin bench\|^=== bench\|^verified\|^dispatch\|^combine\|^cached\|variant" $ALL/c/*.log | sed 's/.*results_dir.//' | head -120
cd $ALL && tar -czf all.tgz c stdout.txt host_alloc.txt && rm -rf c stdout.txt host_alloc.txt
